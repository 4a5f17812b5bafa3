"""The image-shaped variant: structure, determinism, skopeo interop, our pulls, tar safety."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import tarfile
from pathlib import Path

import pytest
import zstandard
from click.testing import CliRunner
from modelpack.mediatypes import (
    MEDIA_TYPE_IMAGE_CONFIG,
    MEDIA_TYPE_IMAGE_LAYER_TAR,
    MEDIA_TYPE_IMAGE_LAYER_TAR_ZSTD,
)
from modelpack.mount import NodeCache

from modelpack import api
from modelpack.api import transfer
from modelpack.cli import main
from modelpack.errors import DigestMismatchError, UnsafeTarError
from modelpack.oci.descriptor import Manifest
from modelpack.packing.image_format import build_image_artifact
from modelpack.packing.packer import PackOptions
from modelpack.targets.layout import OCILayoutTarget
from modelpack.targets.opener import TargetOptions
from modelpack.transfer.untar import extract_tar_layer


def _uncompressed(blob: bytes, media_type: str) -> bytes:
    if media_type == MEDIA_TYPE_IMAGE_LAYER_TAR_ZSTD:
        return zstandard.ZstdDecompressor().stream_reader(io.BytesIO(blob), read_across_frames=True).read()
    return blob


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_structure_diff_ids_and_files_under_models(
    checkpoint: Path, tmp_path: Path, compression: str | None
) -> None:
    ref = f"oci:{tmp_path / 'layout'}:img"
    res = api.pack(str(checkpoint), ref, format="image", compression=compression)
    target = OCILayoutTarget(str(tmp_path / "layout"))
    manifest, _ = api.fetch_manifest(target, "img")
    doc = json.loads(manifest.raw)
    assert "artifactType" not in doc and manifest.artifact_type is None
    assert manifest.config.media_type == MEDIA_TYPE_IMAGE_CONFIG
    config = json.loads(api.fetch_config(target, manifest))
    assert config["os"] == "linux" and config["architecture"] == "amd64"
    assert config["rootfs"]["type"] == "layers"
    want = MEDIA_TYPE_IMAGE_LAYER_TAR_ZSTD if compression else MEDIA_TYPE_IMAGE_LAYER_TAR
    assert [layer.media_type for layer in manifest.layers] == [want] * len(manifest.layers)
    files: dict[str, bytes] = {}
    diff_ids = []
    for layer in manifest.layers:
        blob = Path(target.blob_path(layer.digest)).read_bytes()
        tar_bytes = _uncompressed(blob, layer.media_type)
        if not compression:
            assert blob == tar_bytes
        diff_ids.append("sha256:" + hashlib.sha256(tar_bytes).hexdigest())
        with tarfile.open(fileobj=io.BytesIO(tar_bytes)) as tar:
            names = tar.getnames()
            assert names == sorted(names, key=lambda n: n.rstrip("/").split("/"))
            for m in tar.getmembers():
                assert m.name == "models" or m.name.startswith("models/")
                assert (m.mtime, m.uid, m.gid, m.uname, m.gname) == (0, 0, 0, "", "")
                assert m.isdir() or m.isreg()
                if m.isreg():
                    assert m.mode == 0o644
                    f = tar.extractfile(m)
                    assert f is not None
                    files[m.name[len("models/") :]] = f.read()
    assert config["rootfs"]["diff_ids"] == diff_ids
    assert files == {p.name: p.read_bytes() for p in checkpoint.iterdir()}
    assert res.artifact.manifest.digest == manifest.digest
    # reproducible: the same directory gives the same manifest digest
    again = api.pack(
        str(checkpoint), f"oci:{tmp_path / 'layout2'}:img", format="image", compression=compression
    )
    assert again.artifact.manifest.digest == manifest.digest


def test_many_weight_files_are_grouped_under_the_layer_cap(tmp_path: Path) -> None:
    from modelpack.packing.safetensors_format import build_header

    ck = tmp_path / "many"
    ck.mkdir()
    for i in range(12):
        prefix, _ = build_header([("w", "F32", (4,), 16)], None)
        (ck / f"model-{i:05d}.safetensors").write_bytes(prefix + bytes(16))
    (ck / "config.json").write_text("{}")
    art = build_image_artifact(str(ck), PackOptions(), None, max_layers=5)
    try:
        assert len(art.manifest.layers) == 5
        assert len(art.model_files) == 13
    finally:
        art.cleanup()
    assert not os.path.exists(art.files[0].path)  # temp tars removed


def test_skopeo_copies_it_and_our_pulls_materialise_it(registry, checkpoint: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    api.pack(str(checkpoint), f"oci:{tmp_path / 'layout'}:img", format="image", compression="zstd")
    digest = OCILayoutTarget(str(tmp_path / "layout")).resolve("img").digest
    for dest in (f"oci:{tmp_path / 'copy'}:img", f"docker://{registry.ref('image/model', 'img')}"):
        out = subprocess.run(
            ["skopeo", "copy", "--dest-tls-verify=false", f"oci:{tmp_path / 'layout'}:img", dest],
            capture_output=True,
            text=True,
            check=False,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
    assert OCILayoutTarget(str(tmp_path / "copy")).resolve("img").digest == digest
    ref = registry.ref("image/model", "img")
    opts = TargetOptions(plain_http=True)
    pulled = transfer.pull(ref, str(tmp_path / "files"), target_options=opts)
    assert pulled.digest == digest
    for p in checkpoint.iterdir():
        assert (tmp_path / "files" / p.name).read_bytes() == p.read_bytes()
    assert not [n for n in os.listdir(tmp_path / "files") if n.startswith(".")]
    cache = NodeCache(str(tmp_path / "cache"))
    res = cache.pull(ref, opts)
    assert res.digest == digest and res.files == len(list(checkpoint.iterdir()))
    for p in checkpoint.iterdir():
        assert (Path(res.path) / p.name).read_bytes() == p.read_bytes()
    assert all(r.ok for r in cache.verify())


def test_cli_pack_format_image(checkpoint: Path, tmp_path: Path) -> None:
    out = CliRunner().invoke(
        main,
        [
            "pack",
            str(checkpoint),
            f"oci:{tmp_path / 'l'}:v1",
            "--format",
            "image",
            "--compression",
            "zstd",
            "--json",
        ],
    )
    assert out.exit_code == 0, out.output
    doc = json.loads(out.output)
    manifest = Manifest.parse(
        Path(OCILayoutTarget(str(tmp_path / "l")).blob_path(doc["digest"])).read_bytes()
    )
    assert manifest.layers[0].media_type == MEDIA_TYPE_IMAGE_LAYER_TAR_ZSTD
    bad = CliRunner().invoke(
        main, ["pack", str(checkpoint), f"oci:{tmp_path / 'l'}:v2", "--compression", "zstd"]
    )
    assert bad.exit_code == 1 and "--format image" in bad.output


# --------------------------------------------------------------------------- extraction safety
def _tar(*members: tuple[tarfile.TarInfo, bytes | None]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def _file(name: str, data: bytes = b"x") -> tuple[tarfile.TarInfo, bytes]:
    ti = tarfile.TarInfo(name)
    ti.size = len(data)
    return ti, data


def _special(name: str, kind: bytes, linkname: str = "") -> tuple[tarfile.TarInfo, None]:
    ti = tarfile.TarInfo(name)
    ti.type = kind
    ti.linkname = linkname
    return ti, None


@pytest.mark.parametrize(
    "member",
    [
        _special("models/evil", tarfile.SYMTYPE, "/etc/passwd"),
        _special("models/hard", tarfile.LNKTYPE, "models/x"),
        _special("models/dev", tarfile.CHRTYPE),
        _special("models/fifo", tarfile.FIFOTYPE),
        _file("models/../../escape"),
        _file("/models/abs"),
        _file("elsewhere/file"),
        _file("models/.wh.config.json"),
    ],
    ids=["symlink", "hardlink", "device", "fifo", "dotdot", "absolute", "outside-models", "whiteout"],
)
def test_unsafe_members_are_refused(member: tuple[tarfile.TarInfo, bytes | None], tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    dest.mkdir()
    data = _tar(_file("models/ok.json", b"{}"), member)
    with pytest.raises(UnsafeTarError):
        extract_tar_layer(io.BytesIO(data), str(dest))
    assert not (tmp_path / "escape").exists()
    assert not any(p.is_symlink() for p in dest.rglob("*"))


def test_duplicates_and_diff_id_mismatch_are_refused(tmp_path: Path) -> None:
    data = _tar(_file("models/a", b"1"), _file("models/a", b"2"))
    with pytest.raises(UnsafeTarError, match="twice"):
        extract_tar_layer(io.BytesIO(data), str(tmp_path / "d1"))
    good = _tar(_file("models/a", b"1"))
    with pytest.raises(DigestMismatchError):
        extract_tar_layer(io.BytesIO(good), str(tmp_path / "d2"), diff_id="sha256:" + "0" * 64)
    out = extract_tar_layer(
        io.BytesIO(good), str(tmp_path / "d3"), diff_id="sha256:" + hashlib.sha256(good).hexdigest()
    )
    assert out == [("a", 1, "sha256:" + hashlib.sha256(b"1").hexdigest())]
    assert (tmp_path / "d3" / "a").read_bytes() == b"1"
