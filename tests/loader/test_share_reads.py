"""A standalone rank (no process group) under a tensor-aligned chunk table reads its share, not
the chunks around it: an EP rank its experts and the replicated tensors, a TP rank exactly its
dim-0 rows; the tensors are byte-identical to ``safetensors``' own load."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from modelpack.loader import LoaderOptions, LoadStats, load_state_dict
from modelpack.loader.plan import ShardRule
from modelpack.signing.chunks import ChunkTable, compute_chunk_table

from modelpack.errors import ChunkDigestMismatch
from modelpack.packing.safetensors_format import read_header
from modelpack.testdata.synthetic import SyntheticSpec, write_checkpoint
from tests.loader_helpers import Layout, corrupt, expected_shard, pack_layout, reference_tensors
from tests.moe_checkpoints import expert_of, linear_experts, write_moe

CHUNK = 1024 * 1024
EP, E = 8, 16


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Layout]:
    d = tmp_path_factory.mktemp("share-moe")
    write_moe(d / "ckpt", "deepseek", experts=E, layers=2, hidden=256, inter=384, vocab=512)
    return d / "ckpt", pack_layout(d / "ckpt", d / "layout")


@pytest.fixture(scope="module")
def dense(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Layout]:
    d = tmp_path_factory.mktemp("share-dense")
    spec = SyntheticSpec(hidden=512, intermediate=1536, layers=2, heads=8, kv_heads=8, vocab=2048)
    write_checkpoint(str(d / "ckpt"), spec)
    return d / "ckpt", pack_layout(d / "ckpt", d / "layout")


def _headers(stats: LoadStats) -> int:
    assert stats.plan is not None
    return sum(8 + fp.header.header_size for fp in stats.plan.files.values())


def test_an_ep_rank_reads_its_experts_and_the_replicated_tensors_within_5_percent(
    moe: tuple[Path, Layout],
) -> None:
    ckpt, lay = moe
    ref = reference_tensors(ckpt)
    table = compute_chunk_table(lay.target, lay.manifest, CHUNK, aligned=True)
    fixed = compute_chunk_table(lay.target, lay.manifest, CHUNK)
    for rank in (0, 5):
        mine = linear_experts(E, EP, rank)
        stats = LoadStats()
        sd = load_state_dict(lay.ref, ep_size=EP, ep_rank=rank, chunk_table=table, stats=stats)
        want = {n: t for n, t in ref.items() if expert_of(n) is None or expert_of(n) in mine}
        assert sorted(sd) == sorted(want)
        for name, t in want.items():
            assert torch.equal(sd[name].view(torch.uint8), t.contiguous().view(torch.uint8)), name
        assert stats.bytes_read <= stats.bytes_to_read * 1.05 + _headers(stats), (rank, stats.bytes_read)
        # the fixed-size table of the same chunk size reads chunks of other ranks' experts
        before = LoadStats()
        load_state_dict(lay.ref, ep_size=EP, ep_rank=rank, chunk_table=fixed, stats=before)
        assert before.bytes_read > stats.bytes_read * 1.2, (before.bytes_read, stats.bytes_read)


@pytest.mark.parametrize(("tp", "chunk"), [(2, CHUNK), (4, CHUNK // 4)])
def test_a_tp_rank_reads_exactly_its_dim0_rows(dense: tuple[Path, Layout], tp: int, chunk: int) -> None:
    """TP=2: every dim-0 tensor of 64 KiB or more is cut in halves; finer shares are whole
    chunks where each part is at least half a chunk (here: every sharded tensor at 256 KiB)."""
    ckpt, lay = dense
    ref = reference_tensors(ckpt)
    table = compute_chunk_table(lay.target, lay.manifest, chunk, aligned=True)
    for rank in range(tp):
        stats = LoadStats()
        sd = load_state_dict(lay.ref, tp_size=tp, tp_rank=rank, chunk_table=table, stats=stats)
        assert stats.plan is not None
        for t in stats.plan.tensors:
            assert torch.equal(sd[t.name], expected_shard(ref[t.name], t.rule, tp, rank)), t.name
        d0 = stats.bytes_by_split["dim0"]
        assert d0["read"] == d0["planned"] == d0["tensorBytes"] // tp, d0


@pytest.mark.parametrize(("tp", "chunk"), [(2, CHUNK), (4, CHUNK // 4), (8, CHUNK // 16)])
def test_a_tp_rank_reads_exactly_its_dim1_columns(dense: tuple[Path, Layout], tp: int, chunk: int) -> None:
    """Column-split tensors: the rank reads its columns only (one range per row), checked against
    the table's column blocks, and nothing of the other ranks' columns (TP=8: eighths of 64 KiB
    or more are signed where the chunk size is 64 KiB). A device destination (the stand-in) takes
    the rows through staging slots, a band at a time; with small slots, many bands."""
    ckpt, lay = dense
    ref = reference_tensors(ckpt)
    table = compute_chunk_table(lay.target, lay.manifest, chunk, aligned=True)
    for rank in sorted({0, tp - 1}):
        stats = LoadStats()
        opts = LoaderOptions(slot_bytes=chunk)  # staged: shares of several bands at TP=8
        sd = load_state_dict(lay.ref, tp_size=tp, tp_rank=rank, chunk_table=table, stats=stats, options=opts)
        assert stats.plan is not None
        for t in stats.plan.tensors:
            assert torch.equal(sd[t.name], expected_shard(ref[t.name], t.rule, tp, rank)), t.name
        d1 = stats.bytes_by_split["dim1"]
        assert d1["tensorBytes"] > 0 and d1["planned"] == d1["tensorBytes"] // tp, d1
        assert d1["read"] == d1["planned"], d1
        assert stats.bytes_read <= stats.bytes_to_read + _headers(stats) + 64 * 1024, stats.bytes_read


def _without_columns(table: ChunkTable) -> ChunkTable:
    return ChunkTable(
        table.manifest_digest,
        table.chunk_size,
        {k: dataclasses.replace(lc, columns=()) for k, lc in table.layers.items()},
    )


def test_without_column_blocks_the_rank_reads_whole_dim1_tensors(dense: tuple[Path, Layout]) -> None:
    """Tables signed before column blocks (or by another signer) still load: the rank reads the
    column-split tensors whole, as before."""
    ckpt, lay = dense
    ref = reference_tensors(ckpt)
    table = _without_columns(compute_chunk_table(lay.target, lay.manifest, CHUNK, aligned=True))
    stats = LoadStats()
    sd = load_state_dict(lay.ref, tp_size=2, tp_rank=1, chunk_table=table, stats=stats)
    assert stats.plan is not None
    for t in stats.plan.tensors:
        assert torch.equal(sd[t.name], expected_shard(ref[t.name], t.rule, 2, 1)), t.name
    d1 = stats.bytes_by_split["dim1"]
    assert d1["read"] == d1["tensorBytes"], d1


@pytest.fixture
def own_dense(tmp_path: Path) -> tuple[Path, Layout]:
    spec = SyntheticSpec(hidden=512, intermediate=1536, layers=1, heads=8, kv_heads=8, vocab=1024)
    write_checkpoint(str(tmp_path / "ckpt"), spec)
    return tmp_path / "ckpt", pack_layout(tmp_path / "ckpt", tmp_path / "layout")


def test_a_changed_byte_in_a_ranks_columns_fails_that_rank_only(own_dense: tuple[Path, Layout]) -> None:
    """The attack: a byte of a column-split tensor changed in storage. The rank whose columns hold
    it refuses the load (its column block's digest), never hands out the tensor; the other rank,
    which never reads those bytes, loads."""
    ckpt, lay = own_dense
    table = compute_chunk_table(lay.target, lay.manifest, CHUNK, aligned=True)
    small = compute_chunk_table(lay.target, lay.manifest, 1 << 16, aligned=True)
    _, blob = lay.weight_blob()
    hdr = read_header(next(ckpt.glob("*.safetensors")))
    t = next(x for x in hdr.tensors if x.name.endswith("down_proj.weight"))
    start, _ = hdr.absolute(t)
    row_bytes = t.nbytes // t.shape[0]
    corrupt(blob, start + 5 * row_bytes + row_bytes - 1)  # row 5, the last column: rank 1's
    with pytest.raises(ChunkDigestMismatch, match="column block"):
        load_state_dict(lay.ref, tp_size=2, tp_rank=1, chunk_table=table)
    # a table of 64 KiB chunks (slots of 64 KiB when staged: 12 bands), row 5 restored and a
    # byte in row 300's last column changed: the band that holds it is not the first
    corrupt(blob, start + 5 * row_bytes + row_bytes - 1)
    corrupt(blob, start + 300 * row_bytes + row_bytes - 1)
    with pytest.raises(ChunkDigestMismatch, match="column block"):
        load_state_dict(
            lay.ref, tp_size=2, tp_rank=1, chunk_table=small, options=LoaderOptions(slot_bytes=1 << 16)
        )
    sd = load_state_dict(lay.ref, tp_size=2, tp_rank=0, chunk_table=small)
    ref = reference_tensors(ckpt)  # the checkpoint itself is untouched (the layout holds a copy)
    assert torch.equal(sd[t.name], expected_shard(ref[t.name], ShardRule.DIM1, 2, 0))
