"""Where a load reads from, and how far its bytes can be trusted.

Three ways a weight file is served (``WeightFile.mode``):

- ``trusted``: a node-cache snapshot file that ``snapshot_binding`` tied to the manifest whose
  digest names the snapshot: the store's committed, read-only blob (the cache checked its size
  and sha256 before committing it), so it is read as it is (no hashing on the hot path). A plain
  directory is served this way only with ``allow_unverified=True`` (``--allow-unverified``); its
  manifest digest is then unknown, so a pinned digest or fingerprint check fails.
- ``chunks``: a blob read by ranges with a signed chunk table: each chunk is hashed and checked
  BEFORE any of its bytes are copied towards a tensor.
- ``whole``: a blob with no chunk table (only when none was asked for, or the caller accepted the
  downgrade), or a snapshot file that is not the store's blob: the whole layer is read and
  hashed, header included, and none of its tensors is handed out before the layer's sha256
  matches the manifest.

Sources: a snapshot directory (``modelpack pull --cache`` prints it), a ``(NodeCache, reference)``
pair, a ``(ReadableTarget, reference)`` pair, or a reference string (``oci:…``, ``s3://…``,
``host/repo@sha256:…``) streamed by range reads.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from modelpack.loader import snapshot_binding
from modelpack.loader.readers import FileReader, RangeReader, TargetReader
from modelpack.mediatypes import parse_layer_media_type
from modelpack.mediatypes.annotations import layer_filepath

from modelpack import boundedjson
from modelpack.errors import (
    DocumentError,
    ExpectedDigestError,
    ManifestError,
    ModelpackError,
    NotFoundError,
    SourceError,
    UnpinnedReferenceError,
    UnsafePathError,
    UnsignedSourceError,
    UnverifiedSourceError,
)
from modelpack.oci.descriptor import Descriptor, Manifest
from modelpack.oci.digest import Digest, verify_bytes
from modelpack.oci.reference import parse_reference
from modelpack.targets.base import ReadableTarget

MAX_CONFIG_BYTES = 4 * 1024 * 1024


@dataclass
class WeightFile:
    relpath: str
    size: int
    open: Callable[[], RangeReader]
    mode: str  # read path: trusted | chunks | whole
    descriptor: Descriptor | None = None
    chunks: Any = None  # a modelpack.signing.chunks.ChunkTable covering this layer (mode chunks)
    verification: str = ""  # what vouches for the bytes (LoadStats.verification); defaults to mode


@dataclass
class ResolvedSource:
    name: str
    digest: str | None
    manifest: Manifest | None
    files: list[WeightFile]
    remote: bool
    quantization: str
    state: str  # event state: hit (node cache) | streamed | local
    _cleanup: list[Callable[[], None]] = field(default_factory=list)
    # (event, fields) the load records once it starts: downgrades and re-hashing, with the reason
    notices: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    def close(self) -> None:
        while self._cleanup:
            with contextlib.suppress(Exception):
                self._cleanup.pop()()


def _quantization_from_hf_config(raw: bytes | None) -> str:
    """The packer's spelling (``method-Nbit``) or ``none``; never empty (fingerprint fails closed)."""
    if not raw:
        return "none"
    try:
        doc = boundedjson.loads(raw, what="config.json", max_bytes=MAX_CONFIG_BYTES)
    except DocumentError:
        return "none"
    qc = doc.get("quantization_config") if isinstance(doc, dict) else None
    if not isinstance(qc, dict):
        return "none"
    method = qc.get("quant_method") or qc.get("quantization_method")
    quant = str(method) if method else "unknown"
    if qc.get("bits"):
        quant += f"-{qc['bits']}bit"
    return quant


