"""FP8 weights and their scales are sharded together: a TP rank's block scales are the rows (or
columns) of blocks its weight slice covers, an EP rank's expert scales are its experts' scales;
the ROCm FNUZ float8 types pack and load byte-identical to ``safetensors``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from modelpack.loader import LoadStats, load_state_dict
from safetensors.torch import save_file

from modelpack.errors import PlanError
from modelpack.packing.safetensors_format import DTYPE_BITS
from tests.loader_helpers import pack_layout, reference_tensors
from tests.moe_checkpoints import BLOCK, expert_of, linear_experts, write_moe


@pytest.fixture(scope="module")
def fp8(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fp8")
    return {
        n: write_moe(root / n, n, experts=8, hidden=64, inter=128, fp8=True) for n in ("deepseek", "stacked")
    }


def _dequant(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Block-wise dequantisation (DeepSeek-V3's ``weight_dequant``): scale (i, j) covers the
    BLOCK×BLOCK block (i, j) of the weight, the last row/column of blocks possibly partial."""
    rows, cols = w.shape
    full = s.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:rows, :cols]
    return w.float() * full


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_rank_block_scales_match_its_weight_slice(fp8: dict[str, Path], tp: int) -> None:
    """Each rank's weight, dequantised with its own scales, is exactly its slice of the full
    dequantised weight: the scales were split at block granularity along the weight's split."""
    ckpt = fp8["deepseek"]
    ref = reference_tensors(ckpt)
    scales = [n for n in ref if n.endswith(".weight_scale_inv")]
    assert scales
    for rank in range(tp):
        stats = LoadStats()
        sd = load_state_dict(str(ckpt), tp_size=tp, tp_rank=rank, allow_unverified=True, stats=stats)
        split = 0
        for s in scales:
            w = s[: -len("_scale_inv")]
            full = _dequant(ref[w], ref[s])
            mine = _dequant(sd[w], sd[s])
            if sd[w].shape == ref[w].shape:
                assert torch.equal(sd[s], ref[s]), s  # replicated weight: whole scale
                continue
            split += 1
            dim = 0 if sd[w].shape[0] != ref[w].shape[0] else 1
            assert torch.equal(mine, full.chunk(tp, dim)[rank]), (s, rank)
            n = ref[s].shape[dim] // tp
            assert torch.equal(sd[s], ref[s].narrow(dim, rank * n, n)), (s, rank)
        assert split > 0


def test_a_split_that_cuts_a_scale_block_is_refused(tmp_path: Path) -> None:
    """A TP share that starts inside a quantisation block would need a block's scale on two
    ranks with different rows under it: refused, naming the tensor and the block size."""
    ckpt = write_moe(tmp_path / "odd", "deepseek", experts=2, hidden=64, inter=96, fp8=True)
    with pytest.raises(PlanError, match=r"experts\.0\.(gate|down)_proj\.weight_scale_inv.*block of 16"):
        load_state_dict(str(ckpt), tp_size=4, tp_rank=1, allow_unverified=True)


def test_ep_rank_gets_its_experts_scales_with_their_weights(fp8: dict[str, Path]) -> None:
    ref = reference_tensors(fp8["deepseek"])
    for rank in range(4):
        mine = linear_experts(8, 4, rank)
        sd = load_state_dict(
            str(fp8["deepseek"]), tp_size=2, tp_rank=rank % 2, ep_size=4, ep_rank=rank, allow_unverified=True
        )
        for name in sd:
            if expert_of(name) is not None:
                assert expert_of(name) in mine and torch.equal(
                    sd[name].view(torch.uint8), ref[name].view(torch.uint8)
                )
        for e in mine:
            w = f"model.layers.1.mlp.experts.{e}.down_proj.weight"
            assert torch.equal(sd[w + "_scale_inv"], ref[w + "_scale_inv"])
        # the dense tensors' scales follow their TP split
        q = "model.layers.0.self_attn.q_proj.weight"
        assert torch.equal(
            _dequant(sd[q], sd[q + "_scale_inv"]),
            _dequant(ref[q], ref[q + "_scale_inv"]).chunk(2, 0)[rank % 2],
        )
    ref = reference_tensors(fp8["stacked"])
    for rank in range(4):
        mine = linear_experts(8, 4, rank)
        sd = load_state_dict(str(fp8["stacked"]), ep_size=4, ep_rank=rank, allow_unverified=True)
        for name in (
            "mlp.experts.gate_up_proj",
            "mlp.experts.gate_up_proj_scale_inv",
            "mlp.experts.down_proj_scale_inv",
        ):
            full = ref["model.layers.1." + name]
            got = sd["model.layers.1." + name]
            assert torch.equal(
                got.view(torch.uint8), full[mine[0] : mine[-1] + 1].contiguous().view(torch.uint8)
            ), name


