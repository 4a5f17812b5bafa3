"""Chunk-digest tables (docs/signing.md#formats-what-is-stored): per weight layer, the sha256 of every fixed-size chunk.

A range read cannot be checked against a whole-blob sha256, so the pusher publishes a table of
chunk digests, signed and bound to the model manifest digest, and the loader checks every chunk
before it reaches a device. The table travels as a DSSE in-toto statement (subject = manifest
digest, predicateType ``https://modelpack.dev/chunk-digests/v1``) in a Sigstore bundle, pushed as a
referrer with its own ``artifactType`` (``application/vnd.modelpack.chunk-digests.v1+json``) so
cosign never mistakes it for an image signature.

Predicate::

    {"manifestDigest": "sha256:…", "chunkSize": 16777216, "algorithm": "sha256",
     "layers": {"sha256:<layer>": {"size": 123, "chunks": ["<hex>", …]}}}

A layer entry with ``"runs": [[start, length, count], …]`` has chunks aligned to its tensors
(``chunk_bounds``; ``chunkSize`` is then the longest chunk): what ``compute_chunk_table(...,
aligned=True)`` and ``modelpack sign`` write. A layer without ``runs`` is cut every ``chunkSize``
bytes, as every table published before; both verify the same way. Aligned entries also carry
``"columns": [[start, rows, rowBytes, blocks], …]`` and ``"columnChunks": ["<hex>", …]``: the
digests of the column blocks of its 2-D tensors (``chunk_bounds.column_blocks``), which let a
column-split share be read and checked without the other ranks' columns. A verifier that does not
know them ignores them (the contiguous chunks still tile the blob).
"""

from __future__ import annotations

