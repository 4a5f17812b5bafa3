"""What modelpack writes is what the released ModelPack spec defines.

The model config is checked against upstream ``schema/config-schema.json`` of model-spec v0.0.7,
vendored byte for byte (a test here fails if it is edited); no member the release does not
define, no ``org.cncf.model.*`` key the spec does not define; ``config.architecture`` is the
spec's kind; file metadata carries the file name, the real mode and a reproducible mtime.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tarfile
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from modelpack.mediatypes import ModelConfig, ModelDescriptor, ModelFS, ModelSpecConfig, spec_schema

from modelpack import api
from modelpack.errors import ConfigError, PackError
from modelpack.oci.descriptor import Manifest
from modelpack.packing.packer import PackOptions
from modelpack.targets.layout import OCILayoutTarget
from tests.paths import REPO_ROOT

ROOT = REPO_ROOT
#: sha256 of model-spec v0.0.7 schema/config-schema.json (commit 6440437b4932…): pinned here, in
#: mediatypes/config-schema.PROVENANCE.md and in modelpack.mediatypes.spec_schema
V007_SHA256 = "c755da7f78371519c09df7d92e74c7997184f5c73472be20d9dfb840d0ebbe0a"
V007_COMMIT = "6440437b4932ef6cdd134d24a410f73181303ce7"
#: the only org.cncf.model.* keys the spec defines (annotations.md)
SPEC_KEYS = {
    "org.cncf.model.filepath",
    "org.cncf.model.file.metadata+json",
    "org.cncf.model.file.mediatype.untested",
}
DIGEST = "sha256:" + "ab" * 32


def _schema() -> dict[str, Any]:
    return json.loads(resources.files("modelpack.mediatypes").joinpath("config-schema.json").read_bytes())


def _validate(doc: Any) -> None:
    schema = _schema()
    assert schema["$schema"] == "http://json-schema.org/draft-04/schema#"
    validator = jsonschema.validators.validator_for(schema)
    assert validator is jsonschema.Draft4Validator  # the draft the schema declares
    validator(schema, format_checker=jsonschema.Draft4Validator.FORMAT_CHECKER).validate(doc)


def _members_are_defined(doc: Any, node: dict[str, Any], path: str = "$") -> None:
    """Every member of ``doc`` is listed in the schema (also where additionalProperties is open)."""
    schema = _schema()
    while "$ref" in node:
        node = schema["$defs"][node["$ref"].rsplit("/", 1)[-1]]
    if isinstance(doc, dict):
        for key, value in doc.items():
            assert key in node.get("properties", {}), f"{path}.{key} is not defined by model-spec v0.0.7"
            _members_are_defined(value, node["properties"][key], f"{path}.{key}")


def _pack(
    src: Path, dest: Path, opts: PackOptions | None = None, **kw: Any
) -> tuple[Manifest, OCILayoutTarget]:
    api.pack(str(src), f"oci:{dest}:v1", opts, **kw)
    target = OCILayoutTarget(dest)
    manifest, _ = api.fetch_manifest(target, "v1")
    return manifest, target


# --- the vendored schema --------------------------------------------------------------------------


def test_vendored_schema_is_the_v0_0_7_release_byte_for_byte() -> None:
    raw = (ROOT / "mediatypes" / "config-schema.json").read_bytes()
    assert hashlib.sha256(raw).hexdigest() == V007_SHA256, "mediatypes/config-schema.json was edited"
    assert spec_schema.SCHEMA_SHA256 == V007_SHA256 and spec_schema.SPEC_COMMIT == V007_COMMIT
    note = (ROOT / "mediatypes" / "config-schema.PROVENANCE.md").read_text()
    assert V007_SHA256 in note and V007_COMMIT in note and "v0.0.7" in note
    # the installed package carries the same bytes
    assert spec_schema.schema_bytes() == raw


def test_an_edited_schema_is_refused_not_trusted(monkeypatch: pytest.MonkeyPatch) -> None:
    edited = (
        (ROOT / "mediatypes" / "config-schema.json").read_bytes().replace(b'"minItems": 1', b'"minItems": 0')
    )
    monkeypatch.setattr(spec_schema, "schema_bytes", lambda: edited)
    spec_schema.spec_schema.cache_clear()
    try:
        with pytest.raises(ConfigError, match=r"not model-spec v0\.0\.7's"):
            spec_schema.spec_schema()
    finally:
        monkeypatch.undo()
        spec_schema.spec_schema.cache_clear()


# --- the config written -----------------------------------------------------------------------------


def test_packed_config_validates_against_the_release_schema(checkpoint: Path, tmp_path: Path) -> None:
    opts = PackOptions(
        name="llama-tiny",
        version="1.0",
        vendor="Example",
        description="a test model",
        licenses=["Apache-2.0"],
        created="2026-01-02T03:04:05Z",
        quantization="none",
    )
    manifest, target = _pack(checkpoint, tmp_path / "l", opts)
    doc = json.loads(api.fetch_config(target, manifest))
    _validate(doc)
    _members_are_defined(doc, _schema())
    assert "transformerConfig" not in doc["config"]
    assert doc["config"]["architecture"] == "transformer"


def test_transformer_shape_and_hf_class_are_project_annotations(checkpoint: Path, tmp_path: Path) -> None:
    cfg = json.loads((checkpoint / "config.json").read_text())
    cfg.update(num_local_experts=8, kv_lora_rank=64)
    (checkpoint / "config.json").write_text(json.dumps(cfg))
    manifest, _ = _pack(checkpoint, tmp_path / "l")
    ann = manifest.annotations or {}
    assert ann["dev.modelpack.hf.architecture"] == "LlamaForCausalLM"
    shape = json.loads(ann["dev.modelpack.model.transformer+json"])
    assert shape["attentionType"] == "mla" and shape["mlpType"] == "moe" and shape["numLayers"] == 2


def test_a_checkpoint_without_attention_heads_gets_no_architecture_guess(
    checkpoint: Path, tmp_path: Path
) -> None:
    (checkpoint / "config.json").write_text(json.dumps({"model_type": "cnn-thing", "architectures": ["Net"]}))
    manifest, target = _pack(checkpoint, tmp_path / "l")
    doc = json.loads(api.fetch_config(target, manifest))
    assert "architecture" not in doc["config"]
    _validate(doc)
    manifest, target = _pack(checkpoint, tmp_path / "l2", PackOptions(architecture="cnn"))
    assert json.loads(api.fetch_config(target, manifest))["config"]["architecture"] == "cnn"


@pytest.mark.parametrize(
    "config, path",
    [
        (ModelConfig(architecture="transformer", transformerConfig={"numLayers": 2}), "$.config"),
        (ModelConfig(capabilities={"languages": ["en"]}), "$.config.capabilities"),
        (ModelConfig(capabilities={"reward": True}), "$.config.capabilities"),
    ],
)
def test_members_the_release_does_not_define_are_never_written(config: ModelConfig, path: str) -> None:
    spec = ModelSpecConfig(ModelDescriptor(name="m"), config, ModelFS(diffIds=[DIGEST]))
    with pytest.raises(ConfigError) as info:
        spec.to_bytes()
    assert info.value.path == path


def test_datasets_url_from_the_branch_head_is_read_but_not_written() -> None:
    doc = {
        "descriptor": {"name": "m", "datasetsURL": ["https://example.com/d"]},
        "config": {"capabilities": {"reward": False, "languages": ["en"]}},
        "modelfs": {"type": "layers", "diffIds": [DIGEST]},
    }
    read = ModelSpecConfig.from_bytes(json.dumps(doc).encode())  # another tool wrote it: readable
    assert read.descriptor.datasetsURL == ["https://example.com/d"]
    with pytest.raises(ConfigError, match="datasetsURL"):
        read.to_bytes()


def test_configs_written_by_modelpack_0_1_stay_readable() -> None:
    old = {
        "descriptor": {"name": "m"},
        "config": {
            "architecture": "LlamaForCausalLM",
            "transformerConfig": {"numLayers": 2, "mlpType": "dense"},
        },
        "modelfs": {"type": "layers", "diffIds": [DIGEST]},
    }
    assert ModelSpecConfig.from_bytes(json.dumps(old).encode()).config.transformerConfig == {
        "numLayers": 2,
        "mlpType": "dense",
    }


def test_no_undefined_org_cncf_model_keys_anywhere(checkpoint: Path, tmp_path: Path) -> None:
    manifest, _ = _pack(checkpoint, tmp_path / "l", PackOptions(other_files="doc"))
    (checkpoint / "notes.xyz").write_text("x")
    image, target = _pack(checkpoint, tmp_path / "i", format="image")
    labels = json.loads(api.fetch_config(target, image))["config"]["Labels"]
    keys: set[str] = set(manifest.annotations or {}) | set(image.annotations or {}) | set(labels)
    for layer in (*manifest.layers, *image.layers):
        keys |= set(layer.annotations or {})
    undefined = {k for k in keys if k.startswith(("org.cncf.", "org.cnai.")) and k not in SPEC_KEYS}
    assert not undefined
    assert labels["dev.modelpack.model.name"] and labels["dev.modelpack.artifact.digest"].startswith(
        "sha256:"
    )
    assert labels["dev.modelpack.model.architecture"] == "transformer"
    assert labels["dev.modelpack.hf.architecture"] == "LlamaForCausalLM"


# --- file metadata --------------------------------------------------------------------------------


def _metadata(manifest: Manifest) -> dict[str, dict[str, Any]]:
    return {
        layer.annotations["org.cncf.model.filepath"]: json.loads(
            layer.annotations["org.cncf.model.file.metadata+json"]
        )
        for layer in manifest.layers
        if layer.annotations
    }


def test_file_metadata_name_is_the_file_name_and_mode_is_the_files(checkpoint: Path, tmp_path: Path) -> None:
    (checkpoint / "sub").mkdir()
    (checkpoint / "sub" / "tokenizer.json").write_text("{}")
    (checkpoint / "run.py").write_text("print(1)\n")
    os.chmod(checkpoint / "run.py", 0o755)
    os.chmod(checkpoint / "config.json", 0o640)
    meta = _metadata(_pack(checkpoint, tmp_path / "l")[0])
    assert meta["sub/tokenizer.json"]["name"] == "tokenizer.json"  # model-spec: "File name"
    assert meta["run.py"]["mode"] == 0o755
    assert meta["config.json"]["mode"] == 0o640
    assert meta["README.md"]["mode"] == (checkpoint / "README.md").stat().st_mode & 0o777
    for m in meta.values():
        assert (m["uid"], m["gid"], m["mtime"]) == (0, 0, "1970-01-01T00:00:00Z")
        assert set(m) == {"name", "mode", "uid", "gid", "size", "mtime", "typeflag"}


def test_setuid_and_sticky_bits_are_not_recorded(checkpoint: Path, tmp_path: Path) -> None:
    os.chmod(checkpoint / "README.md", 0o4755 | 0o1000)
    assert _metadata(_pack(checkpoint, tmp_path / "l")[0])["README.md"]["mode"] == 0o755


def test_source_date_epoch_sets_the_recorded_mtime_reproducibly(
    checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    a, _ = _pack(checkpoint, tmp_path / "a")
    assert {m["mtime"] for m in _metadata(a).values()} == {"2023-11-14T22:13:20Z"}
    for p in checkpoint.iterdir():
        os.utime(p, (1_000_000, 1_000_000))  # the files' own times never matter
    b, _ = _pack(checkpoint, tmp_path / "b")
    assert a.digest == b.digest
    monkeypatch.delenv("SOURCE_DATE_EPOCH")
    c, _ = _pack(checkpoint, tmp_path / "c")
    assert c.digest != a.digest
    image, target = _pack(checkpoint, tmp_path / "i", format="image")
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    image2, target2 = _pack(checkpoint, tmp_path / "i2", format="image")
    with tarfile.open(target2.blob_path(image2.layers[0].digest)) as tar:
        assert {m.mtime for m in tar.getmembers()} == {1700000000}
    with tarfile.open(target.blob_path(image.layers[0].digest)) as tar:
        assert {m.mtime for m in tar.getmembers()} == {0}


@pytest.mark.parametrize("value", ["yesterday", "-5", "1.5", "99999999999999"])
def test_a_malformed_source_date_epoch_is_refused_before_hashing(
    checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("SOURCE_DATE_EPOCH", value)
    with pytest.raises(PackError, match="SOURCE_DATE_EPOCH"):
        _pack(checkpoint, tmp_path / "l")


def test_image_tar_members_keep_the_file_mode(checkpoint: Path, tmp_path: Path) -> None:
    (checkpoint / "run.py").write_text("print(1)\n")
    os.chmod(checkpoint / "run.py", 0o755)
    image, target = _pack(checkpoint, tmp_path / "i", format="image")
    modes = {}
    for layer in image.layers:
        with tarfile.open(target.blob_path(layer.digest)) as tar:
            modes.update({m.name: m.mode for m in tar.getmembers() if m.isfile()})
    assert modes["models/run.py"] == 0o755
    assert modes["models/config.json"] == (checkpoint / "config.json").stat().st_mode & 0o777


def test_reshards_keep_the_mode_of_the_file_they_came_from(tmp_path: Path) -> None:
    from modelpack.testdata.synthetic import SyntheticSpec, write_checkpoint

    ckpt = tmp_path / "big"
    write_checkpoint(str(ckpt), SyntheticSpec(hidden=512, intermediate=1376, layers=2, vocab=2048))
    for p in ckpt.glob("*.safetensors"):
        os.chmod(p, 0o640)
    meta = _metadata(_pack(ckpt, tmp_path / "l", PackOptions(max_file_size=1024 * 1024))[0])
    shards = [k for k in meta if re.search(r"-\d{5}-of-\d{5}\.safetensors$", k)]
    assert len(shards) > 1 and {meta[k]["mode"] for k in shards} == {0o640}
