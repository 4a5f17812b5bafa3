"""Packing a checkpoint into an OCI layout: the artifact docs/artifact.md describes, reproducibly."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import jsonschema
import pytest
import torch
from modelpack.mediatypes import (
    ANNOTATION_FILE_METADATA,
    ANNOTATION_FILEPATH,
    ANNOTATION_TITLE,
    ARTIFACT_TYPE_MODEL,
    MEDIA_TYPE_CONFIG,
    MEDIA_TYPE_OCI_MANIFEST,
)
from safetensors.torch import load_file

from modelpack import api
from modelpack.errors import DigestMismatchError, PackError, SafetensorsError
from modelpack.oci.descriptor import Descriptor, Manifest
from modelpack.oci.digest import Digest
from modelpack.packing.packer import PackOptions, build_artifact, classify
from modelpack.targets.base import bytes_blob_source
from modelpack.targets.layout import OCILayoutTarget
from tests.paths import REPO_ROOT


def _sha(path: Path) -> str:
    return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()


def _layout_manifest(layout: Path, tag: str) -> Manifest:
    raw, mt = OCILayoutTarget(layout).fetch_manifest(tag)
    return Manifest.parse(raw, media_type=mt)


def test_pack_then_inspect_round_trip(checkpoint: Path, tmp_path: Path) -> None:
    layout = tmp_path / "layout"
    result = api.pack(str(checkpoint), f"oci:{layout}:v1", PackOptions(version="1.0"))
    summary = api.inspect(f"oci:{layout}:v1")
    assert summary.digest == result.artifact.digest
    files = sorted(p for p in checkpoint.iterdir())
    assert [layer.path for layer in summary.layers] == [p.name for p in files]
    for layer, path in zip(summary.layers, files, strict=True):
        assert layer.digest == _sha(path)
        assert layer.size == path.stat().st_size
        # the blob in the layout is byte-identical to the file
        assert (layout / "blobs" / "sha256" / layer.digest[7:]).read_bytes() == path.read_bytes()
    assert summary.total_size == sum(p.stat().st_size for p in files) + summary.manifest.config.size
    assert summary.config is not None
    assert summary.config["descriptor"]["version"] == "1.0"


def test_media_types_and_annotations_follow_the_spec(checkpoint: Path, tmp_path: Path) -> None:
    (checkpoint / "modeling_x.py").write_text("print('hi')\n")
    (checkpoint / "notes.bin2").write_bytes(b"x")
    api.pack(str(checkpoint), f"oci:{tmp_path / 'l'}:v1")
    m = _layout_manifest(tmp_path / "l", "v1")
    doc = json.loads(m.raw)
    assert doc["mediaType"] == MEDIA_TYPE_OCI_MANIFEST
    assert doc["artifactType"] == ARTIFACT_TYPE_MODEL
    assert doc["config"]["mediaType"] == MEDIA_TYPE_CONFIG
    kinds = {}
    for layer in m.layers:
        ann = layer.annotations or {}
        path = ann[ANNOTATION_FILEPATH]
        assert ann[ANNOTATION_TITLE] == path
        meta = json.loads(ann[ANNOTATION_FILE_METADATA])
        assert meta["name"] == path and meta["size"] == layer.size and meta["mtime"] == "1970-01-01T00:00:00Z"
        kinds[path] = layer.media_type
    assert kinds["model-00001-of-00002.safetensors"] == "application/vnd.cncf.model.weight.v1.raw"
    assert kinds["config.json"] == "application/vnd.cncf.model.weight.config.v1.raw"
    assert kinds["model.safetensors.index.json"] == "application/vnd.cncf.model.weight.config.v1.raw"
    assert kinds["README.md"] == "application/vnd.cncf.model.doc.v1.raw"
    assert kinds["modeling_x.py"] == "application/vnd.cncf.model.code.v1.raw"
    assert kinds["notes.bin2"] == "application/vnd.cncf.model.doc.v1.raw"
    untested = [
        layer for layer in m.layers if (layer.annotations or {}).get("org.cncf.model.file.mediatype.untested")
    ]
    assert [(layer.annotations or {})[ANNOTATION_FILEPATH] for layer in untested] == ["notes.bin2"]


def test_config_is_inferred_and_validates_against_the_schema(checkpoint: Path, tmp_path: Path) -> None:
    api.pack(str(checkpoint), f"oci:{tmp_path / 'l'}:v1", PackOptions(quantization="none", family="llama3"))
    target = OCILayoutTarget(tmp_path / "l")
    manifest, _ = api.fetch_manifest(target, "v1")
    doc = json.loads(api.fetch_config(target, manifest))
    schema = json.loads((REPO_ROOT / "mediatypes" / "config-schema.json").read_text())
    jsonschema.validate(doc, schema)
    cfg = doc["config"]
    assert cfg["architecture"] == "transformer"  # the spec's kind; the class is an annotation
    assert manifest.annotations["dev.modelpack.hf.architecture"] == "LlamaForCausalLM"
    assert cfg["precision"] == "bfloat16"
    assert cfg["format"] == "safetensors"
    assert cfg["quantization"] == "none"
    assert doc["descriptor"]["family"] == "llama3"  # the flag overrides config.json's model_type
    tensors = {
        **load_file(str(checkpoint / "model-00001-of-00002.safetensors")),
        **load_file(str(checkpoint / "model-00002-of-00002.safetensors")),
    }
    params = sum(t.numel() for t in tensors.values())
    assert cfg["paramSize"] == f"{params / 1e6:.1f}".rstrip("0").rstrip(".") + "M"
    assert "transformerConfig" not in cfg  # not in the released spec: an annotation instead
    assert json.loads(manifest.annotations["dev.modelpack.model.transformer+json"]) == {
        "attentionType": "gqa",
        "mlpType": "dense",
        "numLayers": 2,
        "numAttentionHeads": 8,
        "numKVHeads": 4,
        "hiddenSize": 256,
        "intermediateSize": 688,
    }
    assert doc["modelfs"]["diffIds"] == [str(layer.digest) for layer in manifest.layers]


def test_reproducible_digest_across_copies_and_mtimes(checkpoint: Path, tmp_path: Path) -> None:
    a = api.pack(str(checkpoint), f"oci:{tmp_path / 'a'}:v1").artifact.digest
    other = tmp_path / "elsewhere" / checkpoint.name
    shutil.copytree(checkpoint, other)
    for p in other.iterdir():
        os.utime(p, (1_000_000, 1_000_000))
        p.chmod(p.stat().st_mode & 0o777)  # the same mode, however it was copied
    b = api.pack(str(other), f"oci:{tmp_path / 'b'}:v1").artifact.digest
    assert a == b
    c = api.pack(
        str(other), f"oci:{tmp_path / 'c'}:v1", PackOptions(created="2026-11-29T00:00:00Z")
    ).artifact.digest
    assert c != a  # a timestamp only when asked, and then it changes the digest


def test_reshard_preserves_every_tensor_bit_for_bit(tmp_path: Path) -> None:
    from modelpack.testdata.synthetic import SyntheticSpec, write_checkpoint

    ckpt = tmp_path / "big"
    write_checkpoint(str(ckpt), SyntheticSpec(hidden=512, intermediate=1376, layers=2, vocab=2048))
    original = load_file(str(ckpt / "model.safetensors"))
    assert (ckpt / "model.safetensors").stat().st_size > 4 * 1024 * 1024
    layout = tmp_path / "l"
    api.pack(str(ckpt), f"oci:{layout}:v1", PackOptions(max_file_size=2 * 1024 * 1024))
    m = _layout_manifest(layout, "v1")
    out = tmp_path / "out"
    out.mkdir()
    for layer in m.layers:
        path = (layer.annotations or {})[ANNOTATION_FILEPATH]
        shutil.copyfile(layout / "blobs" / "sha256" / layer.digest.hex, out / path)
    shards = sorted(out.glob("*.safetensors"))
    assert len(shards) > 2 and not (out / "model.safetensors").exists()
    for s in shards:  # under the limit, unless one tensor alone is larger (tensors are never split)
        assert s.stat().st_size <= 2 * 1024 * 1024 or len(load_file(str(s))) == 1
    loaded: dict[str, torch.Tensor] = {}
    for s in shards:
        part = load_file(str(s))
        assert not set(part) & set(loaded)
        loaded.update(part)
    assert set(loaded) == set(original)
    for name, t in original.items():
        assert loaded[name].dtype == t.dtype and torch.equal(
            loaded[name].view(torch.int16), t.view(torch.int16)
        )
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(original)
    for name, fname in index["weight_map"].items():
        assert name in load_file(str(out / fname))
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in original.values())
    assert not list(layout.glob(".modelpack-reshard-*")), "staging shards are removed after packing"


def test_symlink_escaping_the_checkpoint_is_refused(checkpoint: Path, tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("s3cr3t")
    (checkpoint / "leak.txt").symlink_to(secret)
    with pytest.raises(PackError, match="symlink leaves the checkpoint"):
        build_artifact(str(checkpoint))


def test_symlink_inside_the_checkpoint_is_packed_as_its_target(checkpoint: Path, tmp_path: Path) -> None:
    (checkpoint / "LICENSE").write_text("MIT\n")
    (checkpoint / "LICENSE.txt").symlink_to(checkpoint / "LICENSE")
    art = build_artifact(str(checkpoint))
    by = {f.relpath: f for f in art.files}
    assert by["LICENSE.txt"].digest == by["LICENSE"].digest


def test_special_files_and_empty_checkpoints_are_refused(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(PackError, match="no files to pack"):
        build_artifact(str(empty))
    fifo_dir = tmp_path / "fifo"
    fifo_dir.mkdir()
    (fifo_dir / "config.json").write_text("{}")
    os.mkfifo(fifo_dir / "pipe")
    with pytest.raises(PackError, match="not a regular file"):
        build_artifact(str(fifo_dir))


def test_a_bad_safetensors_file_is_refused_naming_file_and_tensor(checkpoint: Path) -> None:
    shard = checkpoint / "model-00002-of-00002.safetensors"
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 10)
    with pytest.raises(SafetensorsError) as info:
        build_artifact(str(checkpoint))
    assert str(shard) in str(info.value)


def test_include_exclude_and_refuse_other_files(checkpoint: Path) -> None:
    art = build_artifact(str(checkpoint), PackOptions(include=["*.safetensors", "config.json"]))
    assert sorted(f.relpath for f in art.files) == [
        "config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    art = build_artifact(str(checkpoint), PackOptions(exclude=["README.md"]))
    assert "README.md" not in {f.relpath for f in art.files}
    (checkpoint / "data.csv").write_text("a,b\n")
    with pytest.raises(PackError, match=r"data\.csv"):
        build_artifact(str(checkpoint), PackOptions(other_files="refuse"))
    assert classify("sub/tokenizer.json") == ("weight.config", False)
    assert classify("pytorch_model.bin") == ("weight", True)


def test_cnai_legacy_artifacts_are_read(tmp_path: Path) -> None:
    target = OCILayoutTarget(tmp_path / "legacy", create=True)
    data = b"weights"
    layer = Descriptor(
        "application/vnd.cnai.model.weight.v1.raw",
        Digest.from_bytes(data),
        len(data),
        annotations={"org.cnai.model.filepath": "w.safetensors"},
    )
    cfg = json.dumps(
        {
            "descriptor": {"name": "old"},
            "config": {},
            "modelfs": {"type": "layers", "diffIds": [str(layer.digest)]},
        }
    ).encode()
    cfg_desc = Descriptor("application/vnd.cnai.model.config.v1+json", Digest.from_bytes(cfg), len(cfg))
    target.push_blob(bytes_blob_source(layer, data))
    target.push_blob(bytes_blob_source(cfg_desc, cfg))
    m = Manifest.build(cfg_desc, [layer], artifact_type="application/vnd.cnai.model.manifest.v1+json")
    target.push_manifest(m.raw, m.media_type, "old")
    summary = api.inspect(f"oci:{tmp_path / 'legacy'}:old")
    assert summary.config is not None and summary.config["descriptor"]["name"] == "old"
    assert [(x.path, x.kind) for x in summary.layers] == [("w.safetensors", "weight")]


def test_layout_refuses_a_blob_that_does_not_match_and_leaves_nothing(tmp_path: Path) -> None:
    target = OCILayoutTarget(tmp_path / "l", create=True)
    desc = Descriptor("application/octet-stream", Digest.from_bytes(b"good"), 4)
    with pytest.raises(DigestMismatchError):
        target.push_blob(bytes_blob_source(desc, b"evil"))
    assert list((tmp_path / "l" / "blobs" / "sha256").iterdir()) == []
    assert not target.exists(desc)


def test_layout_on_the_same_filesystem_links_instead_of_copying(checkpoint: Path, tmp_path: Path) -> None:
    from modelpack.transfer.copy import copy

    layout = tmp_path / "l"
    art = build_artifact(str(checkpoint))
    target = OCILayoutTarget(layout, create=True)
    result = copy(art, target, "latest", "v1")
    assert result.blobs_copied == len(art.files) + 1
    assert set(target.materialized) <= {"reflink", "hardlink"} and sum(target.materialized.values()) == len(
        art.files
    )
    shard = checkpoint / "model-00001-of-00002.safetensors"
    blob = layout / "blobs" / "sha256" / _sha(shard)[7:]
    if "hardlink" in target.materialized:
        assert blob.stat().st_ino == shard.stat().st_ino
    # reflink mode never shares the inode with the checkpoint (safe against in-place edits)
    safe = OCILayoutTarget(tmp_path / "safe", create=True, link="reflink")
    copy(art, safe, "latest", "v1")
    assert os.stat(safe.blob_path(_sha(shard))).st_ino != shard.stat().st_ino
    again = api.pack(str(checkpoint), f"oci:{layout}:v2")
    assert again.copy.blobs_copied == 0 and again.copy.blobs_skipped == len(art.files) + 1


def test_skopeo_reads_our_layout_byte_for_byte(checkpoint: Path, tmp_path: Path) -> None:
    layout = tmp_path / "l"
    result = api.pack(str(checkpoint), f"oci:{layout}:v1")
    raw = subprocess.run(
        ["skopeo", "inspect", "--raw", f"oci:{layout}:v1"], check=True, capture_output=True
    ).stdout
    assert raw == result.artifact.manifest.raw
    copy_dir = tmp_path / "skopeo-copy"
    subprocess.run(
        ["skopeo", "copy", "--quiet", "--preserve-digests", f"oci:{layout}:v1", f"oci:{copy_dir}:v1"],
        check=True,
        capture_output=True,
    )
    assert api.inspect(f"oci:{copy_dir}:v1").digest == result.artifact.digest


def test_cli_pack_inspect_ls_json(checkpoint: Path, tmp_path: Path) -> None:
    exe = Path(sys.executable).with_name("modelpack")
    layout = tmp_path / "l"
    out = subprocess.run(
        [str(exe), "pack", str(checkpoint), f"oci:{layout}:v1", "--json", "--name", "tiny"],
        check=True,
        capture_output=True,
        text=True,
    )
    packed = json.loads(out.stdout)
    assert packed["config"]["descriptor"]["name"] == "tiny"
    out = subprocess.run(
        [str(exe), "inspect", f"oci:{layout}:v1", "--json"], check=True, capture_output=True, text=True
    )
    assert json.loads(out.stdout)["digest"] == packed["digest"]
    out = subprocess.run(
        [str(exe), "ls", f"oci:{layout}", "--json"], check=True, capture_output=True, text=True
    )
    assert json.loads(out.stdout) == [
        {
            "tag": "v1",
            "digest": packed["digest"],
            "mediaType": MEDIA_TYPE_OCI_MANIFEST,
            "artifactType": ARTIFACT_TYPE_MODEL,
        }
    ]
    bad = subprocess.run([str(exe), "inspect", f"oci:{layout}:nope"], capture_output=True, text=True)
    assert bad.returncode == 1 and "nope" in bad.stderr and "Traceback" not in bad.stderr


def _rewrite_in_place(path: Path, data: bytes) -> None:
    """Overwrite ``path`` in place (same inode) until its mtime shows it (coarse kernel clocks)."""
    before = path.stat().st_mtime_ns
    while True:
        with open(path, "r+b") as f:
            f.write(data)
        if path.stat().st_mtime_ns != before:
            return
        time.sleep(0.005)


@pytest.mark.parametrize("link", ["auto", "copy"])
@pytest.mark.parametrize("change", ["replaced", "rewritten", "appended", "chmod"])
def test_a_file_that_changes_after_it_was_hashed_is_refused(
    checkpoint: Path, tmp_path: Path, link: str, change: str
) -> None:
    """Hash first, link or copy later: a file rewritten in place, grown or chmod-ed in between must
    not be stored under what was recorded for it; a file replaced by a new one of the same size (how
    editors and ``save_file`` write) leaves the pack storing the bytes it hashed (the file it opened),
    never the new ones."""
    from modelpack.transfer.copy import copy

    shard = checkpoint / "model-00002-of-00002.safetensors"
    art = build_artifact(str(checkpoint))
    packed = next(f for f in art.files if f.relpath == shard.name)
    original = shard.read_bytes()
    evil = original[:-4] + bytes(b ^ 0xFF for b in original[-4:])  # same size, last tensor bytes differ
    if change == "replaced":
        (checkpoint / "new").write_bytes(evil)
        os.replace(checkpoint / "new", shard)
    elif change == "rewritten":
        _rewrite_in_place(shard, evil)
    elif change == "appended":
        with open(shard, "ab") as f:
            f.write(b"\0")
    else:  # the same bytes, but the mode recorded in the file metadata is no longer the file's
        os.chmod(shard, 0o600)
    target = OCILayoutTarget(tmp_path / "l", create=True, link=link)
    if change == "replaced":
        copy(art, target, "latest", "v1")
        assert Path(target.blob_path(packed.digest)).read_bytes() == original != evil
    else:
        with pytest.raises(
            PackError, match=r"model-00002-of-00002\.safetensors.*changed after it was hashed"
        ):
            copy(art, target, "latest", "v1")
        assert not target.exists(Descriptor("application/octet-stream", packed.digest, packed.size))
    if change in ("replaced", "rewritten"):
        # packing again hashes what is there now
        again = build_artifact(str(checkpoint))
        assert next(f for f in again.files if f.relpath == shard.name).digest == _sha(shard) != packed.digest


@pytest.mark.parametrize("link", ["copy", "reflink"])
def test_a_file_rewritten_while_it_is_copied_into_the_layout_is_refused(
    checkpoint: Path, tmp_path: Path, link: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check before the copy leaves the copy itself: a writer that rewrites the file while it
    is being copied would leave other bytes in the layout under the recorded digest. The file is
    checked again once the copy is there, before it is renamed into place."""
    import modelpack.targets.layout as layout
    from modelpack.transfer.copy import copy

    shard = checkpoint / "model-00002-of-00002.safetensors"
    art = build_artifact(str(checkpoint))
    packed = next(f for f in art.files if f.relpath == shard.name)
    real = layout.link_or_copy_fd

    def copy_then_rewritten(fd: int, dst: str, *, mode: str = "auto") -> str:
        how = real(fd, dst, mode=mode)
        if os.path.sameopenfile(fd, os.open(shard, os.O_RDONLY)):
            data = shard.read_bytes()
            _rewrite_in_place(shard, data[:-4] + bytes(b ^ 0xFF for b in data[-4:]))
        return how

    monkeypatch.setattr(layout, "link_or_copy_fd", copy_then_rewritten)
    target = OCILayoutTarget(tmp_path / "l", create=True, link=link)
    with pytest.raises(PackError, match=r"model-00002-of-00002\.safetensors.*changed after it was hashed"):
        copy(art, target, "latest", "v1")
    assert not target.exists(Descriptor("application/octet-stream", packed.digest, packed.size))
    assert not [p for p in (tmp_path / "l" / "blobs" / "sha256").iterdir() if p.name.startswith(".tmp")]


