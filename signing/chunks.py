"""Chunk-digest tables (docs/signing.md#formats-what-is-stored): hashed from a model's weight
layers, signed, pushed and found again.

A range read cannot be checked against a whole-blob sha256, so the pusher publishes a table of
chunk digests, signed and bound to the model manifest digest, and the loader checks every chunk
before it reaches a device. The table travels as a DSSE in-toto statement (subject = manifest
digest, predicateType ``https://modelpack.dev/chunk-digests/v1``) in a Sigstore bundle, pushed as a
referrer with its own ``artifactType`` (``application/vnd.modelpack.chunk-digests.v1+json``) so
cosign never mistakes it for an image signature. The table itself and its wire form:
``chunk_table``.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from modelpack.mediatypes import LayerKind, layer_filepath, parse_layer_media_type
from modelpack.mediatypes.annotations import safe_relative_path
from modelpack.signing.bundle import sign_statement
from modelpack.signing.chunk_bounds import (
    ColumnSpec,
    aligned_starts,
    column_blocks,
    fixed_starts,
)
from modelpack.signing.chunk_table import (
    MAX_CHUNK_SIZE,
    MIN_CHUNK_SIZE,
    ChunkTable,
    ColumnBlocks,
    LayerChunks,
)
from modelpack.signing.column_digests import ColumnDigester
from modelpack.signing.keys import PrivateKey, PublicKey
from modelpack.signing.referrers import (
    ARTIFACT_TYPE_CHUNK_DIGESTS,
    find_bundle_referrers,
    push_bundle_referrer,
    skipped,
)
from modelpack.signing.statements import PREDICATE_CHUNK_DIGESTS, Statement

from modelpack.errors import (
    BundleError,
    ChunkDigestMismatch,
    ChunkTableError,
    DigestMismatchError,
    ModelpackError,
    SafetensorsError,
    SizeMismatchError,
)
from modelpack.events import EventLog, NullEventLog
from modelpack.oci.descriptor import Descriptor, Manifest
from modelpack.packing.safetensors_format import read_header_from
from modelpack.targets.base import ReadableTarget, Target

DEFAULT_CHUNK_SIZE = 4 * 1024 * 1024  # fits row-split shares: see docs/loader.md, bytes per rank

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "ChunkDigestMismatch",
    "ChunkTable",
    "ChunkTableError",
    "ColumnBlocks",
    "LayerChunks",
    "chunk_table_from_directory",
    "compute_chunk_table",
    "load_chunk_table",
    "push_chunk_table",
    "weight_layers",
]


def weight_layers(manifest: Manifest) -> list[Descriptor]:
    """The layers a chunk table covers (what the loader range-reads)."""
    out = []
    for layer in manifest.layers:
        lt = parse_layer_media_type(layer.media_type)
        if lt is not None and lt.kind is LayerKind.WEIGHT:
            out.append(layer)
    return out


def _read_full(stream: Any, view: memoryview) -> int:
    """Fill ``view`` from ``stream`` (fewer bytes only at EOF)."""
    n = 0
    readinto = getattr(stream, "readinto", None)
    while n < len(view):
        if readinto is not None:
            got = readinto(view[n:])
        else:
            data = stream.read(len(view) - n)
            got = len(data)
            view[n : n + got] = data
        if not got:
            break
        n += got
    return n


def _layer_bounds(
    target: ReadableTarget, layer: Descriptor, chunk_size: int, aligned: bool
) -> tuple[list[int], list[ColumnSpec]]:
    """Where the layer's chunks begin, and its column blocks: aligned to its tensors when asked and
    it is a safetensors blob (its header read first), else every ``chunk_size`` bytes and none."""
    if not aligned or layer.size < 8:
        return fixed_starts(layer.size, chunk_size), []
    stream = target.fetch_blob(layer)
    try:
        header = read_header_from(stream, str(layer.digest), layer.size)
    except SafetensorsError:
        return fixed_starts(layer.size, chunk_size), []  # not safetensors (GGUF, .bin): nothing to align to
    finally:
        stream.close()
    return aligned_starts(header, layer.size, chunk_size), column_blocks(header, layer.size, chunk_size)


class _ColumnFeed:
    """The column blocks' digesters of one layer, fed the blob's bytes in order."""

    def __init__(self, specs: Sequence[ColumnSpec]) -> None:
        self.specs = list(specs)
        self.digesters = [ColumnDigester(rows, rb, k) for _, rows, rb, k in self.specs]
        self._next = 0  # the first spec not yet complete

    def feed(self, offset: int, data: memoryview) -> None:
        end = offset + len(data)
        i = self._next
        while i < len(self.specs):
            start, rows, rb, _ = self.specs[i]
            if start >= end:
                break
            a, b = max(start, offset), min(start + rows * rb, end)
            if b > a:
                self.digesters[i].update(data[a - offset : b - offset])
            if self.digesters[i].complete:
                self._next = i + 1
            i += 1

    def blocks(self) -> tuple[ColumnBlocks, ...]:
        return tuple(
            ColumnBlocks(start, rows, rb, tuple(d.digests()))
            for (start, rows, rb, _), d in zip(self.specs, self.digesters, strict=True)
        )


def _hash_layer(
    target: ReadableTarget, layer: Descriptor, chunk_size: int, aligned: bool = False
) -> LayerChunks:
    """Chunk digests, column-block digests and the whole-blob digest in one read. The two sha256
    runs of each chunk go on two threads (hashlib releases the GIL), so checking the blob costs no
    extra wall time when a second core is free; the column blocks hash each 2-D tensor once more
    (about twice the signing time on 2 cores: docs/signing.md)."""
    starts, specs = _layer_bounds(target, layer, chunk_size, aligned)
    columns = _ColumnFeed(specs)
    bounds = [*starts[1:], layer.size]
    digests: list[bytes] = []
    whole = hashlib.sha256()
    size = 0
    view = memoryview(bytearray(chunk_size))  # one buffer, reused for every chunk
    stream = target.fetch_blob(layer)
    try:
        with ThreadPoolExecutor(max_workers=1) as helper:
            for start, end in zip(starts, bounds, strict=True):
                n = _read_full(stream, view[: end - start])
                size += n
                chunk = view[:n]
                pending = helper.submit(lambda v: hashlib.sha256(v).digest(), chunk)
                whole.update(chunk)
                columns.feed(start, chunk)
                digests.append(pending.result())  # before the buffer is refilled
                if n < end - start:
                    break
            if size == layer.size and _read_full(stream, view[:1]):
                size += 1  # more bytes than the descriptor says
    finally:
        stream.close()
    if size != layer.size:
        raise SizeMismatchError(layer.digest, layer.size, size, source=target.name)
    actual = "sha256:" + whole.hexdigest()
    if actual != layer.digest:
        raise DigestMismatchError(layer.digest, actual, what="blob", source=target.name)
    return LayerChunks(layer.size, digests, tuple(starts) if aligned else None, columns.blocks())


def compute_chunk_table(
    target: ReadableTarget,
    manifest: Manifest,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    *,
    layers: Sequence[Descriptor] | None = None,
    jobs: int = 2,
    aligned: bool = False,
) -> ChunkTable:
    """Hash every weight layer blob in chunks, checking each whole-blob digest in the same pass.

    ``aligned``: chunks begin and end where the tensors (and their dim-0 parts) do
    (``chunk_bounds``), so a rank reading its share reads no chunk only for another rank's bytes;
    else every ``chunk_size`` bytes (the form verifiers before the aligned one accept)."""
    if not MIN_CHUNK_SIZE <= chunk_size <= MAX_CHUNK_SIZE:
        raise ChunkTableError(f"chunk size {chunk_size} out of range [{MIN_CHUNK_SIZE}, {MAX_CHUNK_SIZE}]")
    todo = list(layers) if layers is not None else weight_layers(manifest)
    unique = {str(layer.digest): layer for layer in todo}
    with ThreadPoolExecutor(max_workers=max(1, min(jobs, len(unique) or 1))) as pool:
        futures = {
            d: pool.submit(_hash_layer, target, layer, chunk_size, aligned) for d, layer in unique.items()
        }
        result = {d: f.result() for d, f in futures.items()}
    return ChunkTable(str(manifest.digest), chunk_size, result)


class _DirectoryLayers:
    """A checkpoint directory read by manifest layer (only ``fetch_blob``), so a push hashes its
    chunk table from the files it just uploaded instead of downloading them again."""

    def __init__(self, directory: str, manifest: Manifest) -> None:
        self.name = f"dir:{directory}"
        self._paths: dict[str, str] = {}
        for layer in manifest.layers:
            rel = layer_filepath(layer.annotations)
            if rel:
                self._paths[str(layer.digest)] = os.path.join(directory, safe_relative_path(rel))

    def covers(self, layers: Sequence[Descriptor]) -> bool:
        for layer in layers:
            path = self._paths.get(str(layer.digest))
            if path is None or not os.path.isfile(path) or os.path.getsize(path) != layer.size:
                return False
        return True

    def fetch_blob(self, descriptor: Descriptor, offset: int = 0) -> Any:
        f = open(self._paths[str(descriptor.digest)], "rb")
        if offset:
            f.seek(offset)
        return f


def chunk_table_from_directory(
    directory: str, manifest: Manifest, chunk_size: int = DEFAULT_CHUNK_SIZE, *, aligned: bool = False
) -> ChunkTable | None:
    """The chunk table hashed from the checkpoint files themselves (each file's whole sha256 is
    checked against its layer in the same pass); None when the weight layers are not files there
    (re-sharded with ``--max-file-size``): then the blobs must be read back from the target."""
    layers = _DirectoryLayers(directory, manifest)
    weights = weight_layers(manifest)
    if not weights or not layers.covers(weights):
        return None
    return compute_chunk_table(layers, manifest, chunk_size, aligned=aligned)  # type: ignore[arg-type]


def push_chunk_table(
    target: Target, manifest_desc: Descriptor, table: ChunkTable, private_key: PrivateKey
) -> Descriptor:
    """Sign the table (subject = manifest digest) and push it as a referrer; returns its descriptor."""
    if table.manifest_digest != manifest_desc.digest:
        raise ChunkTableError(
            f"chunk table is for {table.manifest_digest}, not for manifest {manifest_desc.digest}"
        )
    statement = Statement(
        ({"digest": {"sha256": manifest_desc.digest.hex}},), PREDICATE_CHUNK_DIGESTS, table.to_predicate()
    )
    bundle = sign_statement(statement, private_key)
    return push_bundle_referrer(
        target,
        manifest_desc,
        bundle,
        artifact_type=ARTIFACT_TYPE_CHUNK_DIGESTS,
        predicate_type=PREDICATE_CHUNK_DIGESTS,
    )


def load_chunk_table(
    target: ReadableTarget,
    manifest_desc: Descriptor,
    trusted_public_keys: Sequence[PublicKey],
    *,
    manifest: Manifest | None = None,
    events: EventLog | None = None,
) -> ChunkTable | None:
    """The signed chunk table of ``manifest_desc``; None when there is none.

    A malformed or foreign table next to a valid one is skipped (a ``signing.referrer_skipped``
    event). Raises ``ChunkTableError`` when tables exist but none is signed by a trusted key and
    bound to exactly this manifest digest (a replayed or forged table is an attack, not an
    absence); the message says why each was rejected.
    """
    events = events or NullEventLog()
    stored = find_bundle_referrers(target, manifest_desc, ARTIFACT_TYPE_CHUNK_DIGESTS, events=events)
    if not stored:
        return None
    problems: list[str] = []
    for item in stored:
        if item.bundle is None:
            problems.append(item.error)
            continue
        signer = item.bundle.verify(list(trusted_public_keys))
        if signer is None:
            problems.append(
                f"referrer {item.descriptor.digest}: not signed by a trusted key (hint {item.bundle.key_hint[:16] or 'none'})"
            )
            continue
        try:
            st = item.bundle.statement
            if st.predicate_type != PREDICATE_CHUNK_DIGESTS:
                raise ChunkTableError(f"predicateType {st.predicate_type!r}")
            if st.subject_sha256 != [manifest_desc.digest.hex]:
                raise ChunkTableError(
                    f"statement subject {st.subject_sha256} is not manifest {manifest_desc.digest}"
                )
            table = ChunkTable.from_predicate(st.predicate, manifest)
            if table.manifest_digest != manifest_desc.digest:
                raise ChunkTableError(f"predicate manifestDigest {table.manifest_digest} mismatch")
        except (ChunkTableError, BundleError, ModelpackError) as exc:
            problems.append(f"referrer {item.descriptor.digest}: {exc}")
            skipped(events, manifest_desc, item, str(exc))
            continue
        return table
    raise ChunkTableError(
        f"{target.name}: chunk tables of {manifest_desc.digest} found but none is valid: "
        + "; ".join(problems)
    )