def test_fnuz_float8_types_pack_and_load_byte_identical(tmp_path: Path) -> None:
    from modelpack.signing.chunks import compute_chunk_table

    assert DTYPE_BITS["F8_E4M3FNUZ"] == DTYPE_BITS["F8_E5M2FNUZ"] == 8
    g = torch.Generator().manual_seed(5)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    tensors = {
        "model.layers.0.self_attn.q_proj.weight": torch.randn(32, 16, generator=g).to(torch.float8_e4m3fnuz),
        "model.layers.0.self_attn.o_proj.weight": torch.randn(16, 32, generator=g).to(torch.float8_e5m2fnuz),
        "model.norm.weight": torch.randn(16, generator=g).to(torch.float8_e4m3fnuz),
    }
    save_file(tensors, str(ckpt / "model.safetensors"))
    lay = pack_layout(ckpt, tmp_path / "layout")
    table = compute_chunk_table(lay.target, lay.manifest, 64 * 1024)
    ref = reference_tensors(ckpt)
    sd = load_state_dict(lay.ref, chunk_table=table)
    for name, t in ref.items():
        assert sd[name].dtype == t.dtype and torch.equal(sd[name].view(torch.uint8), t.view(torch.uint8)), (
            name
        )
    sd = load_state_dict(lay.ref, chunk_table=table, tp_size=2, tp_rank=1)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(sd[q].view(torch.uint8), ref[q].chunk(2, 0)[1].view(torch.uint8))


@pytest.mark.host_copier  # mapped views are a CPU load
@pytest.mark.parametrize("expert_map", ["linear", "round_robin"])
def test_views_of_a_cache_hit_are_the_same_shares(
    fp8: dict[str, Path], tmp_path: Path, expert_map: str
) -> None:
    """A node-cache hit with ``views="shard"`` hands out views of the store blobs: a rank's stacked
    experts (one run) and its block scales are views of exactly the rows a read would give; a
    round-robin rank's every-EP-th expert is no single view and is read instead."""
    from modelpack.loader import LoaderOptions
    from modelpack.mount.cache import NodeCache

    lay = pack_layout(fp8["stacked"], tmp_path / "layout")
    snap = NodeCache(str(tmp_path / "cache")).pull(f"oci:{lay.path}@{lay.digest}").path
    for rank in (1, 3):
        kwargs: dict[str, Any] = {"tp_size": 2, "tp_rank": rank % 2, "ep_size": 4, "ep_rank": rank}
        want = load_state_dict(snap, expert_map=expert_map, **kwargs)
        stats = LoadStats()
        got = load_state_dict(
            snap, expert_map=expert_map, options=LoaderOptions(views="shard"), stats=stats, **kwargs
        )
        assert sorted(got) == sorted(want)
        for name, t in want.items():
            assert got[name].shape == t.shape and torch.equal(
                got[name].view(torch.uint8), t.view(torch.uint8)
            ), name
        assert stats.mapped_bytes > 0
        stacked = "model.layers.1.mlp.experts.gate_up_proj"
        mine = [e for e in range(8) if (e % 4 if expert_map == "round_robin" else e // 2) == rank]
        full = reference_tensors(fp8["stacked"])[stacked]
        assert torch.equal(got[stacked].view(torch.uint8), full[mine].contiguous().view(torch.uint8))
