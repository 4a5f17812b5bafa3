"""The contract: media type strings, legacy names, and the config schema."""

from __future__ import annotations

import ast
import json
import re
from importlib import resources
from pathlib import Path

import jsonschema
import pytest
from modelpack.mediatypes import (
    ARTIFACT_TYPE_MODEL,
    MEDIA_TYPE_CONFIG,
    MEDIA_TYPE_IMAGE_CONFIG,
    MODELPACK_KINDS,
    BlobFormat,
    Compression,
    LayerKind,
    LayerType,
    ModelConfig,
    ModelDescriptor,
    ModelFS,
    ModelSpecConfig,
    is_layer_family,
    is_model_artifact_type,
    is_model_config,
    layer_filepath,
    layer_media_type,
    parse_layer_media_type,
    parse_media_type,
)
from modelpack.mediatypes.config import validate_config_dict

from modelpack.errors import ConfigError, UnsafePathError, UnsupportedLayerError
from modelpack.transfer.layer_formats import layer_format
from tests.paths import REPO_ROOT

DIGEST = "sha256:" + "ab" * 32


def _schema() -> dict:
    return json.loads(resources.files("modelpack.mediatypes").joinpath("config-schema.json").read_text())


def test_every_layer_media_type_is_spelled_as_the_spec_says() -> None:
    expected = {
        f"application/vnd.cncf.model.{k}.v1.{f}"
        for k in ("weight", "weight.config", "doc", "code", "dataset")
        for f in ("raw", "tar", "tar+gzip", "tar+zstd")
    }
    built = {layer_media_type(k, f) for k in MODELPACK_KINDS for f in BlobFormat}
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


# --------------------------------------------------------------------------- the one vocabulary


@pytest.mark.parametrize("kind", list(LayerKind))
@pytest.mark.parametrize("fmt", list(BlobFormat))
def test_every_kind_and_format_round_trips_through_its_media_type(kind: LayerKind, fmt: BlobFormat) -> None:
    """Each (kind, format) the vocabulary names has one written media type, which parses back to
    the same pair; the only pair without a name is a raw image layer (an image layer is a tar)."""
    if kind is LayerKind.IMAGE and fmt is BlobFormat.RAW:
        with pytest.raises(ValueError, match="image-layer"):
            layer_media_type(kind, fmt)
        return
    media_type = layer_media_type(kind, fmt)
    parsed = parse_media_type(media_type)
    assert parsed == LayerType(kind, fmt, legacy=False)
    assert parsed.media_type == media_type
    assert (parse_layer_media_type(media_type) is not None) == kind.is_modelpack
    assert parsed.is_tar == fmt.is_tar == (fmt is not BlobFormat.RAW)
    assert parsed.compression == fmt.compression


def test_formats_know_their_compression_and_are_built_from_it() -> None:
    """``tar+gzip`` is a gzip tar, ``raw`` is no tar at all; the tar format for a compression is
    the inverse."""
    assert [f.compression for f in BlobFormat] == [None, None, Compression.GZIP, Compression.ZSTD]
    assert [f.is_tar for f in BlobFormat] == [False, True, True, True]
    for compression in (None, *Compression):
        fmt = BlobFormat.tar(compression)
        assert fmt.is_tar and fmt.compression == compression


def test_a_compression_is_recognised_by_its_magic_number_and_nothing_else_is() -> None:
    """gzip starts ``1f 8b``, zstd ``28 b5 2f fd``; a tar (its first member's name) or an empty
    blob is no compression."""
    assert Compression.sniff(b"\x1f\x8b\x08\x00rest") is Compression.GZIP
    assert Compression.sniff(b"\x28\xb5\x2f\xfd\x00") is Compression.ZSTD
    assert Compression.sniff(b"models/config.json\x00") is None and Compression.sniff(b"") is None
    assert Compression.sniff(b"\x28\xb5\x2f") is None  # a prefix of a magic number is not one


def test_members_are_the_strings_the_spec_and_stored_json_spell() -> None:
    """Members compare, hash and format as their values, so a stored ``"kind": "weight"`` and a
    manifest written before the enums existed read the same."""
    assert LayerKind.WEIGHT == "weight" and {"weight.config": 1}[LayerKind.WEIGHT_CONFIG] == 1
    assert f"{BlobFormat.TAR_ZSTD}" == "tar+zstd" and json.dumps([LayerKind.DOC]) == '["doc"]'
    assert LayerKind("dataset") is LayerKind.DATASET


