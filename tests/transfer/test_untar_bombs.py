"""Tar layers from a registry cannot expand without bound.

What is written is counted and capped (declared member sizes, checked while writing), sparse
members are refused in every encoding, header and trailer sizes are bounded, a corrupt layer is
a typed error, two layers cannot write one path, ``--include``/``--exclude`` select the files
inside tar layers, and the image-shaped pull counts the files it wrote.
"""

from __future__ import annotations

import io
import json
import os
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from modelpack.mediatypes import MEDIA_TYPE_IMAGE_LAYER_TAR_ZSTD, BlobFormat

from modelpack import api
from modelpack.api import transfer
from modelpack.cli import main
from modelpack.errors import ExpansionLimitError, LayerFormatError, PullError, UnsafeTarError
from modelpack.transfer.untar import extract_tar_layer
from tests.pull_dir_helpers import (
    GiB,
    MiB,
    gnu_sparse_member,
    huge_pax_header_stream,
    image_layer,
    modelpack_tar_layer,
    pax_sparse_member,
    raw_layer,
    small_tmpfs,
    tar_member,
    tar_of,
    temp_entries,
    write_artifact,
    zstd,
    zstd_zero_bomb,
)


@pytest.fixture(scope="module")
def zero_bomb() -> bytes:
    """32 KB of tar+zstd that expands to 1 GiB of zeros."""
    blob = zstd_zero_bomb(size=GiB)
    assert len(blob) < 64 * 1024
    return blob


@pytest.fixture
def small_disk(tmp_path: Path) -> Path:
    """A 32 MiB tmpfs where mounting is allowed (a bomb on today's code fills it instead of the
    test machine's disk); else a plain directory."""
    with small_tmpfs(tmp_path / "disk", "32m") as mounted:
        yield mounted if mounted is not None else tmp_path / "disk"


