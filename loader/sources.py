"""Where a load reads from, and how far its bytes can be trusted.

Three ways a weight file is served (``WeightFile.mode``):

- ``trusted``: a node-cache snapshot published behind its ready marker. The cache checked every
  blob's size and sha256 before it committed it, and committed files are read-only, so the loader
  reads them as they are (no hashing on the hot path). A plain directory is served this way only
  when the caller says ``allow_unverified=True``; its manifest digest is then unknown, so a
  pinned digest or fingerprint check fails.
- ``chunks``: a blob read by ranges with a signed chunk table: each chunk is hashed and checked
  BEFORE any of its bytes are copied towards a tensor.
- ``whole``: a blob with no chunk table: the whole layer is read and hashed, and none of its
  tensors is handed out before the layer's sha256 matches the manifest.

Sources: a snapshot directory (``modelpack pull --cache`` prints it), a ``(NodeCache, reference)``
pair, a ``(ReadableTarget, reference)`` pair, or a reference string (``oci:…``, ``s3://…``,
``host/repo@sha256:…``) streamed by range reads.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from modelpack.loader.readers import FileReader, RangeReader, TargetReader
from modelpack.mediatypes import parse_layer_media_type
from modelpack.mediatypes.annotations import layer_filepath, safe_relative_path

from modelpack.errors import (
    ExpectedDigestError,
    ManifestError,
    ModelpackError,
    NotFoundError,
    SourceError,
    UnpinnedReferenceError,
    UnsafePathError,
    UnverifiedSourceError,
)
from modelpack.oci.descriptor import Descriptor, Manifest
from modelpack.oci.digest import Digest, verify_bytes
from modelpack.oci.reference import parse_reference
from modelpack.targets.base import ReadableTarget

MAX_CONFIG_BYTES = 4 * 1024 * 1024
_HEX_RE = re.compile(r"^[0-9a-f]{64}$")


@dataclass
class WeightFile:
    relpath: str
    size: int
    open: Callable[[], RangeReader]
    mode: str  # trusted | chunks | whole
    descriptor: Descriptor | None = None
    chunks: Any = None  # a modelpack.signing.chunks.ChunkTable covering this layer (mode chunks)


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

    def close(self) -> None:
        while self._cleanup:
            with contextlib.suppress(Exception):
                self._cleanup.pop()()


def _quantization_from_hf_config(raw: bytes | None) -> str:
    """The packer's spelling (``method-Nbit``) or ``none``; never empty (fingerprint fails closed)."""
    if not raw:
        return "none"
    try:
        doc = json.loads(raw)
    except ValueError:
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
def _snapshot_of(real: str) -> tuple[Any, str] | None:
    """``(Snapshots, digest)`` when ``real`` is ``<cache>/snapshots/<hex>`` with a ready marker.

    The node cache owns the marker format and the reader lease; the loader only asks it.
    """
    name = os.path.basename(real)
    parent = os.path.dirname(real)
    if not _HEX_RE.match(name) or os.path.basename(parent) != "snapshots":
        return None
    if not os.path.exists(real + ".ready"):
        return None
    from modelpack.mount.snapshots import Snapshots
    from modelpack.mount.store import Store

    return Snapshots(Store(os.path.dirname(parent))), "sha256:" + name


