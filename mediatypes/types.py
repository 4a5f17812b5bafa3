"""Media type strings of OCI, Docker and the CNCF ModelPack spec (v0.0.7+), and the one layer
vocabulary: ``LayerKind`` × ``BlobFormat`` ↔ media type in ``LAYER_MEDIA_TYPES``.

Every decision about a layer's kind, framing or compression is asked of these enums and this
table; no other module spells a layer media type or compares a kind with a string literal.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from modelpack.errors import UnsupportedLayerError

if sys.version_info >= (3, 11):
    from enum import StrEnum
else:  # pragma: no cover - Python 3.10
    from enum import Enum

    class StrEnum(str, Enum):
        """3.11's StrEnum: members are their values, as strings and when formatted."""

        def __str__(self) -> str:
            return str(self.value)

        def __format__(self, spec: str) -> str:
            return format(str(self.value), spec)


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
ARTIFACT_TYPE_MODEL = "application/vnd.cncf.model.manifest.v1+json"
MEDIA_TYPE_CONFIG = "application/vnd.cncf.model.config.v1+json"


class SpecNames(StrEnum):
    """Which spelling of the ModelPack names a manifest uses: ``cncf`` (the spec since v0.0.7,
    what modelpack writes by default, what Docker Hub's model catalog and KServe expect) or
    ``cnai`` (the names before the CNCF rename: what released Harbor recognises and modctl
    writes). Both are read; either is written on request (``--spec-names``). Only media types
    differ: the ``org.cncf.model.*`` annotations and the config bytes are the same in both."""

    CNCF = "cncf"
    CNAI = "cnai"

    @property
    def artifact_type(self) -> str:
        """The manifest's ``artifactType``."""
        return f"application/vnd.{self}.model.manifest.v1+json"

    @property
    def config_media_type(self) -> str:
        """The model config's media type."""
        return f"application/vnd.{self}.model.config.v1+json"

    @property
    def family(self) -> str:
        """The prefix every media type of this naming starts with."""
        return f"application/vnd.{self}.model."


_LEGACY_ARTIFACT_TYPE = SpecNames.CNAI.artifact_type
_LEGACY_CONFIG = SpecNames.CNAI.config_media_type

#: KitOps ModelKits: the Kitfile (as JSON) is the config; it records each layer's digest and
#: diffId. Their layers are read (``KITOPS_LAYER_KINDS``), never written.
MEDIA_TYPE_KITOPS_CONFIG = "application/vnd.kitops.modelkit.config.v1+json"
_KITOPS_FAMILY = "application/vnd.kitops.modelkit."
#: a ModelKit layer's name → the ModelPack kind its files are (a ``modelpart`` is an adapter or
#: a part of the weights). Its ``prompts``, ``skill`` and ``mcpserver`` layers have no ModelPack
#: kind and are refused (``is_layer_family``), never guessed at.
KITOPS_LAYER_KINDS = {
    "model": "weight",
    "modelpart": "weight",
    "dataset": "dataset",
    "code": "code",
    "docs": "doc",
}

MANIFEST_MEDIA_TYPES = (
    MEDIA_TYPE_OCI_MANIFEST,
    MEDIA_TYPE_OCI_INDEX,
    MEDIA_TYPE_DOCKER_MANIFEST,
    MEDIA_TYPE_DOCKER_MANIFEST_LIST,
)


class LayerKind(StrEnum):
    """What a layer holds: the ModelPack spec's five kinds, and a container image's filesystem
    layer (the image-shaped variant, KServe modelcars), which the spec does not name.

    A ``StrEnum``: members equal the strings the spec and stored JSON spell, so nothing written
    changes; code compares members, never string literals.
    """

    WEIGHT = "weight"
    WEIGHT_CONFIG = "weight.config"
    DOC = "doc"
    CODE = "code"
    DATASET = "dataset"
    IMAGE = "image-layer"

    @property
    def is_modelpack(self) -> bool:
        """One of the spec's kinds (``application/vnd.cncf.model.<kind>.v1.<format>``)."""
        return self is not LayerKind.IMAGE


