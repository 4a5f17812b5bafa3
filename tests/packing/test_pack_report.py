"""A pack says what it did: the hidden entries it left out, a warning for pickle weight files,
and the number of the checkpoint's files it packed (also for the image-shaped variant)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from click.testing import CliRunner

from modelpack.cli import main


def _with_extras(checkpoint: Path) -> int:
    """What `hf download --local-dir` and a converted checkpoint leave beside the weights."""
    (checkpoint / ".cache" / "huggingface").mkdir(parents=True)
    (checkpoint / ".cache" / "huggingface" / "download.lock").write_text("")
    (checkpoint / ".gitattributes").write_text("*.safetensors filter=lfs\n")
    (checkpoint / "pytorch_model.bin").write_bytes(b"PK\x03\x04 pickle")
    (checkpoint / "model.gguf").write_bytes(b"GGUF\x03\x00\x00\x00")
    return len([n for n in os.listdir(checkpoint) if not n.startswith(".")])


def test_pack_names_what_it_skipped_and_warns_for_pickle_files(checkpoint: Path, tmp_path: Path) -> None:
    """Hidden entries are left out and listed (stderr and --json `skipped`); a pickle .bin gets a
    warning (stderr and --json `warnings`), a GGUF file none; the count is the files packed."""
    packed = _with_extras(checkpoint)
    res = CliRunner().invoke(main, ["pack", str(checkpoint), f"oci:{tmp_path / 'l'}:v1", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["skipped"] == [".cache/", ".gitattributes"]
    (warning,) = doc["warnings"]
    assert warning.startswith("pytorch_model.bin: a PyTorch pickle file") and "safetensors" in warning
    assert doc["files"] == packed
    assert "skipped 2 hidden entries" in res.stderr and ".cache/" in res.stderr
    assert "warning: pytorch_model.bin" in res.stderr and "model.gguf" not in res.stderr


def test_pack_format_image_counts_the_checkpoint_files_not_its_layers(
    checkpoint: Path, tmp_path: Path
) -> None:
    """`pack --format image` reports the files it packed, not the number of tar layers holding them."""
    packed = _with_extras(checkpoint)
    res = CliRunner().invoke(
        main, ["pack", str(checkpoint), f"oci:{tmp_path / 'l'}:img", "--format", "image"]
    )
    assert res.exit_code == 0, res.output
    assert res.stdout.startswith(f"packed {packed} files "), res.stdout
    assert "warning: pytorch_model.bin" in res.stderr
    doc = json.loads(
        CliRunner()
        .invoke(main, ["pack", str(checkpoint), f"oci:{tmp_path / 'l'}:img2", "--format", "image", "--json"])
        .stdout
    )
    assert doc["files"] == packed and doc["skipped"] == [".cache/", ".gitattributes"]
