"""Media type strings of OCI, Docker and the CNCF ModelPack spec (v0.0.7+)."""

from __future__ import annotations

from dataclasses import dataclass

MEDIA_TYPE_OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MEDIA_TYPE_OCI_INDEX = "application/vnd.oci.image.index.v1+json"
MEDIA_TYPE_DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
MEDIA_TYPE_DOCKER_MANIFEST_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
MEDIA_TYPE_EMPTY = "application/vnd.oci.empty.v1+json"
MEDIA_TYPE_IMAGE_CONFIG = "application/vnd.oci.image.config.v1+json"
MEDIA_TYPE_IMAGE_LAYER_TAR = "application/vnd.oci.image.layer.v1.tar"
MEDIA_TYPE_IMAGE_LAYER_TAR_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
MEDIA_TYPE_IMAGE_LAYER_TAR_ZSTD = "application/vnd.oci.image.layer.v1.tar+zstd"
# Docker's names for the same things: modelcar images built with `docker build` carry them
MEDIA_TYPE_DOCKER_IMAGE_CONFIG = "application/vnd.docker.container.image.v1+json"
MEDIA_TYPE_DOCKER_LAYER_TAR = "application/vnd.docker.image.rootfs.diff.tar"
MEDIA_TYPE_DOCKER_LAYER_TAR_GZIP = "application/vnd.docker.image.rootfs.diff.tar.gzip"
#: layers of a plain container image (the image-shaped variant, KServe modelcars): a filesystem tar
IMAGE_LAYER_MEDIA_TYPES = (
    MEDIA_TYPE_IMAGE_LAYER_TAR,
    MEDIA_TYPE_IMAGE_LAYER_TAR_GZIP,
    MEDIA_TYPE_IMAGE_LAYER_TAR_ZSTD,
    MEDIA_TYPE_DOCKER_LAYER_TAR,
    MEDIA_TYPE_DOCKER_LAYER_TAR_GZIP,
)

ARTIFACT_TYPE_MODEL = "application/vnd.cncf.model.manifest.v1+json"
MEDIA_TYPE_CONFIG = "application/vnd.cncf.model.config.v1+json"

# Older names written by modctl releases before the CNCF rename; accepted when reading only.
_VENDORS = ("cncf", "cnai")
_LEGACY_ARTIFACT_TYPE = "application/vnd.cnai.model.manifest.v1+json"
_LEGACY_CONFIG = "application/vnd.cnai.model.config.v1+json"

KINDS = ("weight", "weight.config", "doc", "code", "dataset")
FORMATS = ("raw", "tar", "tar+gzip", "tar+zstd")

MANIFEST_MEDIA_TYPES = (
    MEDIA_TYPE_OCI_MANIFEST,
    MEDIA_TYPE_OCI_INDEX,
    MEDIA_TYPE_DOCKER_MANIFEST,
    MEDIA_TYPE_DOCKER_MANIFEST_LIST,
)


@dataclass(frozen=True)
class LayerType:
    """A parsed ModelPack layer media type: what the file is (kind) and how it is framed (format)."""

    kind: str
    format: str
    legacy: bool = False

    @property
    def media_type(self) -> str:
        return layer_media_type(self.kind, self.format)

    @property
    def is_raw(self) -> bool:
        return self.format == "raw"


def layer_media_type(kind: str, fmt: str = "raw") -> str:
    """Return the CNCF media type for a layer; unknown kinds or formats are a programming error."""
    if kind not in KINDS:
        raise ValueError(f"unknown ModelPack layer kind {kind!r}; expected one of {', '.join(KINDS)}")
    if fmt not in FORMATS:
        raise ValueError(f"unknown ModelPack layer format {fmt!r}; expected one of {', '.join(FORMATS)}")
    return f"application/vnd.cncf.model.{kind}.v1.{fmt}"


def parse_layer_media_type(media_type: str) -> LayerType | None:
    """Parse a ModelPack layer media type (CNCF or legacy CNAI); None if it is not one."""
    prefix = "application/vnd."
    if not media_type.startswith(prefix):
        return None
    rest = media_type[len(prefix) :]
    for vendor in _VENDORS:
        head = f"{vendor}.model."
        if not rest.startswith(head):
            continue
        body = rest[len(head) :]
        # Longest kind first so that "weight.config" wins over "weight".
        for kind in sorted(KINDS, key=len, reverse=True):
            if body.startswith(kind + ".v1."):
                fmt = body[len(kind) + 4 :]
                if fmt in FORMATS:
                    return LayerType(kind=kind, format=fmt, legacy=vendor == "cnai")
                return None
    return None


def is_model_artifact_type(artifact_type: str | None) -> bool:
    return artifact_type in (ARTIFACT_TYPE_MODEL, _LEGACY_ARTIFACT_TYPE)


def is_model_config(media_type: str | None) -> bool:
    return media_type in (MEDIA_TYPE_CONFIG, _LEGACY_CONFIG)
