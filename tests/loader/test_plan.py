"""Read plans: shard rules, spans, coalescing, uneven splits (no tensor data read here)."""

from __future__ import annotations

import random

import pytest
from modelpack.loader.blocks import span_block_copies
from modelpack.loader.plan import ReadPlan, ShardRule, Span, coalesce, compile_rules, rule_for

from modelpack.errors import PlanError
from modelpack.packing.safetensors_format import build_header, parse_header_bytes


def header(tensors: list[tuple[str, str, tuple[int, ...]]], path: str = "m.safetensors"):  # type: ignore[no-untyped-def]
    sizes = {"BF16": 2, "F32": 4, "I64": 8, "U8": 1}
    prefix, spans = build_header((n, d, s, sizes[d] * _numel(s)) for n, d, s in tensors)
    data = spans[-1][1] if spans else 0
    n = len(prefix) - 8
    return parse_header_bytes(path, prefix[:8], prefix[8:], 8 + n + data)


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


LLAMA = [
    ("model.embed_tokens.weight", "BF16", (64, 16)),
    ("model.layers.0.input_layernorm.weight", "BF16", (16,)),
    ("model.layers.0.self_attn.q_proj.weight", "BF16", (16, 16)),
    ("model.layers.0.self_attn.k_proj.weight", "BF16", (8, 16)),
    ("model.layers.0.self_attn.v_proj.weight", "BF16", (8, 16)),
    ("model.layers.0.self_attn.o_proj.weight", "BF16", (16, 16)),
    ("model.layers.0.mlp.gate_proj.weight", "BF16", (32, 16)),
    ("model.layers.0.mlp.up_proj.weight", "BF16", (32, 16)),
    ("model.layers.0.mlp.down_proj.weight", "BF16", (16, 32)),
    ("model.layers.0.self_attn.q_proj.bias", "BF16", (16,)),
    ("model.norm.weight", "BF16", (16,)),
    ("lm_head.weight", "BF16", (64, 16)),
]


def test_presets_follow_llama_and_qwen_conventions() -> None:
    rules = compile_rules()
    got = {n: rule_for(n, s, rules) for n, _, s in LLAMA}
    assert got["model.embed_tokens.weight"] is ShardRule.DIM0
    assert got["lm_head.weight"] is ShardRule.DIM0
    for n in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
        key = next(k for k in got if f".{n}.weight" in k)
        assert got[key] is ShardRule.DIM0, key
    assert got["model.layers.0.self_attn.o_proj.weight"] is ShardRule.DIM1
    assert got["model.layers.0.mlp.down_proj.weight"] is ShardRule.DIM1
    assert got["model.layers.0.input_layernorm.weight"] is ShardRule.REPLICATE
    assert got["model.norm.weight"] is ShardRule.REPLICATE
    assert got["model.layers.0.self_attn.q_proj.bias"] is ShardRule.REPLICATE


def test_caller_rules_win_over_presets() -> None:
    rules = compile_rules({r"o_proj\.weight$": "replicate", r"q_proj\.bias$": ShardRule.DIM0})
    assert rule_for("model.layers.0.self_attn.o_proj.weight", (16, 16), rules) is ShardRule.REPLICATE
    assert rule_for("model.layers.0.self_attn.q_proj.bias", (16,), rules) is ShardRule.DIM0
    assert rule_for("model.layers.0.mlp.down_proj.weight", (16, 32), rules) is ShardRule.DIM1
    with pytest.raises(PlanError, match="unknown shard rule"):
        compile_rules({"x": "dim2"})
    with pytest.raises(PlanError, match="invalid shard-rule pattern"):
        compile_rules({"(": "dim0"})


@pytest.mark.parametrize("tp", [2, 4])
def test_rank_bytes_are_a_tp_fraction_plus_replicated(tp: int) -> None:
    hdr = header(LLAMA)
    total = sum(t.nbytes for t in hdr.tensors)
    plans = [ReadPlan.build({"m.safetensors": hdr}, tp, r) for r in range(tp)]
    for p in plans:
        repl = p.replicated_bytes
        assert p.total_bytes == total
        assert p.bytes_to_read == (total - repl) // tp + repl
    # the ranks' shards of a sharded tensor partition it exactly
    for name, _, shape in LLAMA:
        shards = [next(t for t in p.tensors if t.name == name) for p in plans]
        if shards[0].rule is ShardRule.DIM0:
            assert sum(s.shape[0] for s in shards) == shape[0]
            assert [s.span.offset for s in shards] == sorted({s.span.offset for s in shards})
        elif shards[0].rule is ShardRule.DIM1:
            assert sum(s.shape[1] for s in shards) == shape[1]
            assert all(s.span.rows == shape[0] and s.span.stride == shape[1] * 2 for s in shards)