def weight_layers(manifest: Manifest, where: str) -> list[tuple[str, Descriptor]]:
    """(relative path, descriptor) of every safetensors weight layer, refusing unsafe paths."""
    out = []
    for layer in manifest.layers:
        try:
            rel = layer_filepath(layer.annotations)
        except UnsafePathError as exc:
            raise ManifestError(f"{where}: layer {layer.digest}: {exc}") from exc
        if not rel or not rel.endswith(".safetensors"):
            continue
        lt = parse_layer_media_type(layer.media_type)
        if lt is not None and not lt.is_raw:
            raise SourceError(
                f"{where}: layer {layer.digest} ({rel}) is {layer.media_type}; range reads need .raw layers"
            )
        out.append((rel, layer))
    return out


def _config_json_layer(manifest: Manifest) -> Descriptor | None:
    for layer in manifest.layers:
        with contextlib.suppress(UnsafePathError):
            if layer_filepath(layer.annotations) == "config.json" and layer.size <= MAX_CONFIG_BYTES:
                return layer
    return None


# --------------------------------------------------------------------------- snapshots
def open_snapshot(
    path: str,
    *,
    expected_digest: str | None,
    allow_unverified: bool,
    direct: bool = False,
    trusted_keys: Sequence[Any] | None = None,
) -> ResolvedSource:
    """A snapshot directory bound to its manifest (see ``snapshot_binding``), or, if the caller
    allowed it, a plain directory. With ``trusted_keys`` the cache must have recorded that one of
    them verified the snapshot's signature (a key is never silently ignored)."""
    real = os.path.realpath(path)
    found = snapshot_binding.claim(real)
    if found is not None:
        if expected_digest and Digest(expected_digest) != found.digest:
            raise ExpectedDigestError(expected_digest, found.digest, source=real)
        try:
            snapshot_binding.require_store(found)
        except UnverifiedSourceError:
            if not allow_unverified or expected_digest:
                raise
        else:
            return _open_bound_snapshot(found, direct, trusted_keys)
    if not allow_unverified:
        raise UnverifiedSourceError(
            f"{real}: not a node-cache snapshot (no ready marker next to it); its bytes cannot be tied to a "
            "manifest digest. Load the path printed by 'modelpack pull --cache DIR REF', a pinned reference "
            "(REF@sha256:…), or pass --allow-unverified for a plain directory"
        )
    if expected_digest:
        raise UnverifiedSourceError(
            f"{real}: a plain directory has no manifest digest to compare with --expected-digest {expected_digest}"
        )
    files = []
    for dirpath, dirnames, filenames in os.walk(real):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for fname in sorted(filenames):
            if fname.endswith(".safetensors") and not fname.startswith("."):
                full = os.path.join(dirpath, fname)
                rel = os.path.relpath(full, real).replace(os.sep, "/")
                files.append(
                    WeightFile(
                        rel,
                        os.path.getsize(full),
                        _file_opener(full, None, direct),
                        "trusted",
                        verification="unverified",
                    )
                )
    if not files:
        raise SourceError(f"{real}: no .safetensors files")
    hf = _read_small(os.path.join(real, "config.json"))
    return ResolvedSource(real, None, None, files, False, _quantization_from_hf_config(hf), "local", [])