import bisect
import hashlib
import hmac
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from modelpack.mediatypes import LayerKind, layer_filepath, parse_layer_media_type
from modelpack.mediatypes.annotations import safe_relative_path
from modelpack.signing.bundle import sign_statement
from modelpack.signing.chunk_bounds import (
    ColumnSpec,
    aligned_starts,
    column_blocks,
    column_specs_from,
    fixed_starts,
    runs_of,
    starts_from_runs,
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
from modelpack.oci.digest import Digest
from modelpack.packing.safetensors_format import read_header_from
from modelpack.targets.base import RangeCheck, ReadableTarget, Target

DEFAULT_CHUNK_SIZE = 4 * 1024 * 1024  # fits row-split shares: see docs/loader.md, bytes per rank
MIN_CHUNK_SIZE = 64 * 1024
MAX_CHUNK_SIZE = 1024 * 1024 * 1024

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


@dataclass(frozen=True)
class ColumnBlocks:
    """A 2-D tensor's columns signed in ``len(digests)`` equal blocks: block ``j`` is every row's
    ``j``-th slice of ``block_bytes``, rows in order (``chunk_bounds.column_blocks``)."""

    start: int
    rows: int
    row_bytes: int
    digests: tuple[bytes, ...]

    @property
    def end(self) -> int:
        return self.start + self.rows * self.row_bytes

    @property
    def block_bytes(self) -> int:
        return self.row_bytes // len(self.digests)

    @property
    def spec(self) -> ColumnSpec:
        return (self.start, self.rows, self.row_bytes, len(self.digests))


@dataclass(frozen=True)
class LayerChunks:
    size: int
    digests: list[bytes]  # raw 32-byte sha256 per chunk; the last chunk may be short
    # aligned tables: where each chunk begins (ascending, from 0); None: every chunk_size bytes
    starts: tuple[int, ...] | None = None
    columns: tuple[ColumnBlocks, ...] = ()  # aligned tables: the 2-D tensors' column blocks


@dataclass(frozen=True)
class ChunkTable:
    manifest_digest: str
    chunk_size: int  # fixed layers: the chunk length; aligned layers: the longest chunk
    layers: dict[str, LayerChunks] = field(default_factory=dict)

    @property
    def aligned(self) -> bool:
        """Whether any layer's chunks are aligned to its tensors (``runs`` on the wire)."""
        return any(lc.starts is not None for lc in self.layers.values())

    def chunk_range(self, layer_digest: str, index: int) -> tuple[int, int]:
        """(offset, length) of chunk ``index`` in the layer blob."""
        layer = self._layer(layer_digest)
        if not 0 <= index < len(layer.digests):
            raise ChunkTableError(
                f"layer {layer_digest}: chunk {index} out of range (0..{len(layer.digests) - 1})"
            )
        if layer.starts is None:
            start = index * self.chunk_size
            return start, min(self.chunk_size, layer.size - start)
        start = layer.starts[index]
        end = layer.starts[index + 1] if index + 1 < len(layer.starts) else layer.size
        return start, end - start

    def chunk_index(self, layer_digest: str, offset: int) -> int:
        """The index of the chunk holding byte ``offset`` of the layer."""
        layer = self._layer(layer_digest)
        if layer.starts is None:
            return offset // self.chunk_size
        return max(0, bisect.bisect_right(layer.starts, offset) - 1)

    def chunks_covering(self, layer_digest: str, start: int, end: int) -> range:
        """Indexes of the chunks holding any byte of ``[start, end)``."""
        if end <= start:
            return range(0)
        return range(self.chunk_index(layer_digest, start), self.chunk_index(layer_digest, end - 1) + 1)

    def chunk_at(self, layer_digest: str, offset: int) -> tuple[int, int]:
        """(offset, length) of the chunk holding byte ``offset`` of the layer."""
        return self.chunk_range(layer_digest, self.chunk_index(layer_digest, offset))

    def column_blocks(self, layer_digest: str, start: int, end: int) -> ColumnBlocks | None:
        """The signed column blocks of the tensor at ``[start, end)`` of the layer, if any."""
        layer = self.layers.get(str(layer_digest))
        if layer is None or not layer.columns:
            return None
        i = bisect.bisect_left([c.start for c in layer.columns], start)
        if i < len(layer.columns) and layer.columns[i].start == start and layer.columns[i].end == end:
            return layer.columns[i]
        return None

    def _layer(self, layer_digest: str) -> LayerChunks:
        try:
            return self.layers[str(layer_digest)]
        except KeyError:
            raise ChunkTableError(
                f"chunk table of {self.manifest_digest} has no entry for layer {layer_digest}"
            ) from None

    def verify_chunk(self, layer_digest: str, index: int, data: bytes | bytearray | memoryview) -> None:
        """Raise ``ChunkDigestMismatch`` unless ``data`` is exactly chunk ``index`` of the layer."""
        layer = self._layer(layer_digest)
        _, length = self.chunk_range(layer_digest, index)
        expected = layer.digests[index]
        actual = hashlib.sha256(data).digest()
        if len(data) != length or not hmac.compare_digest(actual, expected):
            raise ChunkDigestMismatch(
                str(layer_digest),
                index,
                f"sha256:{expected.hex()} ({length} bytes)",
                f"sha256:{actual.hex()} ({len(data)} bytes)",
            )

    def wrong_chunks(self, layer_digest: str, offset: int, data: bytes) -> list[tuple[int, int]]:
        """(offset, length) of each whole chunk inside ``data`` (read at ``offset`` of the layer)
        whose bytes do not match the table; chunks ``data`` covers only in part are not judged."""
        layer = self._layer(layer_digest)
        wrong = []
        first = self.chunk_index(layer_digest, offset)
        if first < len(layer.digests) and self.chunk_range(layer_digest, first)[0] < offset:
            first += 1  # begins before ``data``: not judged
        for idx in range(first, len(layer.digests)):
            c0, clen = self.chunk_range(layer_digest, idx)
            if c0 + clen > offset + len(data):
                break
            part = data[c0 - offset : c0 - offset + clen]
            if not hmac.compare_digest(hashlib.sha256(part).digest(), layer.digests[idx]):
                wrong.append((c0, clen))
        return wrong

    def range_check(self, layer_digest: str) -> RangeCheck:
        """``wrong_chunks`` for one layer: what a mirrored range read uses to refetch bad chunks."""
        return lambda offset, data: self.wrong_chunks(layer_digest, offset, data)

    # -------------------------------------------------------------- wire form
    def to_predicate(self) -> dict[str, Any]:
        return {
            "manifestDigest": str(self.manifest_digest),
            "chunkSize": self.chunk_size,
            "algorithm": "sha256",
            "layers": {d: self._layer_doc(lc) for d, lc in sorted(self.layers.items())},
        }

    @staticmethod
    def _layer_doc(lc: LayerChunks) -> dict[str, Any]:
        doc: dict[str, Any] = {"size": lc.size, "chunks": [c.hex() for c in lc.digests]}
        if lc.starts is not None:
            doc["runs"] = runs_of(lc.starts, lc.size)
        if lc.columns:
            doc["columns"] = [list(c.spec) for c in lc.columns]
            doc["columnChunks"] = [d.hex() for c in lc.columns for d in c.digests]
        return doc

    @classmethod
    def from_predicate(cls, doc: Any, manifest: Manifest | None = None) -> ChunkTable:
        """Parse and check a predicate; with ``manifest`` also check every layer belongs to it."""
        if not isinstance(doc, dict):
            raise ChunkTableError("chunk table predicate must be an object")
        if doc.get("algorithm", "sha256") != "sha256":
            raise ChunkTableError(f"chunk table algorithm {doc.get('algorithm')!r}; only sha256 is accepted")
        chunk_size = doc.get("chunkSize")
        if (
            isinstance(chunk_size, bool)
            or not isinstance(chunk_size, int)
            or not (MIN_CHUNK_SIZE <= chunk_size <= MAX_CHUNK_SIZE)
        ):
            raise ChunkTableError(f"chunk table chunkSize {chunk_size!r} out of range")
        try:
            manifest_digest = Digest(doc.get("manifestDigest", ""))
        except ValueError as exc:
            raise ChunkTableError(f"chunk table manifestDigest: {exc}") from exc
        layers_doc = doc.get("layers")
        if not isinstance(layers_doc, dict):
            raise ChunkTableError("chunk table layers must be an object")
        sizes = {str(layer.digest): layer.size for layer in manifest.layers} if manifest else None
        layers: dict[str, LayerChunks] = {}
        for digest, entry in layers_doc.items():
            try:
                Digest(digest)
            except ValueError as exc:
                raise ChunkTableError(f"chunk table layer key: {exc}") from exc
            if not isinstance(entry, dict):
                raise ChunkTableError(f"chunk table layer {digest}: must be an object")
            size, chunks = entry.get("size"), entry.get("chunks")
            if isinstance(size, bool) or not isinstance(size, int) or size < 0:
                raise ChunkTableError(f"chunk table layer {digest}: bad size {size!r}")
            if sizes is not None and sizes.get(digest) != size:
                raise ChunkTableError(
                    f"chunk table layer {digest} ({size} bytes) is not a layer of manifest {manifest_digest}"
                )
            starts: tuple[int, ...] | None = None
            if "runs" in entry:  # aligned: the runs must tile the blob exactly
                starts = tuple(
                    starts_from_runs(entry["runs"], size, chunk_size, f"chunk table layer {digest}")
                )
                expected_n = len(starts)
            else:
                expected_n = -(-size // chunk_size)
            if not isinstance(chunks, list) or len(chunks) != expected_n:
                raise ChunkTableError(f"chunk table layer {digest}: expected {expected_n} chunk digests")
            raw = _hex_digests(chunks, f"chunk table layer {digest}")
            columns: tuple[ColumnBlocks, ...] = ()
            if "columns" in entry:
                what = f"chunk table layer {digest}"
                specs = column_specs_from(entry["columns"], size, what)
                blocks = entry.get("columnChunks")
                if not isinstance(blocks, list) or len(blocks) != sum(k for *_, k in specs):
                    raise ChunkTableError(
                        f"{what}: expected {sum(k for *_, k in specs)} column chunk digests"
                    )
                col_raw = _hex_digests(blocks, what)
                pos = 0
                out = []
                for start, rows, row_bytes, k in specs:
                    out.append(ColumnBlocks(start, rows, row_bytes, tuple(col_raw[pos : pos + k])))
                    pos += k
                columns = tuple(out)
            layers[digest] = LayerChunks(size, raw, starts, columns)
        return cls(str(manifest_digest), chunk_size, layers)


def _hex_digests(items: list[Any], what: str) -> list[bytes]:
    """Raw sha256 digests from a list of 64-digit hex strings (``ChunkTableError`` otherwise)."""
    raw: list[bytes] = []
    for c in items:
        if not isinstance(c, str) or len(c) != 64:
            raise ChunkTableError(f"{what}: bad chunk digest {c!r}")
        try:
            raw.append(bytes.fromhex(c))
        except ValueError as exc:
            raise ChunkTableError(f"{what}: bad chunk digest {c!r}") from exc
    return raw


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