def _written(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


# --------------------------------------------------------------------------- extraction limits
def test_zstd_bomb_is_refused_before_it_is_written(zero_bomb: bytes, small_disk: Path) -> None:
    dest = small_disk / "d"
    dest.mkdir()
    start = time.monotonic()
    with pytest.raises(ExpansionLimitError) as err:
        extract_tar_layer(
            io.BytesIO(zero_bomb),
            str(dest),
            blob_format=BlobFormat.TAR_ZSTD,
            where="layer sha256:bomb",
            max_bytes=16 * MiB,
        )
    assert time.monotonic() - start < 5
    msg = str(err.value)
    assert "layer sha256:bomb" in msg and "models/zeros.bin" in msg and str(GiB) in msg
    assert _written(dest) == 0


def test_budget_counts_every_member_while_writing(tmp_path: Path) -> None:
    members = [tar_member(f"models/f{i}.bin", bytes(300 * 1024)) for i in range(8)]
    with pytest.raises(ExpansionLimitError, match=r"f3\.bin"):
        extract_tar_layer(io.BytesIO(tar_of(*members)), str(tmp_path), max_bytes=1 * MiB)
    assert _written(tmp_path) <= 1 * MiB


@pytest.mark.parametrize("version", ["1.0", "0.1"])
def test_pax_sparse_member_is_refused(version: str, small_disk: Path) -> None:
    data = tar_of(tar_member("models/a.json", b"{}"), pax_sparse_member("models/s.bin", GiB, version))
    with pytest.raises(UnsafeTarError, match="sparse"):
        extract_tar_layer(io.BytesIO(data), str(small_disk))
    assert _written(small_disk) <= 2


def test_gnu_sparse_member_is_refused(small_disk: Path) -> None:
    data = tar_of(gnu_sparse_member("models/g.bin", GiB))
    with pytest.raises(UnsafeTarError, match="sparse"):
        extract_tar_layer(io.BytesIO(data), str(small_disk))
    assert _written(small_disk) == 0


def test_huge_pax_header_is_refused_without_reading_it(tmp_path: Path) -> None:
    blob = huge_pax_header_stream(64 * MiB)
    with pytest.raises(UnsafeTarError, match="header"):
        extract_tar_layer(io.BytesIO(blob), str(tmp_path), blob_format=BlobFormat.TAR_ZSTD)


def test_data_after_the_end_of_the_archive_is_bounded(tmp_path: Path) -> None:
    blob = zstd_zero_bomb("models/small.bin", 1024, trailing_zeros=GiB)
    start = time.monotonic()
    with pytest.raises(UnsafeTarError, match="after the end"):
        extract_tar_layer(io.BytesIO(blob), str(tmp_path), blob_format=BlobFormat.TAR_ZSTD)
    assert time.monotonic() - start < 5


@pytest.mark.parametrize(
    ("blob_format", "blob"),
    [
        (BlobFormat.TAR_ZSTD, b"\x28\xb5\x2f\xfd" + os.urandom(4096)),
        (BlobFormat.TAR_GZIP, b"\x1f\x8b\x08\x00" + os.urandom(4096)),
        (BlobFormat.TAR, os.urandom(4096)),
        (BlobFormat.TAR_ZSTD, zstd(tar_of(tar_member("models/a", b"1")))[:-7]),
    ],
    ids=["zstd", "gzip", "tar", "truncated-zstd"],
)
def test_corrupt_layers_are_a_typed_error(blob_format: BlobFormat, blob: bytes, tmp_path: Path) -> None:
    with pytest.raises(LayerFormatError, match="layer sha256:x"):
        extract_tar_layer(io.BytesIO(blob), str(tmp_path), blob_format=blob_format, where="layer sha256:x")


# --------------------------------------------------------------------------- pull to a directory
def test_pull_refuses_a_bomb_against_free_space_and_max_bytes(
    zero_bomb: bytes, small_disk: Path, tmp_path: Path
) -> None:
    layout = tmp_path / "layout"
    bomb = (MEDIA_TYPE_IMAGE_LAYER_TAR_ZSTD, zero_bomb, {"org.opencontainers.image.title": "zeros.bin"})
    write_artifact(layout, "bomb", [bomb], image_config=True)
    dest = small_disk / "model"
    r = CliRunner().invoke(main, ["pull", f"oci:{layout}:bomb", str(dest), "--progress", "off"])
    assert r.exit_code == 1, r.output
    assert "Traceback" not in r.output and "models/zeros.bin" in r.output
    if os.path.ismount(small_disk):
        assert "free space" in r.output
    assert _written(dest) == 0 and temp_entries(dest) == []
    r = CliRunner().invoke(
        main, ["pull", f"oci:{layout}:bomb", str(tmp_path / "m2"), "--max-bytes", "8M", "--progress", "off"]
    )
    assert r.exit_code == 1 and "--max-bytes" in r.output, r.output
    assert _written(tmp_path / "m2") == 0 and temp_entries(tmp_path / "m2") == []


def test_two_tar_layers_writing_one_path_are_refused(tmp_path: Path) -> None:
    layout = tmp_path / "layout"
    a = image_layer(tar_of(tar_member("models/config.json", b'{"a":1}')), title="a")
    b = image_layer(tar_of(tar_member("models/config.json", b'{"b":2}')), title="b")
    write_artifact(layout, "dup", [a, b], image_config=True)
    with pytest.raises((PullError, UnsafeTarError), match=r"config\.json") as err:
        transfer.pull(f"oci:{layout}:dup", str(tmp_path / "m"), jobs=2, progress="off")
    assert "sha256:" in str(err.value)  # names the layers
    assert not (tmp_path / "m" / "config.json").exists()
    assert temp_entries(tmp_path / "m") == []


def test_a_layer_staged_before_a_sibling_fails_is_cleaned_up(tmp_path: Path) -> None:
    # Layer b fails late (a large member first), so layer a has finished staging by then: its
    # staging directory must go with the failure, not outlive it.
    layout = tmp_path / "layout"
    a = image_layer(tar_of(tar_member("models/config.json", b'{"a":1}')), title="a")
    filler = tar_member("models/filler.bin", b"\0" * (8 << 20))
    b = image_layer(tar_of(filler, tar_member("models/config.json", b'{"b":2}')), title="b")
    write_artifact(layout, "late", [a, b], image_config=True)
    with pytest.raises((PullError, UnsafeTarError), match=r"config\.json"):
        transfer.pull(f"oci:{layout}:late", str(tmp_path / "m"), jobs=2, progress="off")
    assert temp_entries(tmp_path / "m") == []


def test_a_tar_member_colliding_with_a_raw_layer_is_refused(tmp_path: Path) -> None:
    layout = tmp_path / "layout"
    layers = [
        raw_layer("weights/w.bin", b"raw"),
        modelpack_tar_layer(tar_of(tar_member("weights/w.bin", b"tar")), "weights"),
    ]
    write_artifact(layout, "dup", layers)
    with pytest.raises((PullError, UnsafeTarError), match=r"weights/w\.bin"):
        transfer.pull(f"oci:{layout}:dup", str(tmp_path / "m"), progress="off")


def test_file_and_directory_at_one_path_across_layers_are_refused(tmp_path: Path) -> None:
    layout = tmp_path / "layout"
    layers = [
        modelpack_tar_layer(tar_of(tar_member("tok", b"file")), "a"),
        modelpack_tar_layer(tar_of(tar_member("tok/vocab.json", b"{}")), "b"),
    ]
    write_artifact(layout, "clash", layers)
    with pytest.raises((PullError, UnsafeTarError), match="tok"):
        transfer.pull(f"oci:{layout}:clash", str(tmp_path / "m"), progress="off")


@pytest.fixture
def image_artifact(checkpoint: Path, tmp_path: Path) -> str:
    ref = f"oci:{tmp_path / 'img'}:v1"
    api.pack(str(checkpoint), ref, format="image", compression="zstd")
    return ref


def test_include_and_exclude_select_files_inside_tar_layers(
    image_artifact: str, checkpoint: Path, tmp_path: Path
) -> None:
    jsons = sorted(p.name for p in checkpoint.iterdir() if p.name.endswith(".json"))
    res = transfer.pull(image_artifact, str(tmp_path / "a"), include=("*.json",), progress="off")
    assert sorted(res.files) == jsons
    assert sorted(os.listdir(tmp_path / "a")) == jsons
    res = transfer.pull(image_artifact, str(tmp_path / "b"), exclude=("*.safetensors",), progress="off")
    want = sorted(p.name for p in checkpoint.iterdir() if not p.name.endswith(".safetensors"))
    assert sorted(os.listdir(tmp_path / "b")) == want == sorted(res.files)
    for name in want:
        assert (tmp_path / "b" / name).read_bytes() == (checkpoint / name).read_bytes()


def test_image_pull_counts_the_files_it_wrote(image_artifact: str, checkpoint: Path, tmp_path: Path) -> None:
    names = sorted(p.name for p in checkpoint.iterdir())
    r = CliRunner().invoke(main, ["pull", image_artifact, str(tmp_path / "m"), "--json", "--progress", "off"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    placed = doc["directory"]
    assert sorted(placed["paths"]) == names and placed["downloaded"] == len(names) and placed["present"] == 0
    r = CliRunner().invoke(main, ["pull", image_artifact, str(tmp_path / "m"), "--progress", "off"])
    assert r.exit_code == 0, r.output
    assert f"pulled {len(names)} files" in r.stderr and f"{len(names)} already present" in r.stderr
