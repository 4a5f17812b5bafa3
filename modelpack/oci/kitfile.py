"""A KitOps ModelKit's config: the Kitfile as JSON, which records for each of its entries
(``model``, ``model.parts[]``, ``code[]``, ``datasets[]``, ``docs[]``) the ``digest`` of its layer
and the ``diffId`` of that layer's uncompressed tar (kitops ``pkg/artifact/kitfile.go``,
``LayerInfo``). The diffIds are what vouch for each tar's stream while it is extracted, as an
image config's ``rootfs.diff_ids`` do; a layer the Kitfile records no diffId for cannot be
verified that way and is refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from modelpack.boundedjson import loads_object
from modelpack.errors import DocumentError, ManifestError
from modelpack.oci.digest import Digest
from modelpack.oci.image_config import MAX_CONFIG_BYTES

_LIST_SECTIONS = ("code", "datasets", "docs")


def _entries(doc: dict[str, Any]) -> list[Any]:
    model = doc.get("model")
    out: list[Any] = []
    if isinstance(model, dict):
        out.append(model)
        parts = model.get("parts")
        out.extend(parts if isinstance(parts, list) else [])
    for section in _LIST_SECTIONS:
        items = doc.get(section)
        out.extend(items if isinstance(items, list) else [])
    return out


def kitfile_diff_ids(config_raw: bytes, layer_digests: Sequence[str], *, where: str = "Kitfile") -> list[str]:
    """Per layer (by its digest), the diffId the Kitfile records for it; refused when the
    config is not a Kitfile object, an entry's digest or diffId is malformed, or a layer has no
    entry (nothing vouches for its uncompressed stream)."""
    if len(config_raw) > MAX_CONFIG_BYTES:
        raise ManifestError(f"{where}: larger than {MAX_CONFIG_BYTES} bytes")
    try:
        doc = loads_object(config_raw, what=where, max_bytes=MAX_CONFIG_BYTES, max_depth=32)
    except DocumentError as exc:
        raise ManifestError(str(exc)) from None
    recorded: dict[str, str] = {}
    for entry in _entries(doc):
        if not isinstance(entry, dict) or "digest" not in entry:
            continue  # an entry without a layer (a reference to another ModelKit)
        try:
            digest, diff_id = str(Digest(entry["digest"])), str(Digest(entry.get("diffId", "")))
        except (TypeError, ValueError) as exc:
            raise ManifestError(f"{where}: entry {str(entry.get('path'))[:100]!r}: {exc}") from None
        if recorded.setdefault(digest, diff_id) != diff_id:
            raise ManifestError(f"{where}: layer {digest} is recorded with two diffIds")
    out = []
    for digest in layer_digests:
        if digest not in recorded:
            raise ManifestError(
                f"{where}: layer {digest} has no entry with its digest and diffId: its uncompressed "
                "contents cannot be verified (a ModelKit packed by kit before it recorded diffIds?)"
            )
        out.append(recorded[digest])
    return out


__all__ = ["kitfile_diff_ids"]