def open_snapshot(
    path: str, *, expected_digest: str | None, allow_unverified: bool, direct: bool = False
) -> ResolvedSource:
    """A snapshot directory (trusted behind its ready marker) or, if allowed, a plain directory."""
    real = os.path.realpath(path)
    found = _snapshot_of(real)
    if found is not None:
        snapshots, digest = found
        if expected_digest and Digest(expected_digest) != digest:
            raise ExpectedDigestError(expected_digest, digest, source=real)
        # the cache's reader lease (shared flock) for the whole load: GC cannot delete the files,
        # and the marker is re-read under it (GC removes the marker first, then the files)
        lease = snapshots.lease(digest)
        try:
            info = lease.__enter__()
        except NotFoundError as exc:
            raise SourceError(f"{real}: snapshot was removed while opening it") from exc

        def release() -> None:
            lease.__exit__(None, None, None)

        try:
            manifest = _snapshot_manifest(real, digest)
            entries: list[tuple[str, int, Descriptor | None]] = []
            if manifest is not None:
                for relpath, layer in weight_layers(manifest, real):
                    entries.append((relpath, layer.size, layer))
            else:
                for sf in info.files:
                    if sf.path.endswith(".safetensors"):
                        safe = safe_relative_path(sf.path, what=f"{real}.ready file")
                        entries.append((safe, sf.size, None))
            files = []
            for relpath, size, desc in entries:
                full = os.path.join(real, *relpath.split("/"))
                files.append(
                    WeightFile(relpath, size, _file_opener(full, size, direct), "trusted", descriptor=desc)
                )
            hf = _read_small(os.path.join(real, "config.json"))
        except UnsafePathError as exc:
            release()
            raise SourceError(str(exc)) from exc
        except BaseException:
            release()
            raise
        return ResolvedSource(
            real, digest, manifest, files, False, _quantization_from_hf_config(hf), "hit", [release]
        )
    if not allow_unverified:
        raise UnverifiedSourceError(
            f"{real}: not a node-cache snapshot (no ready marker next to it); its bytes cannot be tied to a "
            "manifest digest. Load the snapshot printed by 'modelpack pull --cache', a reference, or pass "
            "allow_unverified=True for a plain directory"
        )
    if expected_digest:
        raise UnverifiedSourceError(
            f"{real}: a plain directory has no manifest digest to compare with {expected_digest}"
        )
    files = []
    for dirpath, dirnames, filenames in os.walk(real):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for fname in sorted(filenames):
            if fname.endswith(".safetensors") and not fname.startswith("."):
                full = os.path.join(dirpath, fname)
                rel = os.path.relpath(full, real).replace(os.sep, "/")
                files.append(
                    WeightFile(rel, os.path.getsize(full), _file_opener(full, None, direct), "trusted")
                )
    if not files:
        raise SourceError(f"{real}: no .safetensors files")
    hf = _read_small(os.path.join(real, "config.json"))
    return ResolvedSource(real, None, None, files, False, _quantization_from_hf_config(hf), "local", [])