class Compression(StrEnum):
    """How a tar layer's bytes are compressed, and the magic number that starts such a stream."""

    GZIP = "gzip"
    ZSTD = "zstd"

    @property
    def magic(self) -> bytes:
        return _MAGIC[self]

    @classmethod
    def sniff(cls, head: bytes) -> Compression | None:
        """The compression whose magic number starts ``head``; None when no known one does (a
        plain tar, or bytes that are not a layer at all: the tar parser says which)."""
        for compression in cls:
            if head.startswith(compression.magic):
                return compression
        return None


_MAGIC = {Compression.GZIP: b"\x1f\x8b", Compression.ZSTD: b"\x28\xb5\x2f\xfd"}


class BlobFormat(StrEnum):
    """How a layer blob is framed: one raw file, or a tar (plain or compressed)."""

    RAW = "raw"
    TAR = "tar"
    TAR_GZIP = "tar+gzip"
    TAR_ZSTD = "tar+zstd"

    @property
    def is_tar(self) -> bool:
        return self is not BlobFormat.RAW

    @property
    def compression(self) -> Compression | None:
        """The tar's compression; None for a plain tar or a raw file."""
        _, _, compression = self.value.partition("+")
        return Compression(compression) if compression else None

    @classmethod
    def tar(cls, compression: Compression | None) -> BlobFormat:
        """The tar format with ``compression`` (None: a plain tar)."""
        return cls(f"tar+{compression}" if compression else "tar")


MODELPACK_KINDS = tuple(k for k in LayerKind if k.is_modelpack)


@dataclass(frozen=True)
class LayerType:
    """A layer media type, parsed: what the layer holds (kind) and how it is framed (format).

    ``legacy``: not the name modelpack writes by default (modctl's ``vnd.cnai``, written only
    with ``--spec-names cnai``; Docker's ``image.rootfs.diff``, never written); ``media_type`` is
    always the default name. ``names``: the ModelPack naming the type was spelled in (None for an
    image layer, which has one name whatever the naming).
    """

    kind: LayerKind
    format: BlobFormat
    legacy: bool = False
    names: SpecNames | None = field(default=None, compare=False)

    @property
    def media_type(self) -> str:
        return layer_media_type(self.kind, self.format)

    @property
    def is_raw(self) -> bool:
        return self.format is BlobFormat.RAW

    @property
    def is_tar(self) -> bool:
        return self.format.is_tar

    @property
    def compression(self) -> Compression | None:
        return self.format.compression


def _layer_table() -> dict[str, LayerType]:
    """Every layer media type modelpack reads, to its (kind, format): the one vocabulary."""
    table: dict[str, LayerType] = {}
    for kind in MODELPACK_KINDS:
        for fmt in BlobFormat:
            for names in SpecNames:
                table[f"{names.family}{kind}.v1.{fmt}"] = LayerType(
                    kind, fmt, legacy=names is not SpecNames.CNCF, names=names
                )
    for fmt in (BlobFormat.TAR, BlobFormat.TAR_GZIP, BlobFormat.TAR_ZSTD):
        table[MEDIA_TYPE_IMAGE_LAYER_TAR + fmt.removeprefix("tar")] = LayerType(LayerKind.IMAGE, fmt)
    for name, kit_kind in KITOPS_LAYER_KINDS.items():
        for fmt in (BlobFormat.TAR, BlobFormat.TAR_GZIP, BlobFormat.TAR_ZSTD):
            table[f"{_KITOPS_FAMILY}{name}.v1.{fmt}"] = LayerType(LayerKind(kit_kind), fmt, legacy=True)
    table[MEDIA_TYPE_DOCKER_LAYER_TAR] = LayerType(LayerKind.IMAGE, BlobFormat.TAR, legacy=True)
    table[MEDIA_TYPE_DOCKER_LAYER_TAR_GZIP] = LayerType(LayerKind.IMAGE, BlobFormat.TAR_GZIP, legacy=True)
    return table


