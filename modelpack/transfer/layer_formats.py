"""How each layer of a manifest becomes files: the one table every reader of layers asks.

Pull to a directory (``transfer.materialize``), the node cache's snapshot build
(``mount.snapshots``), its re-hash (``mount.contents``, ``cache verify``), its free-space and
config checks (``mount.pull``, ``mount.integrity``) and the loader (``loader.weight_files``)
all decide from here, for a manifest's config media type and one layer's media type:

- ``raw``: the blob is one file, at the path its annotation names (ModelPack ``…v1.raw``, and
  any media type this table does not know as a tar: the annotation says where it goes).
- a tar, with its compression (the vocabulary's ``BlobFormat``: ``tar``, ``tar+gzip``,
  ``tar+zstd``; ``open_layer_stream`` takes it and lets the blob's bytes have the last word), the prefix stripped from its members, whether members outside that prefix are passed
  over (never written) or refused, and whether the config's ``rootfs.diff_ids`` vouch for its
  uncompressed stream.

Container-image layers (OCI ``image.layer.v1.tar[+gzip|+zstd]``, Docker
``image.rootfs.diff.tar[.gzip]``) in an image (an OCI or Docker image config: the image-shaped
variant, KServe modelcars from oci-modelcar or ``docker build``) hold the model under
``models/``; what else the image holds (a base image's OS) is passed over, and each layer's
uncompressed tar must hash to its ``diff_id``. The same layer types under another config (a
runtime asset) are tars of files at their paths. ModelPack ``tar`` layers (modctl, folders) are
tars of files at their paths. A ModelPack media type with a format not listed here, and an OCI
or Docker layer type that is not one of the above (``+lz4``, foreign or non-distributable
layers), is an ``UnsupportedLayerError``: no reader guesses at it.

What each media type is comes from ``mediatypes.LAYER_MEDIA_TYPES`` (the one vocabulary);
this module adds what the manifest's config decides. Pure: no I/O, so every module of the
chain can ask it.
"""

from __future__ import annotations

from dataclasses import dataclass

from modelpack.errors import DigestMismatchError, ManifestError, UnsupportedLayerError
from modelpack.mediatypes import (
    MEDIA_TYPE_DOCKER_IMAGE_CONFIG,
    MEDIA_TYPE_IMAGE_CONFIG,
    MEDIA_TYPE_KITOPS_CONFIG,
    BlobFormat,
    Compression,
    LayerKind,
    is_layer_family,
    parse_media_type,
    supported_layer_formats,
)
from modelpack.mediatypes.types import KITOPS_LAYER_MEDIA_TYPES
from modelpack.oci.descriptor import Manifest
from modelpack.oci.image_config import MODELS_PREFIX, image_diff_ids
from modelpack.oci.kitfile import kitfile_diff_ids

#: image configs: their ``rootfs.diff_ids`` tie each layer to its uncompressed tar
IMAGE_CONFIG_MEDIA_TYPES = (MEDIA_TYPE_IMAGE_CONFIG, MEDIA_TYPE_DOCKER_IMAGE_CONFIG)


@dataclass(frozen=True)
class LayerFormat:
    """What a layer is and how its files come out of it."""

    media_type: str
    format: BlobFormat  # raw, or the tar and its compression
    strip: str = ""  # members' prefix, removed from their paths ("models/" for image layers)
    skip_outside: bool = False  # members outside ``strip`` are passed over (True) or refused
    diff_id: bool = False  # the config's rootfs.diff_ids[i] must be this layer's uncompressed sha256

    @property
    def is_raw(self) -> bool:
        return not self.format.is_tar

    @property
    def is_tar(self) -> bool:
        return self.format.is_tar

    @property
    def compression(self) -> Compression | None:
        return self.format.compression

    @property
    def outside(self) -> str:
        """``extract_tar_layer``'s ``outside`` argument."""
        return "skip" if self.skip_outside else "refuse"


def is_image_config(config_media_type: str | None) -> bool:
    """An OCI or Docker image config (its layers are a container image's filesystem)."""
    return config_media_type in IMAGE_CONFIG_MEDIA_TYPES


