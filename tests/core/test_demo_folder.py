"""`python -m modelpack.demo --out DIR` empties DIR first, so it refuses a folder it did not make."""

from __future__ import annotations

from pathlib import Path

import pytest

from modelpack.demo import _cli


def test_the_demo_refuses_to_empty_a_folder_it_did_not_make(tmp_path: Path) -> None:
    precious = tmp_path / "home" / "notes.txt"
    precious.parent.mkdir()
    precious.write_text("keep me")
    with pytest.raises(SystemExit, match="not a folder this demo made"):
        _cli(["--out", str(precious.parent)])
    assert precious.read_text() == "keep me"
