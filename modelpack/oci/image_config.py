"""The parts of an OCI image config the image-shaped model variant relies on
(docs/artifact.md#the-image-shaped-variant---format-image).

Packing writes them and pull / the node cache read them back, so they live below both: the
``rootfs.diff_ids`` that tie each layer blob to its uncompressed tar, and the ``models/``
directory the layers put the model files under.
"""

from __future__ import annotations

from modelpack.boundedjson import loads_object
from modelpack.errors import DocumentError, ManifestError
from modelpack.oci.digest import Digest

MODELS_PREFIX = "models/"
MAX_CONFIG_BYTES = 4 * 1024 * 1024


def image_diff_ids(config_raw: bytes, n_layers: int, *, where: str = "image config") -> list[str]:
    """``rootfs.diff_ids`` of an image config, checked for count and digest syntax."""
    if len(config_raw) > MAX_CONFIG_BYTES:
        raise ManifestError(f"{where}: image config larger than {MAX_CONFIG_BYTES} bytes")
    try:
        doc = loads_object(config_raw, what=where, max_bytes=MAX_CONFIG_BYTES, max_depth=16)
    except DocumentError as exc:
        raise ManifestError(str(exc)) from None
    rootfs = doc.get("rootfs")
    ids = rootfs.get("diff_ids") if isinstance(rootfs, dict) else None
    if not isinstance(rootfs, dict) or rootfs.get("type") != "layers" or not isinstance(ids, list):
        raise ManifestError(
            f"{where}: invalid image config rootfs: type must be 'layers' with a diff_ids array"
        )
    try:
        out = [str(Digest(x)) for x in ids]
    except ValueError as exc:
        raise ManifestError(f"{where}: invalid image config rootfs: {exc}") from exc
    if len(out) != n_layers:
        raise ManifestError(f"{where}: {len(out)} diff_ids for {n_layers} layers")
    return out


__all__ = ["MAX_CONFIG_BYTES", "MODELS_PREFIX", "image_diff_ids"]
