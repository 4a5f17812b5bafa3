"""Artifacts other model tools write today, pulled and loaded by modelpack.

modctl (``vnd.cnai`` media types, one Go ``archive/tar`` layer per file or raw layers with
``--raw``, the ``org.cncf.model.filepath`` and file metadata annotations, its config fields and
Modelfile annotation) and KitOps ModelKits (``application/vnd.kitops.modelkit.*``), generated as
OCI layouts from the tools' documented formats by ``tests/foreign_layouts.py``. Each is pulled
into a directory, into the node cache, and loaded from the snapshot; the files and their bytes
must be the context directory's.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from modelpack.cli import main
from tests.foreign_layouts import (
    Layout,
    files_of,
    go_tar_of_file,
    modes_of,
    write_kitops_layout,
    write_modctl_layout,
)


def _run(*args: str) -> Any:
    return CliRunner().invoke(main, list(args))


def _ok(*args: str) -> str:
    res = _run(*args)
    assert res.exit_code == 0, res.output
    return str(res.stdout)


@pytest.fixture
def context(checkpoint: Path) -> Path:
    """The synthetic checkpoint plus what a model repository also holds: code (executable) and a
    file in a subdirectory."""
    (checkpoint / "run.py").write_text("print('hello')\n")
    os.chmod(checkpoint / "run.py", 0o755)
    (checkpoint / "tokenizer").mkdir()
    (checkpoint / "tokenizer" / "vocab.json").write_text('{"a": 1}\n')
    return checkpoint


@pytest.mark.parametrize("raw", [False, True], ids=["tar-layers", "raw-layers"])
def test_a_modctl_artifact_is_pulled_cached_and_loaded(context: Path, tmp_path: Path, raw: bool) -> None:
    layout = tmp_path / "modctl"
    digest = write_modctl_layout(context, layout, raw=raw)
    ref = f"oci:{layout}@{digest}"
    inspected = json.loads(_ok("inspect", ref, "--json"))
    assert inspected["config"]["descriptor"]["name"] == "tiny-llama"
    assert inspected["config"]["config"]["capabilities"] == {"reasoning": True}
    kinds = {layer["path"]: layer["kind"] for layer in inspected["layers"]}
    assert kinds["run.py"] == "code" and kinds["README.md"] == "doc"
    assert kinds["tokenizer/vocab.json"] == "weight.config"
    # a directory: the files at their paths, byte for byte, the script still executable
    out = tmp_path / "out"
    _ok("pull", ref, str(out))
    assert files_of(out) == files_of(context)
    if raw:  # the recorded mode (a tar member's mode is not restored yet: files come out 0644)
        assert modes_of(out)["run.py"] & 0o100
    # the node cache, then the loader on its snapshot
    cached = json.loads(_ok("pull", ref, "--cache", str(tmp_path / "cache"), "--json"))
    snapshot = Path(cached["path"])
    assert files_of(snapshot) == files_of(context)
    loaded = json.loads(_ok("load", str(snapshot), "--expected-digest", digest, "--json"))
    assert loaded["tensors"] > 0
    # the same files packed by modelpack load to the same tensors
    ours = tmp_path / "ours"
    _ok("pack", str(context), f"oci:{ours}:v1")
    mine = json.loads(_ok("pull", f"oci:{ours}:v1", "--cache", str(tmp_path / "cache2"), "--json"))
    again = json.loads(_ok("load", mine["path"], "--expected-digest", mine["digest"], "--json"))
    assert again["tensors"] == loaded["tensors"]


def test_a_modctl_tar_layer_that_writes_another_layers_file_is_refused(context: Path, tmp_path: Path) -> None:
    """A tar layer's members are files at their paths: one that would write a file another layer
    already wrote (here the README layer carrying a different ``config.json``) is refused before
    either is published, whatever its annotation says."""
    layout = tmp_path / "modctl"
    digest = write_modctl_layout(context, layout)
    doc = json.loads((layout / "blobs" / "sha256" / digest[7:]).read_bytes())
    impostor = tmp_path / "impostor.json"
    impostor.write_text('{"model_type": "evil"}')
    lay = Layout(layout)
    blob = go_tar_of_file(impostor, "config.json")
    readme = next(x for x in doc["layers"] if x["annotations"]["org.cncf.model.filepath"] == "README.md")
    readme.update(digest=lay.blob(blob), size=len(blob))
    evil = lay.tag(json.dumps(doc).encode(), "evil")
    res = _run("pull", f"oci:{layout}@{evil}", str(tmp_path / "out"))
    assert res.exit_code == 1 and "config.json" in res.output, res.output
    assert not (tmp_path / "out" / "config.json").exists()


def test_a_kitops_modelkit_is_pulled_cached_and_loaded(context: Path, tmp_path: Path) -> None:
    layout = tmp_path / "kit"
    files = sorted(p.name for p in context.iterdir() if p.is_file())
    entries = {
        "model": [f for f in files if f.endswith(".safetensors") or f.endswith(".json")] + ["tokenizer"],
        "code": ["run.py"],
        "docs": ["README.md"],
    }
    entries["model"] = sorted(entries["model"])
    digest = write_kitops_layout(context, layout, entries)
    ref = f"oci:{layout}@{digest}"
    out = tmp_path / "out"
    _ok("pull", ref, str(out))
    assert files_of(out) == files_of(context)
    cached = json.loads(_ok("pull", ref, "--cache", str(tmp_path / "cache"), "--json"))
    assert files_of(Path(cached["path"])) == files_of(context)
    loaded = json.loads(_ok("load", cached["path"], "--expected-digest", digest, "--json"))
    assert loaded["tensors"] > 0


def _kit(context: Path, layout: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """A ModelKit of ``context`` at ``layout``: its manifest and Kitfile, to be altered."""
    digest = write_kitops_layout(
        context, layout, {"model": ["model-00001-of-00002.safetensors", "config.json"], "docs": ["README.md"]}
    )
    manifest = json.loads((layout / "blobs" / "sha256" / digest[7:]).read_bytes())
    kitfile = json.loads((layout / "blobs" / "sha256" / manifest["config"]["digest"][7:]).read_bytes())
    return manifest, kitfile


def _retag(layout: Path, manifest: dict[str, Any], kitfile: dict[str, Any]) -> str:
    lay = Layout(layout)
    config = json.dumps(kitfile).encode()
    manifest["config"].update(digest=lay.blob(config), size=len(config))
    return f"oci:{layout}@{lay.tag(json.dumps(manifest).encode(), 'altered')}"


def test_a_modelkit_layer_whose_uncompressed_tar_is_not_the_kitfiles_diff_id_is_refused(
    context: Path, tmp_path: Path
) -> None:
    """The Kitfile's diffId vouches for each gzip layer's stream: a mismatch is refused, in a
    directory and in the node cache, and no file of that layer is published."""
    manifest, kitfile = _kit(context, tmp_path / "kit")
    kitfile["docs"][0]["diffId"] = "sha256:" + "0" * 64
    ref = _retag(tmp_path / "kit", manifest, kitfile)
    res = _run("pull", ref, str(tmp_path / "out"))
    assert res.exit_code == 1 and "0000000000" in res.output, res.output
    assert not (tmp_path / "out" / "README.md").exists()
    cached = _run("pull", ref, "--cache", str(tmp_path / "cache"))
    assert cached.exit_code == 1, cached.output
    assert not list((tmp_path / "cache").rglob("README.md"))


def test_a_modelkit_layer_the_kitfile_does_not_record_is_refused(context: Path, tmp_path: Path) -> None:
    """A layer without a Kitfile entry (digest and diffId) cannot be verified: refused, named."""
    manifest, kitfile = _kit(context, tmp_path / "kit")
    del kitfile["docs"][0]["diffId"], kitfile["docs"][0]["digest"]
    res = _run("pull", _retag(tmp_path / "kit", manifest, kitfile), str(tmp_path / "out"))
    assert res.exit_code == 1 and manifest["layers"][-1]["digest"] in res.output, res.output
    assert not (tmp_path / "out" / "README.md").exists()


@pytest.mark.parametrize(
    "media_type",
    [
        "application/vnd.kitops.modelkit.prompts.v1.tar+gzip",
        "application/vnd.kitops.modelkit.docs.v1.tar+lz4",
    ],
)
def test_a_modelkit_layer_type_without_a_reader_is_refused(
    context: Path, tmp_path: Path, media_type: str
) -> None:
    manifest, kitfile = _kit(context, tmp_path / "kit")
    manifest["layers"][-1]["mediaType"] = media_type
    res = _run("pull", _retag(tmp_path / "kit", manifest, kitfile), str(tmp_path / "out"))
    assert res.exit_code == 1 and media_type in res.output, res.output
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())


def test_a_kitops_layer_outside_a_modelkit_is_refused(context: Path, tmp_path: Path) -> None:
    """Without a Kitfile config nothing vouches for a ModelKit layer's stream."""
    manifest, kitfile = _kit(context, tmp_path / "kit")
    manifest["config"]["mediaType"] = "application/vnd.oci.empty.v1+json"
    res = _run("pull", _retag(tmp_path / "kit", manifest, kitfile), str(tmp_path / "out"))
    assert res.exit_code == 1 and "Kitfile" in res.output, res.output