def _open_bound_snapshot(
    found: snapshot_binding.SnapshotClaim, direct: bool, trusted_keys: Sequence[Any] | None
) -> ResolvedSource:
    """Lease the snapshot, then tie its marker and files to the manifest in the cache's store."""
    from modelpack.mount.snapshots import Snapshots
    from modelpack.mount.store import Store

    real, digest = found.path, found.digest
    # the cache's reader lease (shared flock) for the whole load: GC cannot delete the files,
    # and the marker is re-read under it (GC removes the marker first, then the files)
    lease = Snapshots(Store(found.root, create=False)).lease(digest)
    try:
        info = lease.__enter__()
    except NotFoundError as exc:
        raise UnverifiedSourceError(
            f"{real}: not ready in its cache (no ready marker the cache owner wrote and nobody else can "
            f"write, or it was removed while opening it); pull it again with 'modelpack pull --cache "
            f"{found.root} REF@{digest}'"
        ) from exc

    def release() -> None:
        lease.__exit__(None, None, None)

    try:
        manifest = snapshot_binding.pinned_manifest(found)
        if trusted_keys and not snapshot_binding.verified_by(found, trusted_keys):
            raise UnsignedSourceError(
                f"{real}: no record that a --trusted-key verified the signature of {digest} on this node "
                "(the cache pulled it without a policy trusting those keys, or the record is not root's or "
                f"this user's). Pull it with 'modelpack pull --cache {found.root} --policy FILE "
                f"REF@{digest}', or load it without --trusted-key",
                [f.path for f in info.files if f.path.endswith(".safetensors")],
            )
        snapshot_binding.check_marker(
            found, [(f.path, f.digest, f.size, f.linked) for f in info.files], manifest
        )
        bound = snapshot_binding.bind_files(found, weight_layers(manifest, real))
        files = []
        for b in bound:
            if b.trusted:
                opener = _file_opener(b.path, b.layer.size, direct, identity=b.identity)
                files.append(WeightFile(b.relpath, b.layer.size, opener, "trusted", descriptor=b.layer))
            else:
                opener = _file_opener(b.path, b.layer.size, direct)
                files.append(
                    WeightFile(
                        b.relpath, b.layer.size, opener, "whole", descriptor=b.layer, verification="hashed"
                    )
                )
        notices: list[tuple[str, dict[str, Any]]] = []
        rehash = [b for b in bound if not b.trusted]
        if rehash:
            notices.append(
                (
                    "loader.rehashing",
                    {
                        "files": [b.relpath for b in rehash],
                        "reason": "; ".join(dict.fromkeys(b.reason for b in rehash))[:2000],
                    },
                )
            )
        quant = _quantization_from_hf_config(_verified_snapshot_config(real, manifest))
    except UnsafePathError as exc:
        release()
        raise SourceError(str(exc)) from exc
    except BaseException:
        release()
        raise
    return ResolvedSource(real, digest, manifest, files, False, quant, "hit", [release], notices)


def _verified_snapshot_config(real: str, manifest: Manifest) -> bytes | None:
    """config.json as the manifest has it (it decides the fingerprint's quantization field)."""
    layer = _config_json_layer(manifest)
    if layer is None:
        return None
    data = _read_small(os.path.join(real, "config.json"))
    if data is None:
        raise UnverifiedSourceError(f"{real}/config.json: missing from the snapshot")
    verify_bytes(data, layer.digest, layer.size, what="config.json", source=real)
    return data