def _read_small(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError:
        return None
    return data if len(data) <= MAX_CONFIG_BYTES else None


def _snapshot_manifest(snapshot: str, digest: str) -> Manifest | None:
    """The manifest from the cache's store (``<cache>/blobs/sha256/<hex>``), verified; None if absent."""
    root = os.path.dirname(os.path.dirname(snapshot))
    raw = _read_small(os.path.join(root, "blobs", "sha256", Digest(digest).hex))
    if raw is None:
        return None
    verify_bytes(raw, digest, None, what="manifest", source=snapshot)
    return Manifest.parse(raw)


def _file_opener(path: str, size: int | None, direct: bool) -> Callable[[], RangeReader]:
    def opener() -> RangeReader:
        return FileReader(path, size if size is not None and size >= 0 else None, direct=direct)

    return opener


# --------------------------------------------------------------------------- targets
def open_target_source(
    target: ReadableTarget,
    reference: str | None,
    *,
    expected_digest: str | None,
    chunk_table: Any = None,
    trusted_keys: Sequence[Any] | None = None,
    direct: bool = False,
) -> ResolvedSource:
    """A manifest pinned by digest in any Target; blobs read by ranges and verified."""
    pinned: str | None = None
    ref_digest: str | None = None
    if reference and reference.startswith("sha256:"):
        ref_digest = str(Digest(reference))
    if expected_digest:
        pinned = str(Digest(expected_digest))
        if ref_digest and ref_digest != pinned:
            raise ExpectedDigestError(pinned, ref_digest, source=f"{target.name} {reference}")
    elif ref_digest:
        pinned = ref_digest
    if pinned is None:
        raise UnpinnedReferenceError(
            f"{target.name} {reference or ''}: pin the manifest digest (expected_digest= or @sha256:…); "
            "a tag can move between the ranks of one model start"
        )
    if reference and not reference.startswith("sha256:"):
        # the caller named a tag AND pinned a digest: the tag must still point at the pin
        desc = target.resolve(reference)
        if desc.digest != pinned:
            raise ExpectedDigestError(pinned, desc.digest, source=f"{target.name} {reference}")
    desc = target.resolve(pinned)
    raw, media_type = target.fetch_manifest(pinned)
    verify_bytes(raw, pinned, None, what="manifest", source=target.name)
    try:
        manifest = Manifest.parse(raw, media_type=media_type)
    except ManifestError as exc:
        raise SourceError(f"{target.name} {pinned}: {exc}") from exc
    table = chunk_table
    if table is None and trusted_keys:
        from modelpack.signing.chunks import load_chunk_table

        table = load_chunk_table(target, desc, list(trusted_keys), manifest=manifest)
    if table is not None and str(table.manifest_digest) != pinned:
        raise ExpectedDigestError(pinned, str(table.manifest_digest), source=f"{target.name} chunk table")
    local_path: Callable[[str], str] | None = None
    blob_path = getattr(target, "blob_path", None)
    if callable(blob_path):
        local_path = blob_path
    files = []
    for rel, layer in weight_layers(manifest, f"{target.name} {pinned}"):
        layer_table = None
        if table is not None and str(layer.digest) in table.layers:
            entry = table.layers[str(layer.digest)]
            if entry.size != layer.size:
                raise SourceError(
                    f"{target.name}: chunk table says layer {layer.digest} is {entry.size} bytes, "
                    f"the manifest says {layer.size}"
                )
            layer_table = table
        mode = "chunks" if layer_table is not None else "whole"
        if local_path is not None:
            opener = _file_opener(local_path(layer.digest), layer.size, direct)
        else:
            opener = _target_opener(target, layer, rel)
        files.append(WeightFile(rel, layer.size, opener, mode, descriptor=layer, chunks=layer_table))
    quant = "none"
    cfg = _config_json_layer(manifest)
    if cfg is not None:
        with target.fetch_blob(cfg) as f:
            data = f.read(cfg.size + 1)
        verify_bytes(data, cfg.digest, cfg.size, what="config.json", source=target.name)
        quant = _quantization_from_hf_config(data)
    return ResolvedSource(
        f"{target.name}@{pinned}", pinned, manifest, files, local_path is None, quant, "streamed"
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
    direct: bool = False,
) -> ResolvedSource:
    """Turn any accepted ``source`` into files with a verification mode (see the module doc)."""
    if isinstance(source, tuple) and len(source) == 2:
        first, ref = source
        if hasattr(first, "open_snapshot"):
            return _open_cache_pair(first, ref, expected_digest=expected_digest, direct=direct)
        if isinstance(first, ReadableTarget):
            return open_target_source(
                first,
                str(ref) if ref is not None else None,
                expected_digest=expected_digest,
                chunk_table=chunk_table,
                trusted_keys=trusted_keys,
                direct=direct,
            )
        raise SourceError(f"unsupported source pair ({type(first).__name__}, …)")
    if isinstance(source, os.PathLike) or (isinstance(source, str) and os.path.isdir(source)):
        path = os.fspath(source)
        if not os.path.isdir(path):
            raise SourceError(f"{path}: not a directory")
        return open_snapshot(
            path, expected_digest=expected_digest, allow_unverified=allow_unverified, direct=direct
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
            direct=direct,
        )
    raise SourceError(f"unsupported load source {type(source).__name__}")


def _open_cache_pair(
    cache: Any, reference: Any, *, expected_digest: str | None, direct: bool
) -> ResolvedSource:
    """``(NodeCache, reference)``: hold the cache's reader lease for the whole load."""
    # the cache resolves the reference locally (tags were resolved once, at pull time); a pin that
    # differs from what the tag points at is refused by open_snapshot's digest check below
    ctx = cache.open_snapshot(str(reference))
    info = ctx.__enter__()
    try:
        path = getattr(info, "path", info)
        src = open_snapshot(
            os.fspath(path), expected_digest=expected_digest, allow_unverified=False, direct=direct
        )
    except BaseException:
        ctx.__exit__(None, None, None)
        raise
    src._cleanup.insert(0, lambda: ctx.__exit__(None, None, None))
    return src
