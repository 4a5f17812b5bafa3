"""``pack``/``push --modelfile``: modctl's Modelfile, parsed as modctl parses it, packed as modctl builds it
(as far as the released ModelPack spec defines it), with every glob kept inside the context directory.

The Modelfiles under ``tests/fixtures/modctl/`` are modctl's own (docs and parser tests, commit and
sha256 in its PROVENANCE.md). modctl numbers lines from 0 in its errors; modelpack from 1, so
modctl's "line 4" is our line 5.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from modelpack.mediatypes import ANNOTATION_FILE_MEDIATYPE_UNTESTED
from safetensors.torch import save_file

from modelpack import api
from modelpack.errors import ModelfileError
from modelpack.packing.modelfile import (
    MAX_GLOBS,
    MAX_LINE_BYTES,
    MAX_MODELFILE_BYTES,
    build_modelfile_artifact,
    parse_modelfile,
    read_modelfile,
    select_files,
)
from modelpack.packing.packed_artifact import PackOptions
from tests import paths
from tests.fixtures.registry import RegistryServer

FIXTURES = paths.FIXTURES / "modctl"

# What modctl writes, from its source at the commit in PROVENANCE.md:
# - pkg/backend/build.go getProcessors: CONFIG → MediaTypeModelWeightConfig, MODEL → MediaTypeModelWeight,
#   CODE → MediaTypeModelCode, DOC → MediaTypeModelDoc; with `modctl build --raw` the `…Raw` variants.
#   model-spec v0.0.7 specs-go/v1/mediatype.go (modctl's go.mod) spells those
#   application/vnd.cncf.model.<kind>.v1.tar and …v1.raw. DATASET is parsed but has no processor:
#   modctl writes no layer for it; modelpack writes the spec's dataset layer.
MODCTL_RAW_LAYER_TYPES = {
    "CONFIG": "application/vnd.cncf.model.weight.config.v1.raw",
    "MODEL": "application/vnd.cncf.model.weight.v1.raw",
    "CODE": "application/vnd.cncf.model.code.v1.raw",
    "DOC": "application/vnd.cncf.model.doc.v1.raw",
}
# - pkg/backend/build/builder.go BuildModelConfig: ARCH → config.architecture, FORMAT → config.format,
#   PRECISION → config.precision, QUANTIZATION → config.quantization, PARAMSIZE → config.paramSize,
#   FAMILY → descriptor.family, NAME → descriptor.name (createdAt = now unless --no-creation-time:
#   modelpack writes none, for reproducible digests).
MODCTL_CONFIG_FIELDS = {
    "ARCH": ("config", "architecture"),
    "FORMAT": ("config", "format"),
    "PRECISION": ("config", "precision"),
    "QUANTIZATION": ("config", "quantization"),
    "PARAMSIZE": ("config", "paramSize"),
    "FAMILY": ("descriptor", "family"),
    "NAME": ("descriptor", "name"),
}


def _provenance() -> dict[str, str]:
    rows = re.findall(
        r"^\| `([^`]+)` \| `[^`]+` \| [^|]+ \| `([0-9a-f]{64})` \|$",
        (FIXTURES / "PROVENANCE.md").read_text(),
        re.M,
    )
    return dict(rows)


def test_vendored_modelfiles_are_modctls_bytes() -> None:
    rows = _provenance()
    assert set(rows) == {p.name for p in FIXTURES.glob("*.Modelfile")}
    for name, sha in rows.items():
        assert hashlib.sha256((FIXTURES / name).read_bytes()).hexdigest() == sha, name


def test_modctls_test_modelfiles_parse_as_modctls_tests_expect() -> None:
    # pkg/modelfile/modelfile_test.go TestNewModelfile, cases 1, 2 and 4
    for name in ("all-commands.Modelfile", "aligned-commands.Modelfile", "duplicate-globs.Modelfile"):
        mf = read_modelfile(str(FIXTURES / name))
        globs: dict[str, list[str]] = {}
        for g in mf.globs:
            globs.setdefault(g.command, []).append(g.pattern)
        n = 2 if name == "duplicate-globs.Modelfile" else 1
        for cmd in ("CONFIG", "MODEL", "CODE", "DATASET", "DOC"):
            assert sorted(globs[cmd]) == [f"{cmd.lower()}{i}" for i in range(1, n + 1)], (name, cmd)
        for cmd in ("NAME", "ARCH", "FAMILY", "FORMAT", "PARAMSIZE", "PRECISION", "QUANTIZATION"):
            assert mf.fields[cmd] == f"{cmd.lower()}1"
    # "duplicate name command on line 4" / "parse error on line 2" (modctl counts from 0)
    with pytest.raises(ModelfileError, match="duplicate NAME") as err:
        read_modelfile(str(FIXTURES / "duplicate-name.Modelfile"))
    assert err.value.line == 5
    with pytest.raises(ModelfileError, match="unknown command") as err:
        read_modelfile(str(FIXTURES / "invalid-command-line2.Modelfile"))
    assert err.value.line == 3
    # TestModelfileParsingWithQuotedPaths
    assert (
        read_modelfile(str(FIXTURES / "quoted-paths-with-spaces.Modelfile")).globs[0].pattern
        == "config file.json"
    )
    assert read_modelfile(str(FIXTURES / "mixed-quoted-unquoted.Modelfile")).fields["NAME"] == "test-model"
    with pytest.raises(ModelfileError, match="takes one argument") as err:
        read_modelfile(str(FIXTURES / "unquoted-paths-with-spaces.Modelfile"))
    assert err.value.line == 3


def test_quoting_escapes_comments_and_case_as_modctl_parses_them() -> None:
    mf = parse_modelfile(
        b'# comment\r\n\r\nname "my model"\r\nmodel \\"odd\\".safetensors\n  # indented comment\nDoc ""README".md"\n'
    )
    assert mf.fields["NAME"] == "my model"
    assert [(g.command, g.pattern, g.line) for g in mf.globs] == [
        ("MODEL", '"odd".safetensors', 4),
        ("DOC", "README.md", 6),
    ]
    for text, message, line in (
        (b"MODEL a.bin # trailing comment\n", "takes one argument", 1),
        (b'\nNAME "unclosed\n', "unclosed quotes", 2),
        (b'\n\nNAME ""\n', "empty argument", 3),
        (b"MODEL\n", "takes one argument", 1),
        (b"MODELS a\n", "unknown command MODELS", 1),
        (b"\nFROM llama3\n", "unknown command", 2),
        (b"NAME a\x1b[2Jb\n", "control character", 1),
        (b"NAME \xff\n", "not UTF-8", 1),
    ):
        with pytest.raises(ModelfileError, match=message) as err:
            parse_modelfile(text, "MF")
        assert err.value.line == line and str(err.value).startswith(f"MF:{line}: ")


def test_parsing_is_bounded() -> None:
    with pytest.raises(ModelfileError, match="larger than"):
        parse_modelfile(b"# x\n" * (MAX_MODELFILE_BYTES // 4 + 1))
    with pytest.raises(ModelfileError, match="line longer") as err:
        parse_modelfile(b"NAME a\nDOC " + b"a" * MAX_LINE_BYTES + b"\n")
    assert err.value.line == 2
    many = b"".join(b"DOC f%d.md\n" % i for i in range(MAX_GLOBS + 1))
    with pytest.raises(ModelfileError, match="more than") as err:
        parse_modelfile(many)
    assert err.value.line == MAX_GLOBS + 1


def test_globs_match_as_gos_filepath_match(tmp_path: Path) -> None:
    ctx = tmp_path / "ctx"
    (ctx / "sub").mkdir(parents=True)
    for name in ("a.md", "b.md", "!.md", ".hidden.md", "c.txt", "sub/d.md"):
        (ctx / name).write_text(name)
    mf = tmp_path / "Modelfile"

    def selected(glob: str) -> list[str]:
        mf.write_text(f"DOC {glob}\n")
        return sorted(s.relpath for s in select_files(read_modelfile(str(mf)), str(ctx)))

    assert selected("*.md") == ["!.md", ".hidden.md", "a.md", "b.md"]  # '*' matches a leading dot, as in Go
    assert selected("[^a]*.md") == ["!.md", ".hidden.md", "b.md"]  # Go negates with '^'
    assert selected("[!a].md") == ["!.md", "a.md"]  # '!' is a plain character in Go's classes
    assert selected("*/*.md") == ["sub/d.md"]  # '*' never crosses '/'
    assert selected("?.txt") == ["c.txt"]
    for bad in ("[].md", "[a.md", "[z-a].md"):
        with pytest.raises(ModelfileError, match="bad glob") as err:
            selected(bad)
        assert err.value.line == 1


def _context(root: Path) -> Path:
    """A checkpoint directory with the files getting-started.Modelfile names, and some it does not."""
    root.mkdir()
    torch.manual_seed(1)
    for i in (1, 2):
        save_file(
            {f"layer{i}.weight": torch.randn(8, 8, dtype=torch.bfloat16)},
            str(root / f"model-0000{i}-of-00002.safetensors"),
        )
    (root / "config.json").write_text(
        json.dumps({"model_type": "gemma", "torch_dtype": "bfloat16", "num_attention_heads": 2})
    )
    (root / "generation_config.json").write_text("{}")
    (root / "modeling_gemma.py").write_text("print('hi')\n")
    (root / "README.md").write_text("# gemma\n")
    (root / "tokenizer.json").write_text("{}")  # named by no command: not packed
    (root / "notes.txt").write_text("scratch")
    return root


def _layers(layout: Path, tag: str) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    index = json.loads((layout / "index.json").read_text())
    (desc,) = [m for m in index["manifests"] if m["annotations"]["org.opencontainers.image.ref.name"] == tag]
    manifest = json.loads((layout / "blobs" / "sha256" / desc["digest"][7:]).read_bytes())
    config = json.loads((layout / "blobs" / "sha256" / manifest["config"]["digest"][7:]).read_bytes())
    layers = {layer["annotations"]["org.cncf.model.filepath"]: layer for layer in manifest["layers"]}
    return config, layers


def test_getting_started_modelfile_packs_the_layers_and_config_modctl_writes(tmp_path: Path) -> None:
    ctx = _context(tmp_path / "gemma")
    modelfile = FIXTURES / "getting-started.Modelfile"
    layout = tmp_path / "layout"
    api.pack(str(ctx), f"oci:{layout}:v1", PackOptions(), modelfile=str(modelfile))
    config, layers = _layers(layout, "v1")
    kinds = {
        "config.json": "CONFIG",
        "generation_config.json": "CONFIG",
        "model-00001-of-00002.safetensors": "MODEL",
        "model-00002-of-00002.safetensors": "MODEL",
        "modeling_gemma.py": "CODE",
        "README.md": "DOC",
    }
    assert set(layers) == set(kinds)  # tokenizer.json and notes.txt are named by no command
    for path, command in kinds.items():
        layer = layers[path]
        assert layer["mediaType"] == MODCTL_RAW_LAYER_TYPES[command], path
        assert layer["digest"] == "sha256:" + hashlib.sha256((ctx / path).read_bytes()).hexdigest()
        assert ANNOTATION_FILE_MEDIATYPE_UNTESTED not in layer["annotations"]
    fields = read_modelfile(str(modelfile)).fields
    for command, (section, key) in MODCTL_CONFIG_FIELDS.items():
        assert config[section][key] == fields[command], command
    assert config["descriptor"]["name"] == "gemma-2b" and config["config"]["paramSize"] == "16"
    assert "createdAt" not in config["descriptor"]
    assert config["modelfs"]["diffIds"] == [
        layers[p]["digest"] for p in sorted(layers, key=lambda p: p.split("/"))
    ]
    # reproducible, and the bytes come back
    again = api.pack(str(ctx), f"oci:{layout}:v2", PackOptions(), modelfile=str(modelfile))
    assert again.artifact.digest == api.inspect(f"oci:{layout}:v1").digest
    out = tmp_path / "pulled"
    api.pull(f"oci:{layout}:v1", str(out))
    for path in kinds:
        assert (out / path).read_bytes() == (ctx / path).read_bytes()


def test_quoted_paths_dataset_and_flags_over_modelfile(tmp_path: Path) -> None:
    ctx = tmp_path / "ctx"
    (ctx / "data").mkdir(parents=True)
    (ctx / "config file.json").write_text("{}")
    (ctx / "model weights.bin").write_bytes(b"\x00" * 64)
    (ctx / "inference script.py").write_text("pass\n")
    (ctx / "README file.md").write_text("# x\n")
    (ctx / "data" / "train.jsonl").write_text('{"x": 1}\n')
    (ctx / "data" / "eval.jsonl").write_text('{"x": 2}\n')
    quoted = (FIXTURES / "quoted-paths-with-spaces.Modelfile").read_bytes()
    mf = tmp_path / "Modelfile"
    mf.write_bytes(quoted + b'DATASET data/*.jsonl\nMODEL "config file.json"\n')
    with pytest.raises(ModelfileError, match=r"config file\.json is named by MODEL .* and by CONFIG") as err:
        build_modelfile_artifact(str(ctx), str(mf), PackOptions())
    assert err.value.line == 8
    mf.write_bytes(quoted + b"DATASET data/*.jsonl\n")
    art = build_modelfile_artifact(str(ctx), str(mf), PackOptions(name="from-flag", precision="int8"))
    kinds = {f.relpath: (f.kind, f.untested) for f in art.files}
    assert kinds == {
        "README file.md": ("doc", False),
        "config file.json": ("weight.config", False),
        "data/eval.jsonl": ("dataset", False),
        "data/train.jsonl": ("dataset", False),
        "inference script.py": ("code", False),
        "model weights.bin": ("weight", True),  # a weight in a format nothing validated
    }
    assert art.config.descriptor.name == "from-flag"  # the flag wins over NAME test-model
    assert art.config.config.precision == "int8"
    assert art.config.config.format is None  # no FORMAT, and not every weight is safetensors


@pytest.mark.parametrize(
    "line, message",
    [
        ("MODEL ../outside.safetensors", "'..'"),
        ("MODEL /etc/passwd", "absolute"),
        ("MODEL sub//x.bin", "empty or '.'"),
        ("MODEL ./x.bin", "empty or '.'"),
        ("DOC link-out.md", "symlink leaving the context directory"),
        ("DOC linked-dir/*.md", "symlink leaving the context directory"),
        ("DOC */secret.md", "symlink leaving the context directory"),
        ("DOC sub", "is a directory"),
        ("MODEL missing.safetensors", "no such file"),
        ("DOC *.txt", "not UTF-8"),
        ("DOC dangling/*.md", "dangling symlink"),
    ],
)
def test_globs_never_leave_the_context_directory(tmp_path: Path, line: str, message: str) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.md").write_text("secret")
    ctx = tmp_path / "ctx"
    (ctx / "sub").mkdir(parents=True)
    (ctx / "sub" / "ok.md").write_text("ok")
    (ctx / "link-out.md").symlink_to(outside / "secret.md")
    (ctx / "linked-dir").symlink_to(outside)
    (ctx / "dangling").mkdir()
    (ctx / "dangling" / "gone.md").symlink_to("nowhere.md")
    with open(os.path.join(os.fsencode(ctx), b"\xff.txt"), "wb") as f:
        f.write(b"a name that is not UTF-8")
    mf = tmp_path / "Modelfile"
    mf.write_text(f"NAME x\n{line}\n")
    with pytest.raises(ModelfileError, match=message) as err:
        build_modelfile_artifact(str(ctx), str(mf))
    assert err.value.line == 2


def test_cli_pack_and_push_with_a_modelfile(tmp_path: Path, registry: RegistryServer) -> None:
    ctx = _context(tmp_path / "gemma")
    mf = str(FIXTURES / "getting-started.Modelfile")
    ref = registry.ref("modelfile/gemma", "v1")

    def cli(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "modelpack.cli", *argv], capture_output=True, text=True, timeout=120
        )

    pushed = cli("push", str(ctx), ref, "--modelfile", mf, "--json")
    assert pushed.returncode == 0, pushed.stderr
    packed = cli("pack", str(ctx), f"oci:{tmp_path / 'layout'}:v1", "--modelfile", mf, "--json")
    assert packed.returncode == 0, packed.stderr
    assert json.loads(pushed.stdout)["digest"] == json.loads(packed.stdout)["digest"]
    summary = api.inspect(ref)
    assert summary.config is not None and summary.config["config"]["quantization"] == "awq"
    bad = tmp_path / "Bad.Modelfile"
    bad.write_text("NAME x\n\nMODEL *.safetensors\nCOPY . /models\n")
    proc = cli("pack", str(ctx), f"oci:{tmp_path / 'layout'}:v2", "--modelfile", str(bad))
    assert proc.returncode == 1
    assert f"{bad}:4: unknown command" in proc.stderr and "Traceback" not in proc.stderr
    assert not os.path.exists(tmp_path / "layout" / "v2")
