"""Tensor-parallel shard rules: which rule splits a tensor (by its name), and a rank's part of a
dimension (docs/loader.md#tensor-parallel-read-plans). ``plan`` builds read plans from them."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from enum import Enum

from modelpack.errors import PlanError


class ShardRule(str, Enum):
    """How one tensor is split across the ranks of a tensor-parallel group."""

    REPLICATE = "replicate"
    DIM0 = "dim0"  # column-parallel (output rows) / vocab-parallel: one contiguous range per rank
    DIM1 = "dim1"  # row-parallel (input columns): a strided run of rows per rank
    # a routed expert's tensor under expert parallelism (experts.py): whole on the rank holding its
    # expert, or, stacked, that rank's rows; set by the expert rules, never a TP rule
    EXPERT = "expert"

    @classmethod
    def parse(cls, value: ShardRule | str) -> ShardRule:
        if isinstance(value, ShardRule) and value is not ShardRule.EXPERT:
            return value
        try:
            rule = cls(str(value.value if isinstance(value, ShardRule) else value).lower())
        except ValueError as exc:
            raise PlanError(f"unknown shard rule {value!r}: use replicate, dim0 or dim1") from exc
        if rule is ShardRule.EXPERT:
            raise PlanError("'expert' is not a TP shard rule: routed experts are named by the expert rules")
        return rule


# Presets for Llama / Qwen / Mistral-style names, Mixtral's experts (``w1``/``w3`` column-, ``w2``
# row-parallel) and DeepSeek-V2/V3's latent attention (``q_b_proj``/``kv_b_proj`` column-parallel by
# heads; the low-rank ``q_a_proj``/``kv_a_proj_with_mqa`` match nothing and are replicated, as
# vLLM's MLA layers hold them) (regexes, searched; first match wins). Only ``.weight`` matrices are
# sharded; 1-D tensors (norms, biases) fall through to replicate. Callers whose model shards biases
# with their columns (Qwen's q/k/v biases under vLLM) add a rule such as
# ``{r"\.(q|k|v)_proj\.bias$": "dim0"}``.
#: Mixtral's routed experts, named ``experts.{i}.w1`` (gate) / ``w3`` (up) / ``w2`` (down)
MIXTRAL_EXPERT_COLUMN = r"(^|\.)experts\.\d+\.(w1|w3)\.weight$"
MIXTRAL_EXPERT_ROW = r"(^|\.)experts\.\d+\.w2\.weight$"

DEFAULT_RULES: tuple[tuple[str, ShardRule], ...] = (
    (
        r"(^|\.)(q_proj|k_proj|v_proj|qkv_proj|gate_proj|up_proj|gate_up_proj|q_b_proj|kv_b_proj)\.weight$",
        ShardRule.DIM0,
    ),
    (r"(^|\.)(o_proj|down_proj)\.weight$", ShardRule.DIM1),
    (MIXTRAL_EXPERT_COLUMN, ShardRule.DIM0),
    (MIXTRAL_EXPERT_ROW, ShardRule.DIM1),
    (r"(^|\.)(embed_tokens|lm_head)\.weight$", ShardRule.DIM0),
)

RulesLike = Mapping[str, "ShardRule | str"] | Sequence[tuple[str, "ShardRule | str"]] | None


def compile_rules(
    rules: RulesLike = None, *, presets: bool = True
) -> list[tuple[re.Pattern[str], ShardRule]]:
    """Caller rules first (in order), then the presets. Patterns are regexes searched in the name."""
    items: list[tuple[str, ShardRule | str]] = []
    if rules is not None:
        items.extend(rules.items() if isinstance(rules, Mapping) else list(rules))
    if presets:
        items.extend(DEFAULT_RULES)
    compiled = []
    for pattern, rule in items:
        try:
            compiled.append((re.compile(pattern), ShardRule.parse(rule)))
        except re.error as exc:
            raise PlanError(f"invalid shard-rule pattern {pattern!r}: {exc}") from exc
    return compiled


def rule_for(
    name: str, shape: Sequence[int], compiled: Sequence[tuple[re.Pattern[str], ShardRule]]
) -> ShardRule:
    return match_rule(name, shape, compiled) or ShardRule.REPLICATE


def match_rule(
    name: str, shape: Sequence[int], compiled: Sequence[tuple[re.Pattern[str], ShardRule]]
) -> ShardRule | None:
    """The rule of the first pattern matching ``name`` (None: no pattern matches)."""
    for pattern, rule in compiled:
        if pattern.search(name):
            if rule is ShardRule.DIM1 and len(shape) < 2:
                # a dim-1 rule matched a vector: only explicit caller rules may shard vectors,
                # and they can only do so along dim 0
                return ShardRule.REPLICATE
            if rule is ShardRule.DIM0 and len(shape) < 1:
                return ShardRule.REPLICATE
            return rule
    return None


def shard_bounds(n: int, tp_size: int, tp_rank: int, *, uneven: str, what: str) -> tuple[int, int]:
    """[begin, end) of rank ``tp_rank``'s part of a dimension of length ``n``."""
    if n % tp_size == 0:
        size = n // tp_size
        return tp_rank * size, (tp_rank + 1) * size
    if uneven == "chunk":
        size = -(-n // tp_size)
        begin = min(n, tp_rank * size)
        return begin, min(n, begin + size)
    raise PlanError(
        f"{what}: dimension of {n} is not divisible by --tp-size {tp_size}; "
        "pad the model, replicate the tensor with a rule, or pass --uneven chunk (a torch.chunk split)"
    )


__all__ = [
    "DEFAULT_RULES",
    "MIXTRAL_EXPERT_COLUMN",
    "MIXTRAL_EXPERT_ROW",
    "RulesLike",
    "ShardRule",
    "compile_rules",
    "match_rule",
    "rule_for",
    "shard_bounds",
]