def _read_small(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError:
        return None
    return data if len(data) <= MAX_CONFIG_BYTES else None


def _file_opener(
    path: str, size: int | None, direct: bool, *, identity: tuple[int, int] | None = None
) -> Callable[[], RangeReader]:
    def opener() -> RangeReader:
        reader = FileReader(path, size if size is not None and size >= 0 else None, direct=direct)
        if identity is not None:
            st = reader.fstat()
            if (st.st_dev, st.st_ino) != identity:
                reader.close()
                raise UnverifiedSourceError(
                    f"{path}: replaced after it was checked against the cache's store; refusing the load"
                )
        return reader

    return opener


# --------------------------------------------------------------------------- targets
def cli_reference(target: ReadableTarget, reference: str | None) -> str:
    """``host/repo:tag``, ``host/repo@sha256:…``, ``oci:DIR:TAG``, ``s3://BUCKET/PREFIX@sha256:…``."""
    if not reference:
        return target.name
    return f"{target.name}{'@' if reference.startswith('sha256:') else ':'}{reference}"


def open_target_source(
    target: ReadableTarget,
    reference: str | None,
    *,
    expected_digest: str | None,
    chunk_table: Any = None,
    trusted_keys: Sequence[Any] | None = None,
    allow_missing_chunk_table: bool = False,
    direct: bool = False,
) -> ResolvedSource:
    """A manifest pinned by digest in any Target; blobs read by ranges and verified.

    Once a chunk table is asked for (``trusted_keys`` or ``chunk_table``), every weight layer must
    be covered by it: a missing referrer, or a table that skips a layer, is a refusal
    (``UnsignedSourceError``) unless ``allow_missing_chunk_table`` accepts whole-layer digest checks
    for the uncovered layers (recorded as a ``loader.downgraded`` notice).
    """
    named = cli_reference(target, reference)
    pinned: str | None = None
    ref_digest: str | None = None
    if reference and reference.startswith("sha256:"):
        ref_digest = str(Digest(reference))
    if expected_digest:
        pinned = str(Digest(expected_digest))
        if ref_digest and ref_digest != pinned:
            raise ExpectedDigestError(pinned, ref_digest, source=named)
    elif ref_digest:
        pinned = ref_digest
    if pinned is None:
        raise UnpinnedReferenceError(
            f"{named}: pin the manifest digest ({target.name}@sha256:… or --expected-digest); "
            "a tag can move between the ranks of one model start"
        )
    if reference and not reference.startswith("sha256:"):
        # the caller named a tag AND pinned a digest: the tag must still point at the pin
        desc = target.resolve(reference)
        if desc.digest != pinned:
            raise ExpectedDigestError(pinned, desc.digest, source=named)
    pinned_ref = f"{target.name}@{pinned}"
    desc = target.resolve(pinned)
    raw, media_type = target.fetch_manifest(pinned)
    verify_bytes(raw, pinned, None, what="manifest", source=pinned_ref)
    try:
        manifest = Manifest.parse(raw, media_type=media_type)
    except ManifestError as exc:
        raise SourceError(f"{pinned_ref}: {exc}") from exc
    table = chunk_table
    wanted_table = table is not None or bool(trusted_keys)
    if table is None and trusted_keys:
        from modelpack.signing.chunks import load_chunk_table

        table = load_chunk_table(target, desc, list(trusted_keys), manifest=manifest)
    if table is not None and str(table.manifest_digest) != pinned:
        raise ExpectedDigestError(pinned, str(table.manifest_digest), source=f"{pinned_ref} chunk table")
    local_path: Callable[[str], str] | None = None
    blob_path = getattr(target, "blob_path", None)
    if callable(blob_path):
        local_path = blob_path
    files = []
    uncovered: list[str] = []
    for rel, layer in weight_layers(manifest, pinned_ref):
        layer_table = None
        if table is not None and str(layer.digest) in table.layers:
            entry = table.layers[str(layer.digest)]
            if entry.size != layer.size:
                raise SourceError(
                    f"{pinned_ref}: chunk table says layer {layer.digest} is {entry.size} bytes, "
                    f"the manifest says {layer.size}"
                )
            layer_table = table
        elif wanted_table:
            uncovered.append(rel)
        mode = "chunks" if layer_table is not None else "whole"
        if local_path is not None:
            opener = _file_opener(local_path(layer.digest), layer.size, direct)
        else:
            opener = _target_opener(target, layer, rel)
        files.append(WeightFile(rel, layer.size, opener, mode, descriptor=layer, chunks=layer_table))
    notices: list[tuple[str, dict[str, Any]]] = []
    if uncovered:
        what = (
            "has no chunk table signed by a trusted key"
            if table is None
            else "has a signed chunk table that does not cover " + ", ".join(uncovered[:10])
        )
        if not allow_missing_chunk_table:
            raise UnsignedSourceError(
                f"{pinned_ref} {what}, so its range reads cannot be checked chunk by chunk against "
                "--trusted-key. Sign it with 'modelpack sign' (chunk table included), or pass "
                "--allow-missing-chunk-table to check whole layers against the manifest instead",
                uncovered,
            )
        notices.append(
            (
                "loader.downgraded",
                {"files": uncovered, "reason": f"{what}; whole-layer digest checks instead"},
            )
        )
    quant = "none"
    cfg = _config_json_layer(manifest)
    if cfg is not None:
        with target.fetch_blob(cfg) as f:
            data = f.read(cfg.size + 1)
        verify_bytes(data, cfg.digest, cfg.size, what="config.json", source=pinned_ref)
        quant = _quantization_from_hf_config(data)
    return ResolvedSource(
        pinned_ref, pinned, manifest, files, local_path is None, quant, "streamed", notices=notices
    )


def _target_opener(target: ReadableTarget, layer: Descriptor, rel: str) -> Callable[[], RangeReader]:
    def opener() -> RangeReader:
        return TargetReader(target, layer, name=f"{target.name} {rel} ({layer.digest})")

    return opener


def resolve_source(
    source: Any,
    *,
    expected_digest: str | None = None,
    chunk_table: Any = None,
    trusted_keys: Sequence[Any] | None = None,
    target_options: Any = None,
    allow_unverified: bool = False,
    allow_missing_chunk_table: bool = False,
    direct: bool = False,
) -> ResolvedSource:
    """Turn any accepted ``source`` into files with a verification mode (see the module doc)."""
    if isinstance(source, tuple) and len(source) == 2:
        first, ref = source
        if hasattr(first, "open_snapshot"):
            return _open_cache_pair(
                first, ref, expected_digest=expected_digest, direct=direct, trusted_keys=trusted_keys
            )
        if isinstance(first, ReadableTarget):
            return open_target_source(
                first,
                str(ref) if ref is not None else None,
                expected_digest=expected_digest,
                chunk_table=chunk_table,
                trusted_keys=trusted_keys,
                allow_missing_chunk_table=allow_missing_chunk_table,
                direct=direct,
            )
        raise SourceError(f"unsupported source pair ({type(first).__name__}, …)")
    if isinstance(source, os.PathLike) or (isinstance(source, str) and os.path.isdir(source)):
        path = os.fspath(source)
        if not os.path.isdir(path):
            raise SourceError(f"{path}: not a directory")
        return open_snapshot(
            path,
            expected_digest=expected_digest,
            allow_unverified=allow_unverified,
            direct=direct,
            trusted_keys=trusted_keys,
        )
    if isinstance(source, str):
        try:
            ref = parse_reference(source)
        except ModelpackError as exc:
            raise SourceError(f"{source!r} is neither a directory nor a reference: {exc}") from exc
        from modelpack.targets.opener import open_readable

        target = open_readable(ref, target_options)
        return open_target_source(
            target,
            str(ref.digest) if ref.digest else (ref.tag if ref.tag else None),
            expected_digest=expected_digest,
            chunk_table=chunk_table,
            trusted_keys=trusted_keys,
            allow_missing_chunk_table=allow_missing_chunk_table,
            direct=direct,
        )
    raise SourceError(f"unsupported load source {type(source).__name__}")


def _open_cache_pair(
    cache: Any,
    reference: Any,
    *,
    expected_digest: str | None,
    direct: bool,
    trusted_keys: Sequence[Any] | None,
) -> ResolvedSource:
    """``(NodeCache, reference)``: hold the cache's reader lease for the whole load."""
    # the cache resolves the reference locally (tags were resolved once, at pull time); a pin that
    # differs from what the tag points at is refused by open_snapshot's digest check below
    ctx = cache.open_snapshot(str(reference))
    info = ctx.__enter__()
    try:
        path = getattr(info, "path", info)
        src = open_snapshot(
            os.fspath(path),
            expected_digest=expected_digest,
            allow_unverified=False,
            direct=direct,
            trusted_keys=trusted_keys,
        )
    except BaseException:
        ctx.__exit__(None, None, None)
        raise
    src._cleanup.insert(0, lambda: ctx.__exit__(None, None, None))
    return src
