"""Chunk tables aligned to tensors: boundaries where the tensors and their dim-0 parts begin and
end, a compact run-length wire form, tables published in the fixed form still verify, and a
table whose runs overlap, leave gaps, run past the blob or are absurdly many is refused."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
from modelpack.signing.chunk_bounds import SMALL, max_chunks
from modelpack.signing.chunks import ChunkTable, compute_chunk_table

from modelpack.errors import ChunkDigestMismatch, ChunkTableError
from modelpack.packing.safetensors_format import read_header
from tests.loader_helpers import Layout

CHUNK = 256 * 1024


def _file(ckpt: Path) -> Path:
    return next(ckpt.glob("*.safetensors"))


def test_aligned_boundaries_fall_on_tensors_and_their_dim0_halves(lay: tuple[Path, Layout]) -> None:
    ckpt, layout = lay
    table = compute_chunk_table(layout.target, layout.manifest, CHUNK, aligned=True)
    assert table.aligned
    layer, blob = layout.weight_blob()
    lc = table.layers[str(layer.digest)]
    assert lc.starts is not None and lc.starts[0] == 0
    starts = set(lc.starts)
    hdr = read_header(_file(ckpt))
    big = [t for t in hdr.tensors if t.nbytes >= SMALL]
    assert big
    for t in big:
        s, e = hdr.absolute(t)
        assert s in starts and (e in starts or e == layer.size), t.name
        if t.shape[0] % 2 == 0 and t.nbytes // 2 >= CHUNK // 2:
            assert s + t.nbytes // 2 in starts, t.name  # a TP=2 dim-0 share is whole chunks
    assert all(table.chunk_range(str(layer.digest), i)[1] <= CHUNK for i in range(len(lc.digests)))
    # every chunk verifies against the blob's bytes, and a changed byte does not
    data = blob.read_bytes()
    for i in range(len(lc.digests)):
        c0, clen = table.chunk_range(str(layer.digest), i)
        table.verify_chunk(str(layer.digest), i, data[c0 : c0 + clen])
        assert table.chunk_at(str(layer.digest), c0 + clen - 1) == (c0, clen)
    c0, clen = table.chunk_range(str(layer.digest), 3)
    bad = bytearray(data[c0 : c0 + clen])
    bad[0] ^= 1
    with pytest.raises(ChunkDigestMismatch):
        table.verify_chunk(str(layer.digest), 3, bad)
    assert table.wrong_chunks(str(layer.digest), c0, bytes(bad)) == [(c0, clen)]
    # the wire form round-trips, in runs rather than one offset per chunk
    doc = table.to_predicate()
    entry = doc["layers"][str(layer.digest)]
    assert len(entry["runs"]) < len(entry["chunks"])
    again = ChunkTable.from_predicate(doc, layout.manifest)
    assert again.layers[str(layer.digest)] == lc


def test_tables_published_with_a_fixed_chunk_size_still_verify(lay: tuple[Path, Layout]) -> None:
    _, layout = lay
    table = compute_chunk_table(layout.target, layout.manifest, CHUNK)
    doc = table.to_predicate()
    assert not table.aligned and all("runs" not in e for e in doc["layers"].values())
    again = ChunkTable.from_predicate(doc, layout.manifest)
    layer, blob = layout.weight_blob()
    data = blob.read_bytes()
    n = len(again.layers[str(layer.digest)].digests)
    assert n == -(-layer.size // CHUNK)
    for i in range(n):
        assert again.chunk_range(str(layer.digest), i) == (i * CHUNK, min(CHUNK, layer.size - i * CHUNK))
        c0, clen = again.chunk_range(str(layer.digest), i)
        again.verify_chunk(str(layer.digest), i, data[c0 : c0 + clen])


def _hostile(doc: dict[str, Any], layer: str, runs: Any, chunks: int | None = None) -> dict[str, Any]:
    bad = copy.deepcopy(doc)
    entry = bad["layers"][layer]
    entry["runs"] = runs
    if chunks is not None:
        entry["chunks"] = ["00" * 32] * chunks
    return bad


@pytest.mark.parametrize(
    "case",
    [
        "overlap",
        "gap",
        "past-the-blob",
        "short",
        "absurdly-many",
        "too-long",
        "empty-run",
        "not-ints",
        "count",
    ],
)
def test_hostile_aligned_tables_are_refused(lay: tuple[Path, Layout], case: str) -> None:
    _, layout = lay
    table = compute_chunk_table(layout.target, layout.manifest, CHUNK, aligned=True)
    doc = table.to_predicate()
    layer, _ = layout.weight_blob()
    key, size = str(layer.digest), layer.size
    good: list[list[int]] = doc["layers"][key]["runs"]
    n = len(doc["layers"][key]["chunks"])
    assert len(good) >= 2

    def edit(i: int, field: int, delta: int) -> list[list[int]]:
        out = copy.deepcopy(good)
        out[i][field] += delta
        return out

    runs: dict[str, tuple[Any, int | None, str]] = {
        "overlap": (edit(1, 0, -8), n, "overlaps"),
        "gap": (edit(1, 0, 8), n, "gap"),
        "past-the-blob": (edit(len(good) - 1, 2, 1), n + 1, "past the blob"),
        "short": (good[:-1], n - good[-1][2], "gap at the end"),
        "absurdly-many": ([[0, 1, size]], None, "absurdly many"),
        "too-long": ([[0, size, 1]], 1, "chunks of 1.."),
        "empty-run": ([[0, 0, 5], *good], n + 5, "chunks of 1.."),
        "not-ints": ([[0, "4096", 1]], 1, "integers"),
        "count": (good, n - 1, "expected"),
    }
    bad_runs, chunks, message = runs[case]
    if case == "too-long":
        assert size > CHUNK
    with pytest.raises(ChunkTableError, match=message):
        ChunkTable.from_predicate(_hostile(doc, key, bad_runs, chunks), layout.manifest)


def test_the_chunk_bound_allows_what_the_signer_writes_and_no_more(lay: tuple[Path, Layout]) -> None:
    _, layout = lay
    table = compute_chunk_table(layout.target, layout.manifest, 64 * 1024, aligned=True)
    for lc in table.layers.values():
        assert len(lc.digests) <= max_chunks(lc.size)
    assert max_chunks(1 << 30) < (1 << 30) // 4096  # 1-KiB-average chunks are refused
