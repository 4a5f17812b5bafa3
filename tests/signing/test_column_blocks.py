"""Column blocks in aligned chunk tables: what the signer cuts, that each digest is over the
right bytes (checked against torch's own column slices, not against the digester), that the
two digesters agree, and that a hostile ``columns`` entry is refused."""

from __future__ import annotations

import copy
import hashlib
from pathlib import Path
from typing import Any

import pytest
import torch
from modelpack.signing.chunk_bounds import COLUMN_GRID, SMALL, max_chunks
from modelpack.signing.chunks import ChunkTable, compute_chunk_table
from modelpack.signing.column_digests import ColumnDigester

from modelpack.errors import ChunkTableError
from modelpack.packing.safetensors_format import read_header
from tests.loader_helpers import Layout, reference_tensors

CHUNK = 256 * 1024


def test_every_large_2d_tensor_has_column_blocks_over_its_column_slices(lay: tuple[Path, Layout]) -> None:
    ckpt, layout = lay
    table = compute_chunk_table(layout.target, layout.manifest, CHUNK, aligned=True)
    layer, _ = layout.weight_blob()
    lc = table.layers[str(layer.digest)]
    hdr = read_header(next(ckpt.glob("*.safetensors")))
    ref = reference_tensors(ckpt)
    by_start = {c.start: c for c in lc.columns}
    big = [t for t in hdr.tensors if len(t.shape) == 2 and t.nbytes >= 2 * SMALL]
    assert big and len(by_start) == len(big)
    for t in big:
        s, e = hdr.absolute(t)
        cb = table.column_blocks(str(layer.digest), s, e)
        assert cb is not None and cb is by_start[s], t.name
        k = len(cb.digests)
        assert 2 <= k <= COLUMN_GRID and t.shape[1] % k == 0, (t.name, k)
        cols = t.shape[1] // k
        for j in range(k):  # the oracle: torch's own slice of the columns, made contiguous
            part = ref[t.name][:, j * cols : (j + 1) * cols].contiguous().view(torch.uint8)
            assert cb.digests[j] == hashlib.sha256(part.numpy().tobytes()).digest(), (t.name, j)
    # small or 1-D tensors have none, and a table without aligned chunks carries none
    assert table.column_blocks(str(layer.digest), 0, 8) is None
    fixed = compute_chunk_table(layout.target, layout.manifest, CHUNK)
    assert all(not x.columns for x in fixed.layers.values())
    assert "columns" not in fixed.to_predicate()["layers"][str(layer.digest)]


@pytest.mark.parametrize("piece", [1, 7, 4096, 10_000, 1 << 20])
def test_the_numpy_and_plain_digesters_agree_whatever_the_pieces(piece: int) -> None:
    rows, row_bytes, blocks = 37, 8 * 96, 8
    data = bytes(range(256)) * (rows * row_bytes // 256 + 1)
    data = data[: rows * row_bytes]
    fast, plain = (
        ColumnDigester(rows, row_bytes, blocks),
        ColumnDigester(rows, row_bytes, blocks, use_numpy=False),
    )
    for pos in range(0, len(data), piece):
        fast.update(data[pos : pos + piece])
        plain.update(memoryview(data)[pos : pos + piece])
    w = row_bytes // blocks
    oracle = [
        hashlib.sha256(
            b"".join(data[r * row_bytes + j * w : r * row_bytes + (j + 1) * w] for r in range(rows))
        ).digest()
        for j in range(blocks)
    ]
    assert fast.digests() == plain.digests() == oracle
    with pytest.raises(ValueError, match="more bytes"):
        fast.update(b"x")


def _with_columns(doc: dict[str, Any], key: str, columns: Any, chunks: int | None) -> dict[str, Any]:
    bad = copy.deepcopy(doc)
    bad["layers"][key]["columns"] = columns
    if chunks is not None:
        bad["layers"][key]["columnChunks"] = ["ab" * 32] * chunks
    return bad


@pytest.mark.parametrize(
    "case",
    ["not-a-list", "not-ints", "bool", "three-blocks", "sixteen-blocks", "indivisible", "overlap",
     "past-the-blob", "no-rows", "absurdly-many", "digest-count", "bad-hex"],
)  # fmt: skip
def test_hostile_column_entries_are_refused(lay: tuple[Path, Layout], case: str) -> None:
    _, layout = lay
    table = compute_chunk_table(layout.target, layout.manifest, CHUNK, aligned=True)
    doc = table.to_predicate()
    layer, _ = layout.weight_blob()
    key, size = str(layer.digest), layer.size
    good: list[list[int]] = doc["layers"][key]["columns"]
    n = len(doc["layers"][key]["columnChunks"])
    assert len(good) >= 2
    s0, rows0, rb0, k0 = good[0]
    cases: dict[str, tuple[Any, int | None, str]] = {
        "not-a-list": ({"0": good[0]}, n, "must be a list"),
        "not-ints": ([[s0, rows0, str(rb0), k0]], k0, "integers"),
        "bool": ([[s0, True, rb0, k0]], k0, "integers"),
        "three-blocks": ([[s0, rows0, rb0, 3]], 3, "power of two"),
        "sixteen-blocks": ([[s0, rows0, rb0, 16]], 16, "power of two"),
        "indivisible": ([[s0, rows0, 2 * k0 + 1, k0]], k0, "dividing rowBytes"),
        "overlap": ([good[0], [s0 + rb0, *good[1][1:]], *good[2:]], n, "overlaps"),
        "past-the-blob": ([[size - rb0, 2, rb0, k0]], k0, "leaves the blob"),
        "no-rows": ([[s0, 0, rb0, k0]], k0, "leaves the blob"),
        "absurdly-many": ([[0, 1, 2, 2]] * (max_chunks(size) + 1), None, "at most"),
        "digest-count": (good, n - 1, "expected"),
        "bad-hex": (good, None, "bad chunk digest"),
    }
    columns, chunks, message = cases[case]
    bad = _with_columns(doc, key, columns, chunks)
    if case == "bad-hex":
        bad["layers"][key]["columnChunks"][0] = "zz" * 32
    with pytest.raises(ChunkTableError, match=message):
        ChunkTable.from_predicate(bad, layout.manifest)


def test_the_wire_form_round_trips_and_old_verifiers_ignore_it(lay: tuple[Path, Layout]) -> None:
    _, layout = lay
    table = compute_chunk_table(layout.target, layout.manifest, CHUNK, aligned=True)
    doc = table.to_predicate()
    again = ChunkTable.from_predicate(doc, layout.manifest)
    assert again.layers == table.layers
    # a table without the column keys is the same table for every contiguous check
    plain = copy.deepcopy(doc)
    for entry in plain["layers"].values():
        entry.pop("columns", None)
        entry.pop("columnChunks", None)
    old = ChunkTable.from_predicate(plain, layout.manifest)
    for key, lc in old.layers.items():
        assert lc.digests == table.layers[key].digests and lc.starts == table.layers[key].starts
        assert not lc.columns
