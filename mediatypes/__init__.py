"""The ModelPack contract: media types, annotation keys and the model config.

Everything that names a byte format on the wire lives here so that the rest of the code never
spells a media type string by hand. Writers always emit the CNCF (``vnd.cncf`` / ``org.cncf``)
names; readers also accept the older CNAI names that modctl releases still produce.
"""

from modelpack.mediatypes.annotations import (
    ANNOTATION_CREATED,
    ANNOTATION_FILE_MEDIATYPE_UNTESTED,
    ANNOTATION_FILE_METADATA,
    ANNOTATION_FILEPATH,
    ANNOTATION_TITLE,
    FileMetadata,
    layer_filepath,
)
from modelpack.mediatypes.config import ModelConfig, ModelDescriptor, ModelFS, ModelSpecConfig
from modelpack.mediatypes.types import (
    ARTIFACT_TYPE_MODEL,
    FORMATS,
    IMAGE_LAYER_MEDIA_TYPES,
    KINDS,
    MEDIA_TYPE_CONFIG,
    MEDIA_TYPE_DOCKER_IMAGE_CONFIG,
    MEDIA_TYPE_DOCKER_LAYER_TAR,
    MEDIA_TYPE_DOCKER_LAYER_TAR_GZIP,
    MEDIA_TYPE_DOCKER_MANIFEST,
    MEDIA_TYPE_DOCKER_MANIFEST_LIST,
    MEDIA_TYPE_EMPTY,
    MEDIA_TYPE_IMAGE_CONFIG,
    MEDIA_TYPE_IMAGE_LAYER_TAR,
    MEDIA_TYPE_IMAGE_LAYER_TAR_GZIP,
    MEDIA_TYPE_IMAGE_LAYER_TAR_ZSTD,
    MEDIA_TYPE_OCI_INDEX,
    MEDIA_TYPE_OCI_MANIFEST,
    LayerType,
    is_model_artifact_type,
    is_model_config,
    layer_media_type,
    parse_layer_media_type,
)

from modelpack.errors import ConfigError

__all__ = [
    "ANNOTATION_CREATED",
    "ANNOTATION_FILEPATH",
    "ANNOTATION_FILE_MEDIATYPE_UNTESTED",
    "ANNOTATION_FILE_METADATA",
    "ANNOTATION_TITLE",
    "ARTIFACT_TYPE_MODEL",
    "FORMATS",
    "IMAGE_LAYER_MEDIA_TYPES",
    "KINDS",
    "MEDIA_TYPE_CONFIG",
    "MEDIA_TYPE_DOCKER_IMAGE_CONFIG",
    "MEDIA_TYPE_DOCKER_LAYER_TAR",
    "MEDIA_TYPE_DOCKER_LAYER_TAR_GZIP",
    "MEDIA_TYPE_DOCKER_MANIFEST",
    "MEDIA_TYPE_DOCKER_MANIFEST_LIST",
    "MEDIA_TYPE_EMPTY",
    "MEDIA_TYPE_IMAGE_CONFIG",
    "MEDIA_TYPE_IMAGE_LAYER_TAR",
    "MEDIA_TYPE_IMAGE_LAYER_TAR_GZIP",
    "MEDIA_TYPE_IMAGE_LAYER_TAR_ZSTD",
    "MEDIA_TYPE_OCI_INDEX",
    "MEDIA_TYPE_OCI_MANIFEST",
    "ConfigError",
    "FileMetadata",
    "LayerType",
    "ModelConfig",
    "ModelDescriptor",
    "ModelFS",
    "ModelSpecConfig",
    "is_model_artifact_type",
    "is_model_config",
    "layer_filepath",
    "layer_media_type",
    "parse_layer_media_type",
]
