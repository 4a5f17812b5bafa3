"""Expert-parallel read plans: each EP rank reads only its routed experts, the replicated tensors
(router, norms) and its TP share of the rest, byte-identical to ``safetensors``' own load."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from modelpack.loader import LoaderOptions, LoadStats, load_state_dict
from modelpack.loader.experts import DEFAULT_EXPERT_RULES, ExpertKind, compile_expert_rules, match_expert
from modelpack.loader.plan import ShardRule

from modelpack.errors import PlanError
from modelpack.events import read_events
from tests.loader_helpers import reference_tensors
from tests.moe_checkpoints import expert_of, is_stacked, linear_experts, write_moe

EP = 4
E = 8
DIM0_NAMES = (
    "q_proj.weight",
    "k_proj.weight",
    "v_proj.weight",
    "gate_proj.weight",
    "up_proj.weight",
    "embed_tokens.weight",
    "lm_head.weight",
)


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    return {n: write_moe(root / n, n, experts=E) for n in ("deepseek", "mixtral", "stacked")}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _headers(stats: LoadStats) -> int:
    assert stats.plan is not None
    return sum(8 + fp.header.header_size for fp in stats.plan.files.values())


def test_the_rule_table_recognises_the_common_moe_layouts() -> None:
    """Routed experts (per-expert and stacked), shared experts and routers of DeepSeek-V2/V3,
    GLM-4.5 MoE, Qwen2/3-MoE, Mixtral and fused 3-D layouts are told apart by name."""
    compiled = compile_expert_rules()
    cases = {
        "model.layers.3.mlp.experts.17.gate_proj.weight": (ExpertKind.ROUTED, 17),
        "model.layers.3.mlp.experts.17.down_proj.weight_scale_inv": (ExpertKind.ROUTED, 17),
        "model.layers.0.block_sparse_moe.experts.7.w2.weight": (ExpertKind.ROUTED, 7),
        "model.layers.1.mlp.experts.gate_up_proj": (ExpertKind.ROUTED, None),
        "model.layers.1.mlp.experts.down_proj_scale_inv": (ExpertKind.ROUTED, None),
        "model.layers.1.feed_forward.experts.gate_up_proj": (ExpertKind.ROUTED, None),
        "model.layers.1.mlp.experts.w13_weight": (ExpertKind.ROUTED, None),
        "model.layers.3.mlp.shared_experts.gate_proj.weight": (ExpertKind.SHARED, None),
        "model.layers.3.mlp.shared_expert.down_proj.weight": (ExpertKind.SHARED, None),
        "model.layers.3.mlp.shared_expert_gate.weight": (ExpertKind.ROUTER, None),
        "model.layers.3.mlp.gate.weight": (ExpertKind.ROUTER, None),
        "model.layers.3.mlp.gate.e_score_correction_bias": (ExpertKind.ROUTER, None),
        "model.layers.0.block_sparse_moe.gate.weight": (ExpertKind.ROUTER, None),
        "model.layers.0.feed_forward.router.weight": (ExpertKind.ROUTER, None),
    }
    for name, want in cases.items():
        assert match_expert(name, compiled) == want, name
    for name in (
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.0.self_attn.o_proj.weight",
        "lm_head.weight",
    ):
        assert match_expert(name, compiled) is None, name
    # a user's rule comes first: here a model that calls its experts "moe.ffn.{i}"
    custom = compile_expert_rules([(r"(^|\.)ffn\.(?P<expert>\d+)\.", "routed")])
    assert match_expert("layers.2.moe.ffn.5.w1.weight", custom) == (ExpertKind.ROUTED, 5)
    assert len(custom) == len(DEFAULT_EXPERT_RULES) + 1
    with pytest.raises(PlanError, match="unknown expert kind"):
        compile_expert_rules([("x", "sideways")])


@pytest.mark.parametrize("naming", ["deepseek", "mixtral", "stacked"])
def test_each_ep_rank_reads_only_its_experts_and_equals_safetensors(
    moe: dict[str, Path], naming: str, tmp_path: Path
) -> None:
    ckpt = moe[naming]
    ref = reference_tensors(ckpt)
    model = sum(_nbytes(t) for t in ref.values())
    for rank in range(EP):
        mine = linear_experts(E, EP, rank)
        stats = LoadStats()
        events = tmp_path / f"ev{rank}.jsonl"
        sd = load_state_dict(
            str(ckpt), ep_size=EP, ep_rank=rank, allow_unverified=True, stats=stats, events=str(events)
        )
        want: dict[str, torch.Tensor] = {}
        for name, full in ref.items():
            e = expert_of(name)
            if e is not None:
                if e in mine:
                    want[name] = full
            elif is_stacked(name):
                want[name] = full[mine[0] : mine[-1] + 1]
            else:
                want[name] = full
        assert sorted(sd) == sorted(want), rank
        for name, t in want.items():
            assert sd[name].dtype == t.dtype and sd[name].shape == t.shape, name
            assert torch.equal(sd[name].view(torch.uint8), t.contiguous().view(torch.uint8)), name
        share = sum(_nbytes(t) for n, t in want.items() if ".experts." in n)
        replicated = sum(_nbytes(t) for n, t in want.items() if ".experts." not in n)
        experts_all = sum(_nbytes(t) for n, t in ref.items() if ".experts." in n)
        # the reader's own counter: its experts + replicated (+ 5 %), plus the headers
        assert stats.bytes_read <= (share + replicated) * 1.05 + _headers(stats), (rank, stats.bytes_read)
        assert stats.bytes_to_read == share + replicated
        # and the accounting says the same, per split kind and against the model's size
        split = stats.bytes_by_split
        assert split["expert"] == {"tensorBytes": experts_all, "planned": share, "read": share}, split
        assert sum(v["read"] for v in split.values()) == stats.bytes_read
        assert stats.plan is not None and stats.plan.total_bytes == model
        assert stats.plan.experts == tuple(mine)
        done = [e for e in read_events(str(events)) if e["event"] == "loader.read_done"]
        assert done[0]["ep_size"] == EP and done[0]["ep_rank"] == rank
        assert done[0]["model_bytes"] == model and done[0]["bytes"] == stats.bytes_read
        assert done[0]["bytes_by_split"]["expert"]["read"] == share


def test_ep_with_tp_splits_the_dense_and_shared_tensors_and_keeps_experts_whole(moe: dict[str, Path]) -> None:
    """TP=2 × EP=4 (vLLM's TP with expert parallelism: EP rank r is TP rank r % 2): attention and
    shared experts are TP-split, the router replicated, each routed expert whole on one rank."""
    ref = reference_tensors(moe["deepseek"])
    for rank in range(EP):
        sd = load_state_dict(
            str(moe["deepseek"]), tp_size=2, tp_rank=rank % 2, ep_size=EP, ep_rank=rank, allow_unverified=True
        )
        tp = rank % 2
        for name, t in sd.items():
            full = ref[name]
            if expert_of(name) is not None:
                assert expert_of(name) in linear_experts(E, EP, rank) and torch.equal(t, full), name
            elif name.endswith(DIM0_NAMES):
                assert torch.equal(t, full.chunk(2, 0)[tp]), name
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                assert torch.equal(t, full.chunk(2, 1)[tp]), name
            else:
                assert torch.equal(t, full), name
        assert any("shared_experts" in n for n in sd)
        assert torch.equal(sd["model.layers.0.mlp.gate.weight"], ref["model.layers.0.mlp.gate.weight"])


def test_round_robin_and_explicit_expert_maps(moe: dict[str, Path]) -> None:
    """vLLM's round-robin placement (expert e on rank e % EP) reads a stacked tensor's rows as one
    strided run; an explicit expert→rank map places per-expert tensors anywhere."""
    ref = reference_tensors(moe["stacked"])
    for rank in range(EP):
        sd = load_state_dict(
            str(moe["stacked"]), ep_size=EP, ep_rank=rank, expert_map="round_robin", allow_unverified=True
        )
        for name in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"):
            assert torch.equal(sd[name], ref[name][rank::EP]), (name, rank)
    placement = [3, 0, 2, 1, 1, 2, 0, 3]
    ref = reference_tensors(moe["deepseek"])
    for rank in range(EP):
        stats = LoadStats()
        sd = load_state_dict(
            str(moe["deepseek"]),
            ep_size=EP,
            ep_rank=rank,
            expert_map=placement,
            allow_unverified=True,
            stats=stats,
        )
        held = {expert_of(n) for n in sd} - {None}
        assert held == {e for e, r in enumerate(placement) if r == rank}
        assert stats.plan is not None and stats.plan.experts == tuple(sorted(held))
        for name, t in sd.items():
            assert torch.equal(t, ref[name]), name
    # a stacked tensor's rows for experts {0, 1, 3} are no single (strided) run: refused, named
    with pytest.raises(PlanError, match=r"experts\.(gate_up|down)_proj.*\[0, 1, 3\]"):
        load_state_dict(
            str(moe["stacked"]),
            ep_size=2,
            ep_rank=0,
            expert_map=[0, 0, 1, 0, 1, 1, 1, 1],
            allow_unverified=True,
        )


def _edit_config(ckpt: Path, tmp_path: Path, **changes: Any) -> Path:
    import shutil

    dst = tmp_path / "edited"
    shutil.copytree(ckpt, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_hostile_or_inconsistent_expert_layouts_are_refused(moe: dict[str, Path], tmp_path: Path) -> None:
    """config.json and the tensor names must agree, and the EP layout must be one the ranks can
    hold: an expert past config's count, a stacked tensor whose first dimension is not the
    expert count, a bad map or rank, a non-integer count: refused before any data is read."""
    few = _edit_config(moe["deepseek"], tmp_path, n_routed_experts=4)
    with pytest.raises(PlanError, match=r"experts\.4\..*4 experts"):
        load_state_dict(str(few), ep_size=2, ep_rank=0, allow_unverified=True)
    (tmp_path / "edited").rename(tmp_path / "few")
    more = _edit_config(moe["stacked"], tmp_path, num_experts=16)
    with pytest.raises(PlanError, match=r"experts\.(gate_up|down)_proj.*first dimension 8.*16 experts"):
        load_state_dict(str(more), ep_size=2, ep_rank=0, allow_unverified=True)
    (tmp_path / "edited").rename(tmp_path / "more")
    bad = _edit_config(moe["mixtral"], tmp_path, num_local_experts="eight")
    with pytest.raises(PlanError, match="num_local_experts"):
        load_state_dict(str(bad), ep_size=2, ep_rank=0, allow_unverified=True)
    src = str(moe["mixtral"])
    for kwargs, needle in (
        ({"ep_size": 2, "ep_rank": 2}, "ep_rank"),
        ({"ep_size": 0, "ep_rank": 0}, "ep_size"),
        ({"ep_size": 2, "ep_rank": 0, "expert_map": [0, 1]}, "8 experts"),
        ({"ep_size": 2, "ep_rank": 0, "expert_map": [0, 1, 2, 0, 1, 0, 1, 0]}, "rank 2"),
        ({"ep_size": 2, "ep_rank": 0, "expert_map": "diagonal"}, "expert_map"),
        ({"ep_size": 2, "ep_rank": 0, "layout": "sharded_state"}, "sharded_state"),
    ):
        with pytest.raises(PlanError, match=needle):
            load_state_dict(src, allow_unverified=True, **kwargs)


def test_without_config_the_expert_count_comes_from_the_names(moe: dict[str, Path], tmp_path: Path) -> None:
    import shutil

    dst = tmp_path / "noconfig"
    shutil.copytree(moe["mixtral"], dst)
    (dst / "config.json").unlink()
    sd = load_state_dict(str(dst), ep_size=EP, ep_rank=3, allow_unverified=True)
    assert {expert_of(n) for n in sd} - {None} == {6, 7}


def test_load_cli_takes_the_ep_layout_and_reports_bytes_against_the_model(moe: dict[str, Path]) -> None:
    from click.testing import CliRunner

    from modelpack.cli import main

    ref = reference_tensors(moe["mixtral"])
    model = sum(_nbytes(t) for t in ref.values())
    args = ["load", str(moe["mixtral"]), "--allow-unverified", "--ep-size", "4", "--ep-rank", "1", "--json"]
    out = CliRunner().invoke(main, args)
    assert out.exit_code == 0, out.output
    doc = json.loads(out.output)
    assert doc["epSize"] == 4 and doc["epRank"] == 1 and doc["experts"] == [2, 3]
    assert doc["modelBytes"] == model
    assert doc["bytesToRead"] < 0.4 * model and doc["bytesRead"] < 0.4 * model
    assert doc["bytesBySplit"]["expert"]["planned"] == sum(
        _nbytes(t) for n, t in ref.items() if expert_of(n) in (2, 3)
    )
    out = CliRunner().invoke(main, [*args[:-1], "--expert-map", "round_robin"])
    assert out.exit_code == 0, out.output
    assert "experts 1, 5" in out.output
    out = CliRunner().invoke(
        main, ["load", str(moe["mixtral"]), "--allow-unverified", "--ep-size", "2", "--ep-rank", "2"]
    )
    assert out.exit_code == 2 and "Traceback" not in out.output


def test_dense_tensors_stay_as_before_when_ep_is_off(moe: dict[str, Path]) -> None:
    """EP=1: no expert rules apply (a TP rank shards per-expert projections as vLLM's TP-only MoE)."""
    stats = LoadStats()
    load_state_dict(
        str(moe["deepseek"]),
        tp_size=2,
        tp_rank=0,
        allow_unverified=True,
        stats=stats,
        options=LoaderOptions(),
    )
    assert stats.plan is not None
    rules = {t.name: t.rule for t in stats.plan.tensors}
    assert rules["model.layers.0.mlp.experts.3.gate_proj.weight"] is ShardRule.DIM0
    assert rules["model.layers.0.mlp.experts.3.down_proj.weight"] is ShardRule.DIM1
    assert ShardRule.EXPERT not in rules.values()


def test_placements_follow_vllm_and_group_ranks_must_agree_on_them() -> None:
    """Linear placement gives the first E % EP ranks one more expert (vLLM's determine_expert_map);
    round-robin strides; the plan digest the ranks of a group compare differs when their EP
    layouts do; in a group EP rank r must be TP rank r % tp_size."""
    from modelpack.loader.experts import ExpertLayout, experts_of
    from modelpack.loader.plan import ReadPlan, group_position

    owners = ExpertLayout(4, 0).owners(6)
    assert [experts_of(owners, r) for r in range(4)] == [(0, 1), (2, 3), (4,), (5,)]
    owners = ExpertLayout(4, 0, "round_robin").owners(6)
    assert [experts_of(owners, r) for r in range(4)] == [(0, 4), (1, 5), (2,), (3,)]
    assert group_position(2, 1, 1, 0, True) == (2, 1)
    assert group_position(2, 1, 4, 3, True) == (4, 3)
    with pytest.raises(PlanError, match="EP rank 2 is TP rank 1"):
        group_position(2, 1, 4, 2, True)
    assert group_position(2, 1, 4, 2, False) == (4, 2)  # standalone ranks may pair them freely
    from modelpack.packing.safetensors_format import build_header, parse_header_bytes

    prefix, _ = build_header(
        [
            ("layers.0.mlp.experts.gate_up_proj", "BF16", (4, 8, 8), 512),
            ("layers.0.mlp.gate.weight", "BF16", (4, 8), 64),
        ]
    )
    hdr = parse_header_bytes("m.safetensors", prefix[:8], prefix[8:], len(prefix) + 576)
    plans = [
        ReadPlan.build({"m.safetensors": hdr}, experts=ExpertLayout(2, r, m))
        for m in ("linear", "round_robin")
        for r in (0, 1)
    ]
    assert plans[0].rules_digest == plans[1].rules_digest != plans[2].rules_digest == plans[3].rules_digest
    assert [p.experts for p in plans] == [(0, 1), (2, 3), (0, 2), (1, 3)]
    assert plans[2].tensors[0].span.rows == 2 and plans[2].tensors[0].shape == (2, 8, 8)
