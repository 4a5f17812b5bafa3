"""The loader's tensor-parallel presets for the MoE families' own names: Mixtral's experts
(``w1``/``w3`` column-parallel, ``w2`` row-parallel) and DeepSeek's multi-head latent attention
(``q_b_proj``/``kv_b_proj`` column-parallel; the low-rank ``q_a_proj``/``kv_a_proj_with_mqa`` and
their norms replicated, as vLLM's ``DeepseekV2MLAAttention`` holds them), each rank byte-identical
to the matching slice of ``safetensors``' own load and reading only its share of the split ones."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from modelpack.loader import LoadStats, load_state_dict
from modelpack.loader.tp_rules import ShardRule, compile_rules, rule_for
from safetensors.torch import save_file

from tests.loader_helpers import reference_tensors
from tests.moe_checkpoints import write_moe

TP = 2
HIDDEN, HEADS, Q_RANK, KV_RANK, NOPE, ROPE, V_HEAD = 64, 4, 32, 16, 8, 4, 8


def _mla_checkpoint(root: Path) -> Path:
    """One DeepSeek-V2/V3 attention block (with a q LoRA) and its norms, as the checkpoint names it."""
    g = torch.Generator().manual_seed(3)
    p = "model.layers.0.self_attn."

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).bfloat16()

    root.mkdir(parents=True)
    save_file(
        {
            p + "q_a_proj.weight": w(Q_RANK, HIDDEN),
            p + "q_a_layernorm.weight": w(Q_RANK),
            p + "q_b_proj.weight": w(HEADS * (NOPE + ROPE), Q_RANK),
            p + "kv_a_proj_with_mqa.weight": w(KV_RANK + ROPE, HIDDEN),
            p + "kv_a_layernorm.weight": w(KV_RANK),
            p + "kv_b_proj.weight": w(HEADS * (NOPE + V_HEAD), KV_RANK),
            p + "o_proj.weight": w(HIDDEN, HEADS * V_HEAD),
        },
        str(root / "model.safetensors"),
        metadata={"format": "pt"},
    )
    return root


DIM0 = ("q_b_proj", "kv_b_proj", "w1", "w3", "q_proj", "k_proj", "v_proj", "embed_tokens", "lm_head")
DIM1 = ("o_proj", "w2")


def _split_of(name: str) -> int | None:
    """The dimension a TP rank splits ``name`` along in vLLM's layers (None: replicated); a block
    scale goes with its weight."""
    module, leaf = name.split(".")[-2:]
    if leaf not in ("weight", "weight_scale_inv"):
        return None
    return 0 if module in DIM0 else 1 if module in DIM1 else None


@pytest.mark.parametrize("family", ["mixtral", "mixtral_fp8", "deepseek_mla"])
def test_each_tp_rank_reads_its_half_of_the_family_tensors(family: str, tmp_path: Path) -> None:
    if family.startswith("mixtral"):
        ckpt = write_moe(tmp_path / family, "mixtral", experts=4, fp8=family.endswith("fp8"))
    else:
        ckpt = _mla_checkpoint(tmp_path / family)
    ref = reference_tensors(ckpt)
    split_names = [n for n in ref if _split_of(n) is not None]
    assert any(".w2." in n or "kv_b_proj" in n for n in split_names)
    assert family != "mixtral_fp8" or any(n.endswith("w2.weight_scale_inv") for n in split_names)
    for rank in range(TP):
        stats = LoadStats()
        sd = load_state_dict(str(ckpt), tp_size=TP, tp_rank=rank, allow_unverified=True, stats=stats)
        assert sorted(sd) == sorted(ref)
        want = 0
        for name, full in ref.items():
            dim = _split_of(name)
            expected = full if dim is None else full.chunk(TP, dim)[rank]
            assert sd[name].shape == expected.shape, (name, rank, tuple(sd[name].shape))
            assert torch.equal(sd[name], expected), (name, rank)
            want += expected.numel() * expected.element_size()
        assert stats.bytes_to_read == want, (family, rank)


def test_the_presets_leave_the_low_rank_and_router_tensors_whole() -> None:
    """A wrong split serves garbage: the router, the latent down-projections and the norms are
    replicated by the presets, whatever their shape."""
    compiled = compile_rules()
    for name in (
        "model.layers.3.block_sparse_moe.gate.weight",
        "model.layers.3.self_attn.q_a_proj.weight",
        "model.layers.3.self_attn.kv_a_proj_with_mqa.weight",
        "model.layers.3.self_attn.kv_a_layernorm.weight",
        "model.layers.3.block_sparse_moe.experts.0.w1.weight_scale_inv",
    ):
        assert rule_for(name, (8, 8), compiled) is ShardRule.REPLICATE, name
    assert rule_for("model.layers.3.block_sparse_moe.experts.7.w2.weight", (8, 8), compiled) is ShardRule.DIM1
    assert rule_for("model.layers.3.self_attn.kv_b_proj.weight", (8, 8), compiled) is ShardRule.DIM0