def test_dim0_is_one_contiguous_range_and_neighbours_coalesce() -> None:
    hdr = header(LLAMA)
    plan = ReadPlan.build({"m.safetensors": hdr}, 1, 0)
    fp = plan.files["m.safetensors"]
    # TP=1: every tensor whole and back to back → one extent covering the data area
    assert fp.extents() == [(hdr.data_start, hdr.file_size)]
    plan2 = ReadPlan.build({"m.safetensors": hdr}, 2, 1)
    q = next(t for t in plan2.tensors if t.name.endswith("q_proj.weight"))
    assert q.span.contiguous and q.span.rows == 1 and q.shape == (8, 16)
    start, _ = hdr.absolute(next(t for t in hdr.tensors if t.name == q.name))
    assert q.span.offset == start + 8 * 16 * 2
    # dim-1 rows stay separate unless the gap is allowed; covering collapses them
    o = plan2.files["m.safetensors"]
    exact = o.extents()
    covering = o.extents(covering=True)
    assert sum(e - s for s, e in exact) == plan2.bytes_to_read
    assert sum(e - s for s, e in covering) > plan2.bytes_to_read
    assert coalesce([(0, 4), (4, 8), (10, 12)]) == [(0, 8), (10, 12)]
    assert coalesce([(0, 4), (6, 8)], max_gap=2) == [(0, 8)]


def test_uneven_split_refused_by_default_and_torch_chunk_compatible_on_request() -> None:
    hdr = header([("x.q_proj.weight", "F32", (10, 3)), ("y.o_proj.weight", "F32", (2, 5))])
    with pytest.raises(PlanError, match=r"x.q_proj.weight.*not divisible by --tp-size 4"):
        ReadPlan.build({"m.safetensors": hdr}, 4, 0)
    rows = [ReadPlan.build({"m.safetensors": hdr}, 4, r, uneven="chunk") for r in range(4)]
    q = [next(t for t in p.tensors if t.name == "x.q_proj.weight").shape for p in rows]
    o = [next(t for t in p.tensors if t.name == "y.o_proj.weight").shape for p in rows]
    assert q == [(3, 3), (3, 3), (3, 3), (1, 3)]  # torch.chunk(10 rows, 4) → 3, 3, 3, 1
    assert o == [(2, 2), (2, 2), (2, 1), (2, 0)]  # torch.chunk(5 cols, 4) → 2, 2, 1 (+ empty)


def test_bad_inputs_are_refused() -> None:
    hdr = header(LLAMA)
    with pytest.raises(PlanError, match="tp_rank"):
        ReadPlan.build({"m.safetensors": hdr}, 2, 2)
    with pytest.raises(PlanError, match="tp_size"):
        ReadPlan.build({"m.safetensors": hdr}, 0, 0)
    other = header([("lm_head.weight", "BF16", (64, 16))], path="b.safetensors")
    with pytest.raises(PlanError, match=r"'lm_head.weight' appears in both"):
        ReadPlan.build({"a.safetensors": hdr, "b.safetensors": other}, 1, 0)


def test_span_block_copies_reassemble_any_span_from_any_blocking() -> None:
    rng = random.Random(7)
    for _ in range(300):
        length = rng.randint(1, 40)
        stride = length + rng.randint(0, 40)
        rows = rng.randint(1, 12)
        offset = rng.randint(0, 50)
        span = Span(offset, length, stride, rows)
        file = bytes(rng.randrange(256) for _ in range(span.end + 20))
        want = b"".join(file[s:e] for s, e in span.row_extents())
        block = rng.randint(1, 64)
        got = bytearray(span.nbytes)
        for b0 in range(0, len(file), block):
            b1 = min(len(file), b0 + block)
            for s, d, ln, st, r in span_block_copies(span, b0, b1):
                assert b0 <= s and s + (r - 1) * st + ln <= b1
                for k in range(r):
                    got[d + k * ln : d + (k + 1) * ln] = file[s + k * st : s + k * st + ln]
        assert bytes(got) == want, (span, block)


def test_shared_chunk_owners_cover_every_needed_chunk_once_in_contiguous_balanced_runs() -> None:
    from modelpack.loader.shared_read import chunk_owners

    needs = [set(range(0, 10)) | set(range(40, 100)), set(range(10, 20)) | set(range(40, 100)), {5, 15}]
    owner, shared = chunk_owners(needs, local={0})
    assert set(owner) == set().union(*needs) - {0}
    assert shared == sorted({5, 15} | set(range(40, 100)))
    for c, r in owner.items():
        if c not in shared:
            assert c in needs[r]  # a chunk one rank needs is that rank's own read
    runs = [owner[c] for c in shared]
    assert runs == sorted(runs)  # contiguous runs, rank 0 first
    counts = [runs.count(r) for r in range(3)]
    assert max(counts) - min(counts) <= 1