@pytest.mark.parametrize(
    ("media_type", "kind", "fmt"),
    [
        ("application/vnd.cnai.model.weight.v1.raw", LayerKind.WEIGHT, BlobFormat.RAW),
        ("application/vnd.cnai.model.weight.config.v1.tar", LayerKind.WEIGHT_CONFIG, BlobFormat.TAR),
        ("application/vnd.cnai.model.dataset.v1.tar+zstd", LayerKind.DATASET, BlobFormat.TAR_ZSTD),
        ("application/vnd.docker.image.rootfs.diff.tar", LayerKind.IMAGE, BlobFormat.TAR),
        ("application/vnd.docker.image.rootfs.diff.tar.gzip", LayerKind.IMAGE, BlobFormat.TAR_GZIP),
    ],
)
def test_older_names_parse_as_aliases_of_the_names_written(
    media_type: str, kind: LayerKind, fmt: BlobFormat
) -> None:
    """modctl's ``vnd.cnai`` and Docker's rootfs names are read as the same (kind, format) and
    never written: the parsed type names the CNCF or OCI media type."""
    parsed = parse_media_type(media_type)
    assert parsed == LayerType(kind, fmt, legacy=True)
    assert parsed.media_type != media_type and parse_media_type(parsed.media_type) == LayerType(kind, fmt)


@pytest.mark.parametrize(
    "media_type",
    [
        "application/vnd.cncf.model.weight.v1.tar+lz4",
        "application/vnd.cnai.model.weights.v1.raw",
        "application/vnd.oci.image.layer.v1.tar+lz4",
        "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip",
        "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip",
        "application/vnd.cncf.model.image-layer.v1.tar",
    ],
)
def test_unknown_layer_media_types_are_refused_with_the_type_named(media_type: str) -> None:
    """A media type in a layer family the vocabulary speaks for, but not in its table, is no
    layer anyone reads: the reader refuses it and says which type (never a raw file)."""
    assert parse_media_type(media_type) is None and is_layer_family(media_type)
    with pytest.raises(UnsupportedLayerError, match=re.escape(media_type)) as info:
        layer_format(MEDIA_TYPE_IMAGE_CONFIG, media_type)
    assert "tar+zstd" in str(info.value)  # and what would have been read


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            first = node.body[0] if node.body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


def _vocabulary_violations(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    docstrings = _docstrings(tree)
    vocabulary = {str(v) for v in (*LayerKind, *BlobFormat)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            if _LAYER_TYPE_SPELLING.search(node.value):
                found.append(f"{node.lineno}: spells a layer media type: {node.value!r}")
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            literals = [
                c.value
                for o in operands
                for c in ([o] if not isinstance(o, ast.Tuple | ast.List | ast.Set) else o.elts)
                if isinstance(c, ast.Constant) and isinstance(c.value, str)
            ]
            if vocabulary.intersection(literals):
                found.append(f"{node.lineno}: compares a kind or format with a string: {ast.unparse(node)}")
    return found


_LAYER_TYPE_SPELLING = re.compile(
    r"vnd\.cn(cf|ai)\.model\.|application/vnd\.oci\.image\.layer\.|application/vnd\.docker\.image\.rootfs\."
)


def test_no_module_outside_the_contract_spells_a_layer_media_type_or_compares_a_kind_to_a_string() -> None:
    """The vocabulary lives in ``mediatypes``: elsewhere a layer media type is built or parsed by
    it (no ``vnd.cncf.model.`` / ``vnd.cnai.model.`` layer name, no image layer type spelled in
    code), and a kind or format is compared as a member, never as a string literal."""
    root = REPO_ROOT
    found = []
    for package in ("modelpack", "signing", "mount", "loader"):
        for path in sorted((root / package).rglob("*.py")):
            rel = path.relative_to(root)
            if rel.parts[:2] != ("modelpack", "mediatypes"):
                found += [f"{rel}:{v}" for v in _vocabulary_violations(path)]
    assert not found, "\n".join(found)
