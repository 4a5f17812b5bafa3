"""A load's source as the read paths see it: weight files, each with what vouches for its bytes.

Three ways a weight file is served (``WeightFile.mode``):

- ``trusted``: a node-cache snapshot file that ``snapshot_binding`` tied to the manifest whose
  digest names the snapshot: the store's committed, read-only blob (the cache checked its size
  and sha256 before committing it), so it is read as it is (no hashing on the hot path). A plain
  directory is served this way only with ``allow_unverified=True`` (``--allow-unverified``); its
  manifest digest is then unknown, so a pinned digest or fingerprint check fails.
- ``chunks``: a blob read by ranges with a signed chunk table: each chunk is hashed and checked
  BEFORE any of its bytes are copied towards a tensor.
- ``whole``: a blob with no chunk table (only when none was asked for, or the caller accepted the
  downgrade), a snapshot file that is not the store's blob, or a snapshot file extracted from a
  tar layer (its descriptor then carries the file's own sha256 and size from the ready marker):
  the whole file is read and hashed, header included, and none of its tensors is handed out
  before its sha256 matches.

The helpers here are shared by the snapshot and target openers (``snapshot_source``,
``target_source``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from modelpack.loader.readers import FileReader, RangeReader
from modelpack.mediatypes import LayerKind, parse_layer_media_type
from modelpack.mediatypes.annotations import layer_filepath

from modelpack import boundedjson
from modelpack.errors import (
    DocumentError,
    ManifestError,
    SourceError,
    UnsafePathError,
    UnsupportedLayerError,
    UnverifiedSourceError,
)
from modelpack.oci.descriptor import Descriptor, Manifest
from modelpack.transfer.layer_formats import layer_format

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
    # a node-cache store blob trusted by inode (snapshot_binding): its views may be handed out
    mappable: bool = False
    # read from the node cache's ingest as it fills (stream_through): on the CPU the cache's own
    # whole-blob check vouches for the bytes instead of a hash here (settled.py)
    settled: bool = False


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
    # the model's config.json as verified with the source (expert count, FP8 block size), if any
    config: bytes | None = None

    def close(self) -> None:
        while self._cleanup:
            with contextlib.suppress(Exception):
                self._cleanup.pop()()


def quantization_from_hf_config(raw: bytes | None) -> str:
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


def tar_layer(layer: Descriptor) -> bool:
    """Whether ``layer`` is not a raw file (its files come out of it by extraction, never by range
    reads): the image-shaped variant, a modelcar (OCI or Docker layer types), a ModelPack/modctl
    ``tar``, ``tar+gzip`` or ``tar+zstd`` layer (``transfer.layer_formats``), or a tar-like type
    no reader supports (never range-read as if it were the file)."""
    try:
        return layer_format(None, layer.media_type).is_tar
    except UnsupportedLayerError:
        return True


def _may_hold_weights(layer: Descriptor, rel: str | None) -> bool:
    """A tar layer whose files could be weights: any image layer (no file list outside the tar), a
    ModelPack ``weight`` layer, one without a path, or one named ``*.safetensors``."""
    lt = parse_layer_media_type(layer.media_type)
    return lt is None or lt.kind is LayerKind.WEIGHT or not rel or rel.endswith(".safetensors")


def weight_layers(
    manifest: Manifest, where: str, *, from_cache: bool = False
) -> list[tuple[str, Descriptor]]:
    """(relative path, descriptor) of every raw safetensors weight layer, refusing unsafe paths.

    Tar layers hold files only extraction can reach. ``from_cache``: a node-cache snapshot, whose
    extracted files the ready marker lists (``snapshot_binding.check_marker``), so they are
    skipped here. Otherwise (range reads from a target) a tar layer that may hold weights is a
    refusal that says how to load it: pull it into the node cache and load the snapshot."""
    out = []
    for layer in manifest.layers:
        try:
            rel = layer_filepath(layer.annotations)
        except UnsafePathError as exc:
            raise ManifestError(f"{where}: layer {layer.digest}: {exc}") from exc
        if tar_layer(layer):
            if not from_cache and _may_hold_weights(layer, rel):
                raise SourceError(
                    f"{where}: layer {layer.digest} ({rel or 'no file path'}) is a tar layer "
                    f"({layer.media_type}); range reads need raw layers, so it cannot be streamed. "
                    f"Pull it into the node cache first, 'modelpack pull --cache DIR {where}', and "
                    f"load the snapshot it prints: 'modelpack load DIR/snapshots/{manifest.digest.hex}'"
                )
            continue
        if not rel or not rel.endswith(".safetensors"):
            continue
        out.append((rel, layer))
    return out


def config_json_layer(manifest: Manifest) -> Descriptor | None:
    """The raw layer holding ``config.json`` (a tar layer's title may name it too: not its bytes)."""
    for layer in manifest.layers:
        with contextlib.suppress(UnsafePathError):
            if (
                layer_filepath(layer.annotations) == "config.json"
                and layer.size <= MAX_CONFIG_BYTES
                and not tar_layer(layer)
            ):
                return layer
    return None


def read_small(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError:
        return None
    return data if len(data) <= MAX_CONFIG_BYTES else None


def file_opener(
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
