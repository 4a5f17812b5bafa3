"""The two spellings of the ModelPack names: ``vnd.cncf`` (the spec since v0.0.7, the default)
and ``vnd.cnai`` (what released Harbor recognises and modctl writes), both written on request."""

from __future__ import annotations

import pytest
from modelpack.mediatypes import (
    ARTIFACT_TYPE_MODEL,
    MEDIA_TYPE_CONFIG,
    MEDIA_TYPE_IMAGE_CONFIG,
    MEDIA_TYPE_IMAGE_LAYER_TAR,
    MODELPACK_KINDS,
    BlobFormat,
    LayerKind,
    SpecNames,
    layer_media_type,
    parse_layer_media_type,
    renamed_media_type,
    spec_names_of,
)

from modelpack.errors import UnsupportedLayerError


def test_each_naming_spells_the_manifest_config_and_every_layer_type() -> None:
    assert SpecNames.CNCF.artifact_type == ARTIFACT_TYPE_MODEL
    assert SpecNames.CNCF.config_media_type == MEDIA_TYPE_CONFIG
    assert SpecNames.CNAI.artifact_type == "application/vnd.cnai.model.manifest.v1+json"
    assert SpecNames.CNAI.config_media_type == "application/vnd.cnai.model.config.v1+json"
    for kind in MODELPACK_KINDS:
        for fmt in BlobFormat:
            cnai = layer_media_type(kind, fmt, SpecNames.CNAI)
            assert cnai == f"application/vnd.cnai.model.{kind}.v1.{fmt}"
            assert layer_media_type(kind, fmt) == f"application/vnd.cncf.model.{kind}.v1.{fmt}"
            parsed = parse_layer_media_type(cnai)
            assert parsed is not None and (parsed.kind, parsed.format) == (kind, fmt)
            assert parsed.names is SpecNames.CNAI


def test_an_image_layer_has_one_name_whatever_the_naming() -> None:
    assert layer_media_type(LayerKind.IMAGE, BlobFormat.TAR, SpecNames.CNAI) == MEDIA_TYPE_IMAGE_LAYER_TAR


@pytest.mark.parametrize("names", list(SpecNames))
def test_renaming_maps_model_types_and_leaves_every_other_type_alone(names: SpecNames) -> None:
    other = SpecNames.CNAI if names is SpecNames.CNCF else SpecNames.CNCF
    assert renamed_media_type(other.artifact_type, names) == names.artifact_type
    assert renamed_media_type(other.config_media_type, names) == names.config_media_type
    assert renamed_media_type(names.config_media_type, names) == names.config_media_type
    src = layer_media_type(LayerKind.WEIGHT_CONFIG, BlobFormat.TAR_ZSTD, other)
    assert renamed_media_type(src, names) == layer_media_type(
        LayerKind.WEIGHT_CONFIG, BlobFormat.TAR_ZSTD, names
    )
    for untouched in (MEDIA_TYPE_IMAGE_CONFIG, MEDIA_TYPE_IMAGE_LAYER_TAR, "application/octet-stream"):
        assert renamed_media_type(untouched, names) == untouched


@pytest.mark.parametrize(
    "hostile",
    [
        "application/vnd.cnai.model.weights.v1.raw",  # a kind the spec does not name
        "application/vnd.cncf.model.weight.v1.tar+lz4",  # a format no reader supports
        "application/vnd.cnai.model.manifest.v2+json",
    ],
)
def test_renaming_refuses_a_model_type_it_does_not_know_rather_than_keeping_the_old_name(
    hostile: str,
) -> None:
    """A half-renamed manifest would carry both namings; the unknown name is refused, named."""
    with pytest.raises(UnsupportedLayerError, match="ModelPack name"):
        renamed_media_type(hostile, SpecNames.CNAI)


def test_which_naming_a_manifest_uses_is_read_from_its_types() -> None:
    assert spec_names_of(SpecNames.CNAI.artifact_type) is SpecNames.CNAI
    assert spec_names_of(SpecNames.CNCF.config_media_type) is SpecNames.CNCF
    assert spec_names_of(layer_media_type(LayerKind.DOC, BlobFormat.RAW, SpecNames.CNAI)) is SpecNames.CNAI
    assert spec_names_of(MEDIA_TYPE_IMAGE_CONFIG) is None