#: layer media type → what it is; read-only
LAYER_MEDIA_TYPES: Mapping[str, LayerType] = MappingProxyType(_layer_table())
_WRITTEN = {
    (lt.kind, lt.format, names): mt
    for mt, lt in LAYER_MEDIA_TYPES.items()
    for names in SpecNames
    if (lt.names is names) or (lt.names is None and not lt.legacy)
}
#: the KitOps layer types: ModelPack kinds, read only, and only under a Kitfile config
KITOPS_LAYER_MEDIA_TYPES = frozenset(mt for mt in LAYER_MEDIA_TYPES if mt.startswith(_KITOPS_FAMILY))
# media types in these families name a layer format: one the table does not hold is refused by
# readers, never taken for a raw file (``+lz4``, a ``v2``, a foreign or non-distributable layer)
_LAYER_FAMILIES = (
    *(names.family for names in SpecNames),
    "application/vnd.oci.image.layer.",
    "application/vnd.docker.image.rootfs.",
    _KITOPS_FAMILY,
)


def layer_media_type(kind: str, fmt: str = BlobFormat.RAW, names: SpecNames = SpecNames.CNCF) -> str:
    """The media type modelpack writes for a layer of ``kind`` framed as ``fmt`` in the naming
    ``names`` (an image layer has one name whatever the naming); a pair the vocabulary has no
    name for is a programming error."""
    try:
        return _WRITTEN[(LayerKind(kind), BlobFormat(fmt), SpecNames(names))]
    except (KeyError, ValueError):
        raise ValueError(
            f"no layer media type for kind {kind!r} and format {fmt!r}; kinds: "
            f"{', '.join(LayerKind)}; formats: {', '.join(BlobFormat)} (an image layer is never raw)"
        ) from None


def parse_media_type(media_type: str) -> LayerType | None:
    """Any layer media type of the vocabulary (ModelPack, OCI or Docker image layer); None if it
    is not one."""
    return LAYER_MEDIA_TYPES.get(media_type)


def parse_layer_media_type(media_type: str) -> LayerType | None:
    """A ModelPack layer media type (CNCF or legacy CNAI, or a KitOps layer: its files have a
    ModelPack kind); None if it is not one."""
    lt = LAYER_MEDIA_TYPES.get(media_type)
    return lt if lt is not None and lt.kind.is_modelpack else None


def is_layer_family(media_type: str) -> bool:
    """Whether ``media_type`` is in a family of layer types this vocabulary speaks for (ModelPack,
    OCI or Docker image layers), known or not: readers refuse the unknown ones."""
    return media_type.startswith(_LAYER_FAMILIES)


def supported_layer_formats() -> list[str]:
    """What a refusal lists as readable: the ModelPack formats and the image layer media types."""
    image = (mt for mt, lt in LAYER_MEDIA_TYPES.items() if not lt.kind.is_modelpack)
    return sorted({*(str(fmt) for fmt in BlobFormat), *image})


def is_model_artifact_type(artifact_type: str | None) -> bool:
    return artifact_type in (ARTIFACT_TYPE_MODEL, _LEGACY_ARTIFACT_TYPE)


def is_model_config(media_type: str | None) -> bool:
    return media_type in (MEDIA_TYPE_CONFIG, _LEGACY_CONFIG)


def spec_names_of(media_type: str | None) -> SpecNames | None:
    """The ModelPack naming ``media_type`` is spelled in; None for any other type."""
    for names in SpecNames:
        if media_type and media_type.startswith(names.family):
            return names
    return None


def renamed_media_type(media_type: str, names: SpecNames) -> str:
    """``media_type`` spelled in the naming ``names``: the manifest's artifact type, the model
    config's type and every ModelPack layer type map to the same thing in the other naming;
    every other type (image layers, OCI configs, anything foreign) is returned unchanged. A
    ModelPack name the vocabulary does not know (a kind, format or version it has no reader for)
    is refused: keeping it would leave the manifest half in one naming and half in the other."""
    if is_model_artifact_type(media_type):
        return names.artifact_type
    if is_model_config(media_type):
        return names.config_media_type
    lt = parse_layer_media_type(media_type)
    if lt is not None:
        return layer_media_type(lt.kind, lt.format, names)
    if spec_names_of(media_type) is not None:
        raise UnsupportedLayerError(
            f"media type {media_type[:120]!r} is a ModelPack name this version does not know; "
            f"it cannot be respelled as {names}"
        )
    return media_type
