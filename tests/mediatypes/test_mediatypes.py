"""The contract: media type strings, legacy names, and the config schema."""

from __future__ import annotations

import json
from importlib import resources

import jsonschema
import pytest
from modelpack.mediatypes import (
    ARTIFACT_TYPE_MODEL,
    FORMATS,
    KINDS,
    MEDIA_TYPE_CONFIG,
    ModelConfig,
    ModelDescriptor,
    ModelFS,
    ModelSpecConfig,
    is_model_artifact_type,
    is_model_config,
    layer_filepath,
    layer_media_type,
    parse_layer_media_type,
)
from modelpack.mediatypes.config import validate_config_dict

from modelpack.errors import ConfigError, UnsafePathError

DIGEST = "sha256:" + "ab" * 32


def _schema() -> dict:
    return json.loads(resources.files("modelpack.mediatypes").joinpath("config-schema.json").read_text())


def test_every_layer_media_type_is_spelled_as_the_spec_says() -> None:
    expected = {
        f"application/vnd.cncf.model.{k}.v1.{f}"
        for k in ("weight", "weight.config", "doc", "code", "dataset")
        for f in ("raw", "tar", "tar+gzip", "tar+zstd")
    }
    built = {layer_media_type(k, f) for k in KINDS for f in FORMATS}
    assert built == expected
    for mt in expected:
        parsed = parse_layer_media_type(mt)
        assert parsed is not None and parsed.media_type == mt and not parsed.legacy


def test_manifest_and_config_types() -> None:
    assert ARTIFACT_TYPE_MODEL == "application/vnd.cncf.model.manifest.v1+json"
    assert MEDIA_TYPE_CONFIG == "application/vnd.cncf.model.config.v1+json"


def test_legacy_cnai_names_are_read_but_mapped_to_cncf() -> None:
    parsed = parse_layer_media_type("application/vnd.cnai.model.weight.config.v1.raw")
    assert parsed is not None
    assert (parsed.kind, parsed.format, parsed.legacy) == ("weight.config", "raw", True)
    assert parsed.media_type == "application/vnd.cncf.model.weight.config.v1.raw"
    assert is_model_artifact_type("application/vnd.cnai.model.manifest.v1+json")
    assert is_model_config("application/vnd.cnai.model.config.v1+json")
    assert layer_filepath({"org.cnai.model.filepath": "a/b.safetensors"}) == "a/b.safetensors"


@pytest.mark.parametrize(
    "media_type",
    [
        "application/vnd.cncf.model.weights.v1.raw",
        "application/vnd.cncf.model.weight.v1.zip",
        "application/vnd.oci.image.layer.v1.tar",
        "application/vnd.cncf.model.weight.v2.raw",
    ],
)
def test_non_modelpack_layer_types_are_not_parsed(media_type: str) -> None:
    assert parse_layer_media_type(media_type) is None


@pytest.mark.parametrize("path", ["../etc/passwd", "/abs/file", "a/../../b", "a\\b", "", "a/\x00b", "."])
def test_layer_paths_that_escape_are_refused(path: str) -> None:
    with pytest.raises(UnsafePathError):
        layer_filepath({"org.cncf.model.filepath": path})


def _config() -> ModelSpecConfig:
    return ModelSpecConfig(
        ModelDescriptor(name="m", version="1", createdAt="2026-01-02T03:04:05Z", licenses=["Apache-2.0"]),
        ModelConfig(
            architecture="transformer",
            format="safetensors",
            paramSize="8B",
            precision="bfloat16",
        ),
        ModelFS(diffIds=[DIGEST]),
    )


def test_config_round_trips_and_matches_the_json_schema() -> None:
    cfg = _config()
    raw = cfg.to_bytes()
    doc = json.loads(raw)
    jsonschema.validate(doc, _schema())
    again = ModelSpecConfig.from_bytes(raw)
    assert again.to_bytes() == raw
    assert again.descriptor.name == "m" and again.modelfs.diffIds == [DIGEST]


@pytest.mark.parametrize(
    "mutate, path",
    [
        (lambda d: d.pop("modelfs"), "$"),
        (lambda d: d.update(extra=1), "$"),
        (lambda d: d["descriptor"].update(color="red"), "$.descriptor"),
        (lambda d: d["config"].update(dtype="bf16"), "$.config"),
        (lambda d: d["modelfs"].update(type="tar"), "$.modelfs.type"),
        (lambda d: d["modelfs"].update(diffIds=[]), "$.modelfs.diffIds"),
        # stricter than the schema, which only asks for strings: a diffId must be a sha256 digest
        (lambda d: d["modelfs"].update(diffIds=["md5:abc"]), "$.modelfs.diffIds[0]"),
        (lambda d: d["descriptor"].update(name=""), "$.descriptor.name"),
        (lambda d: d["descriptor"].update(createdAt="yesterday"), "$.descriptor.createdAt"),
        # modelpack 0.1's transformerConfig is still read (and checked), never written
        (
            lambda d: d["config"].update(transformerConfig={"numLayers": 0}),
            "$.config.transformerConfig.numLayers",
        ),
        (
            lambda d: d["config"].update(transformerConfig={"attentionType": "x"}),
            "$.config.transformerConfig.attentionType",
        ),
    ],
)
def test_config_schema_violations_are_refused_like_jsonschema_does(mutate, path) -> None:  # type: ignore[no-untyped-def]
    doc = json.loads(_config().to_bytes())
    mutate(doc)
    with pytest.raises(ConfigError) as info:
        validate_config_dict(doc)
    assert info.value.path == path
    if path.startswith("$.modelfs.diffIds["):
        return
    # the spec's schema agrees that the document is invalid
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(doc, _schema(), format_checker=jsonschema.FormatChecker())