def layer_format(config_media_type: str | None, media_type: str) -> LayerFormat:
    """How the layer ``media_type`` of a manifest whose config is ``config_media_type`` becomes
    files; ``UnsupportedLayerError`` for a tar or ModelPack type this build cannot read."""
    lt = parse_media_type(media_type)
    if lt is None:
        if is_layer_family(media_type):
            raise UnsupportedLayerError(
                f"layer media type {media_type!r}: no reader for this format "
                f"(supported: {', '.join(supported_layer_formats())})"
            )
        return LayerFormat(media_type, BlobFormat.RAW)
    if lt.kind is LayerKind.IMAGE and is_image_config(config_media_type):
        return LayerFormat(media_type, lt.format, MODELS_PREFIX, skip_outside=True, diff_id=True)
    if media_type in KITOPS_LAYER_MEDIA_TYPES:
        if config_media_type != MEDIA_TYPE_KITOPS_CONFIG:
            raise UnsupportedLayerError(
                f"layer media type {media_type!r} outside a KitOps ModelKit (config "
                f"{str(config_media_type)[:100]!r}): no Kitfile vouches for its contents"
            )
        return LayerFormat(media_type, lt.format, diff_id=True)
    return LayerFormat(media_type, lt.format)


def manifest_layer_formats(manifest: Manifest) -> list[LayerFormat]:
    """``layer_format`` of every layer of ``manifest``, in order; a refusal names the manifest
    and the layer."""
    out = []
    for layer in manifest.layers:
        try:
            out.append(layer_format(manifest.config.media_type, layer.media_type))
        except UnsupportedLayerError as exc:
            raise UnsupportedLayerError(f"{manifest.digest} layer {layer.digest}: {exc}") from exc
    return out


def has_tar_layers(manifest: Manifest) -> bool:
    """Whether building files from ``manifest`` extracts anything (expansion must be budgeted)."""
    return any(f.is_tar for f in manifest_layer_formats(manifest))


def needs_config(manifest: Manifest) -> bool:
    """Whether the config must be read to build files from ``manifest``: an image config, whose
    ``rootfs.diff_ids`` (one per layer) vouch for its tar layers, or a KitOps Kitfile, whose
    entries record each layer's diffId."""
    return (
        is_image_config(manifest.config.media_type) or manifest.config.media_type == MEDIA_TYPE_KITOPS_CONFIG
    )


def diff_ids_to_hash(manifest: Manifest, config_raw: bytes | None) -> list[str | None]:
    """Per layer, the ``diff_id`` its uncompressed tar must hash to while it is extracted, or
    None when nothing is left to hash: a layer the config does not vouch for (a raw layer, a tar
    outside an image), or a plain-tar layer, whose stream IS its blob — read under its blob
    digest — so its diff_id must be that digest (compared here; hashing the same bytes again
    would be the extraction's costliest step for nothing). Every reader that extracts image
    layers (pull into a directory, the node cache's snapshot) asks here, so none can skip it.
    ``config_raw`` is the manifest's config, verified by the caller (needed for an image)."""
    formats = manifest_layer_formats(manifest)
    if not needs_config(manifest):
        return [None] * len(formats)
    if config_raw is None:
        raise ManifestError(f"{manifest.digest}: image config missing")
    if manifest.config.media_type == MEDIA_TYPE_KITOPS_CONFIG:
        ids = kitfile_diff_ids(
            config_raw, [str(layer.digest) for layer in manifest.layers], where=f"{manifest.digest} Kitfile"
        )
    else:
        ids = image_diff_ids(config_raw, len(manifest.layers), where=str(manifest.digest))
    out: list[str | None] = []
    for layer, fmt, diff_id in zip(manifest.layers, formats, ids, strict=True):
        if not fmt.diff_id:
            out.append(None)
        elif fmt.format is BlobFormat.TAR:
            if diff_id != layer.digest:
                raise DigestMismatchError(
                    diff_id, str(layer.digest), what=f"layer {layer.digest} diff_id (uncompressed)"
                )
            out.append(None)
        else:
            out.append(diff_id)
    return out


__all__ = [
    "IMAGE_CONFIG_MEDIA_TYPES",
    "LayerFormat",
    "diff_ids_to_hash",
    "has_tar_layers",
    "is_image_config",
    "layer_format",
    "manifest_layer_formats",
    "needs_config",
]