def test_an_unchanged_file_touched_by_nobody_packs_after_a_delay(checkpoint: Path, tmp_path: Path) -> None:
    from modelpack.transfer.copy import copy

    art = build_artifact(str(checkpoint))
    os.utime(checkpoint)  # the directory changing is not a file changing
    (checkpoint / "unrelated.txt").write_text("later")  # nor is a new file nobody packed
    result = copy(art, OCILayoutTarget(tmp_path / "l", create=True), "latest", "v1")
    assert result.blobs_copied == len(art.files) + 1


def test_a_file_whose_bytes_do_not_match_its_size_while_hashed_is_refused() -> None:
    """The bytes read must be the size stat gave before the first read (a file growing or shrinking
    under the hasher); /proc files are the real files that always report 0 bytes and yield more."""
    from modelpack.packing.packer import hash_file

    with pytest.raises(
        PackError, match=r"/proc/self/status: changed while it was hashed \(read \d+ bytes of a 0-byte"
    ):
        hash_file("/proc/self/status")


def test_a_shard_swapped_after_its_header_was_checked_packs_the_checked_bytes(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writer that swaps a validated shard for garbage between the header check and hashing (the
    timing is forced by wrapping the real parser) must not get unvalidated bytes packed: the pack
    hashes the file it checked (its open descriptor), never the garbage now at the name."""
    from typing import BinaryIO

    from modelpack.packing import packer, safetensors_format

    shard = checkpoint / "model-00001-of-00002.safetensors"
    checked = _sha(shard)

    def read_then_swap(f: BinaryIO, path: str, size: int) -> safetensors_format.SafetensorsHeader:
        header = safetensors_format.read_header_from(f, path, size)
        if path.endswith(shard.name):
            garbage = checkpoint / "garbage"
            garbage.write_bytes(b"\xff" * shard.stat().st_size)  # not safetensors at all
            os.replace(garbage, shard)
        return header

    monkeypatch.setattr(packer, "read_header_from", read_then_swap)
    art = build_artifact(str(checkpoint))
    packed = next(f for f in art.files if f.relpath == shard.name)
    assert packed.digest == checked != _sha(shard)


def test_an_image_layer_is_not_built_from_a_file_changed_after_hashing(
    checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--format image tars the files after hashing them; a file rewritten in between is refused."""
    from modelpack.packing import image_format

    (tmp_path / "staging").mkdir()
    real = image_format.build_artifact

    def build_then_rewrite(*args: object, **kw: object) -> object:
        art = real(*args, **kw)  # type: ignore[arg-type]
        readme = checkpoint / "README.md"
        _rewrite_in_place(readme, readme.read_bytes()[::-1])
        return art

    monkeypatch.setattr(image_format, "build_artifact", build_then_rewrite)
    with pytest.raises(PackError, match=r"README\.md: changed after it was hashed"):
        image_format.build_image_artifact(str(checkpoint), staging_parent=str(tmp_path / "staging"))
    assert list((tmp_path / "staging").iterdir()) == []  # the staged tars are gone too


def test_a_file_name_that_is_not_utf8_is_refused_naming_it(tmp_path: Path, checkpoint: Path) -> None:
    """A name that is not UTF-8 cannot be an annotation value; it used to escape as a
    UnicodeEncodeError traceback from the JSON encoder. Excluding it packs the rest."""
    from click.testing import CliRunner

    from modelpack.cli import main

    ckpt = tmp_path / "named"
    shutil.copytree(checkpoint, ckpt)
    with open(os.path.join(os.fsencode(ckpt), b"notes-\xff.txt"), "wb") as f:
        f.write(b"x")
    res = CliRunner().invoke(main, ["pack", str(ckpt), f"oci:{tmp_path / 'out'}:v1"])
    assert res.exit_code == 1 and "not UTF-8" in res.output and "notes-\\xff.txt" in res.output, res.output
    assert "Traceback" not in res.output
    ok = CliRunner().invoke(main, ["pack", str(ckpt), f"oci:{tmp_path / 'out'}:v1", "--exclude", "notes-*"])
    assert ok.exit_code == 0, ok.output
