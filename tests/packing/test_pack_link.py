"""``pack --link auto|reflink|copy`` exists, as docs/artifact.md says.

Before, ``cli/pack.py`` popped a ``link`` option no decorator defined: ``pack --link copy``
was a usage error ("No such option"), so a person told to use it to keep checkpoint files
from sharing an inode with the layout had no way to. Checked on the inodes of a real layout.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from modelpack.cli import main


def _blob_inodes(layout: Path) -> set[int]:
    return {p.stat().st_ino for p in (layout / "blobs" / "sha256").iterdir()}


@pytest.mark.parametrize("link", ["auto", "reflink", "copy"])
def test_pack_link_decides_whether_the_layout_shares_the_checkpoint_inodes(
    checkpoint: Path, tmp_path: Path, link: str
) -> None:
    layout = tmp_path / f"layout-{link}"
    r = CliRunner().invoke(main, ["pack", str(checkpoint), f"oci:{layout}:v1", "--link", link])
    assert r.exit_code == 0, r.output
    shard = next(checkpoint.glob("*.safetensors"))
    shared = shard.stat().st_ino in _blob_inodes(layout)
    if link == "auto":
        # same filesystem: a reflink (own inode) where the filesystem clones, else a hard link
        assert shared or shard.stat().st_nlink == 1
    else:
        assert not shared and shard.stat().st_nlink == 1
    assert os.path.getsize(shard) in {p.stat().st_size for p in (layout / "blobs" / "sha256").iterdir()}


def test_pack_link_refuses_an_unknown_mode(checkpoint: Path, tmp_path: Path) -> None:
    r = CliRunner().invoke(main, ["pack", str(checkpoint), f"oci:{tmp_path / 'l'}:v1", "--link", "symlink"])
    assert r.exit_code == 2 and "symlink" in r.output
