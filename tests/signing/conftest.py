"""Fixtures the signing tests share."""

from __future__ import annotations

from pathlib import Path

import pytest

from modelpack.testdata.synthetic import SyntheticSpec, write_checkpoint
from tests.loader_helpers import Layout, pack_layout


@pytest.fixture(scope="module")
def lay(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Layout]:
    """A small Llama-shaped checkpoint (one file, 2-D tensors of 128 KiB to 2.8 MiB) and its OCI
    layout: what the aligned-table tests cut into chunks and column blocks."""
    d = tmp_path_factory.mktemp("aligned")
    spec = SyntheticSpec(hidden=512, intermediate=1408, layers=2, heads=8, kv_heads=4, vocab=2048)
    write_checkpoint(str(d / "ckpt"), spec)
    return d / "ckpt", pack_layout(d / "ckpt", d / "layout")
