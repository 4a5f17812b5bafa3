"""Respelling a stored model manifest in the other ModelPack naming (``cp --spec-names``).

The config and layers stay the same blobs; only media type strings in the manifest change (its
``artifactType``, the config descriptor's and each ModelPack layer's ``mediaType``), so the
result has a new digest and is written as canonical JSON: respelling a manifest modelpack packed
gives the bytes a pack in that naming would have given. A manifest already in the naming is kept
byte for byte. Signatures and other referrers name the old digest and do not apply to the new one.
"""

from __future__ import annotations

from typing import Any

from modelpack.boundedjson import loads_object
from modelpack.errors import DocumentError, ManifestError, UnsupportedLayerError
from modelpack.mediatypes import SpecNames, is_model_artifact_type, is_model_config, renamed_media_type
from modelpack.oci.descriptor import MAX_MANIFEST_DEPTH, Index, Manifest, canonical_json


def respelled_manifest(manifest: Manifest | Index, names: SpecNames) -> Manifest:
    """``manifest`` with its ModelPack media types spelled in ``names``; refused (ManifestError)
    for an index or a manifest that is not a ModelPack model (nothing there to respell)."""
    what = f"manifest {manifest.digest}"
    if isinstance(manifest, Index):
        raise ManifestError(
            f"{what} is an index: --spec-names respells one model manifest; copy each entry by "
            "digest with --spec-names and write the index again ('modelpack index')"
        )
    if not (is_model_artifact_type(manifest.artifact_type) or is_model_config(manifest.config.media_type)):
        raise ManifestError(
            f"{what} is not a ModelPack model manifest (artifactType "
            f"{str(manifest.artifact_type)[:100]!r}, config {manifest.config.media_type[:100]!r}): "
            "it has no ModelPack names to respell; copy it without --spec-names"
        )
    try:
        doc = loads_object(manifest.raw, what=what, max_depth=MAX_MANIFEST_DEPTH)
        respelled = _respelled(doc, names)
    except (DocumentError, UnsupportedLayerError) as exc:
        raise ManifestError(f"{what}: {exc}") from None
    if respelled == doc:
        return manifest
    return Manifest.parse(canonical_json(respelled), media_type=manifest.media_type)


def _respelled(doc: dict[str, Any], names: SpecNames) -> dict[str, Any]:
    out = dict(doc)
    if isinstance(out.get("artifactType"), str):
        out["artifactType"] = renamed_media_type(out["artifactType"], names)
    out["config"] = _respelled_descriptor(out["config"], names)
    if "layers" in out:
        out["layers"] = [_respelled_descriptor(layer, names) for layer in out["layers"]]
    return out


def _respelled_descriptor(desc: dict[str, Any], names: SpecNames) -> dict[str, Any]:
    return {**desc, "mediaType": renamed_media_type(desc["mediaType"], names)}


__all__ = ["respelled_manifest"]
