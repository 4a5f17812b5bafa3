"""Mixture-of-experts tensors and the expert-parallel layout (docs/loader.md#expert-parallel-read-plans).

With ``ep_size > 1`` every tensor name is first searched against the expert rules (a table like
the TP shard rules: caller rules first, then ``DEFAULT_EXPERT_RULES``, first match wins). A rule
says what the tensor is:

- ``routed``: a routed expert's tensor. With a named group ``expert`` in the pattern (``…experts.17.
  gate_proj.weight``) the group is the expert's index and the tensor belongs whole to the rank
  holding that expert; without it (``…experts.gate_up_proj``, fused/stacked 3-D) the tensor's first
  dimension is the expert index and a rank reads only its experts' rows;
- ``shared``: a shared expert (DeepSeek/GLM ``shared_experts``, Qwen2-MoE ``shared_expert``): on
  every EP rank, TP-split by the TP rules like any dense MLP;
- ``router``: the router/gate (and its bias): replicated on every rank, whatever the TP rules say.

Names no expert rule matches follow the TP rules. The number of routed experts comes from
``config.json`` (``n_routed_experts``, ``num_experts``, ``num_local_experts``, also under
``text_config``), else from the names themselves; names and config must agree.

The expert → rank map is vLLM's: ``linear`` (default; rank r holds a contiguous run, the first
``E % ep_size`` ranks one more expert), ``round_robin`` (expert e on rank e % ep_size) or an
explicit sequence of ranks, one per expert.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

from modelpack import boundedjson
from modelpack.errors import DocumentError, PlanError

MAX_CONFIG_BYTES = 4 * 1024 * 1024
#: config.json keys holding the number of routed experts (DeepSeek/GLM, Qwen-MoE, Mixtral)
NUM_EXPERTS_KEYS = ("n_routed_experts", "num_experts", "num_local_experts")
#: more routed experts than any model ships: a bound on what a hostile config.json can ask for
MAX_EXPERTS = 1 << 16


class ExpertKind(str, Enum):
    """What an expert rule says a tensor is."""

    ROUTED = "routed"  # a routed expert's tensor: held by the rank its expert is mapped to
    SHARED = "shared"  # a shared expert: on every rank, split by the TP rules
    ROUTER = "router"  # the router / gate: replicated

    @classmethod
    def parse(cls, value: ExpertKind | str) -> ExpertKind:
        if isinstance(value, ExpertKind):
            return value
        try:
            return cls(str(value).lower())
        except ValueError as exc:
            raise PlanError(f"unknown expert kind {value!r}: use routed, shared or router") from exc


# Presets for DeepSeek-V2/V3, GLM-4.5+ MoE, Qwen2/3-MoE, Mixtral, Llama-4 and fused 3-D layouts
# (regexes, searched; first match wins).
DEFAULT_EXPERT_RULES: tuple[tuple[str, ExpertKind], ...] = (
    (r"(^|\.)shared_expert_gate\.", ExpertKind.ROUTER),  # Qwen2-MoE: the shared expert's own gate
    (r"(^|\.)shared_experts?\.", ExpertKind.SHARED),  # DeepSeek/GLM shared_experts, Qwen shared_expert
    (r"(^|\.)(mlp|block_sparse_moe|feed_forward|moe)\.(gate|router)\.[^.]+$", ExpertKind.ROUTER),
    (r"(^|\.)experts\.(?P<expert>\d+)\.", ExpertKind.ROUTED),  # …experts.{i}.… per-expert tensors
    (r"(^|\.)experts\.[A-Za-z_]\w*(\.[A-Za-z_]\w*)?$", ExpertKind.ROUTED),  # stacked: dim 0 = expert
)

ExpertRulesLike = Mapping[str, "ExpertKind | str"] | Sequence[tuple[str, "ExpertKind | str"]] | None
ExpertMapLike = str | Sequence[int]

CompiledExpertRules = list[tuple[re.Pattern[str], ExpertKind]]


def compile_expert_rules(rules: ExpertRulesLike = None, *, presets: bool = True) -> CompiledExpertRules:
    """Caller rules first (in order), then the presets. Patterns are regexes searched in the name."""
    items: list[tuple[str, ExpertKind | str]] = []
    if rules is not None:
        items.extend(rules.items() if isinstance(rules, Mapping) else list(rules))
    if presets:
        items.extend(DEFAULT_EXPERT_RULES)
    compiled = []
    for pattern, kind in items:
        try:
            compiled.append((re.compile(pattern), ExpertKind.parse(kind)))
        except re.error as exc:
            raise PlanError(f"invalid expert-rule pattern {pattern!r}: {exc}") from exc
    return compiled


def match_expert(name: str, compiled: CompiledExpertRules) -> tuple[ExpertKind, int | None] | None:
    """(kind, expert index or None) of the first rule matching ``name``; None: no expert rule."""
    for pattern, kind in compiled:
        m = pattern.search(name)
        if m is None:
            continue
        index = m.groupdict().get("expert") if kind is ExpertKind.ROUTED else None
        return kind, int(index) if index is not None else None
    return None


def num_experts_from_config(raw: bytes | None) -> int | None:
    """The routed-expert count ``config.json`` declares (None: no config, or no such key)."""
    if not raw:
        return None
    try:
        doc = boundedjson.loads(raw, what="config.json", max_bytes=MAX_CONFIG_BYTES)
    except DocumentError:
        return None
    for where in (doc, doc.get("text_config") if isinstance(doc, dict) else None):
        if not isinstance(where, dict):
            continue
        for key in NUM_EXPERTS_KEYS:
            if key not in where or where[key] is None:
                continue
            value = where[key]
            if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MAX_EXPERTS:
                raise PlanError(
                    f"config.json: {key} is {str(value)[:40]!r}, not a number of experts in [1, {MAX_EXPERTS}]"
                )
            return value
    return None


def weight_block_size(raw: bytes | None) -> tuple[int, int] | None:
    """``quantization_config.weight_block_size`` of a ``config.json`` (block-wise FP8: [rows,
    columns] per scale)."""
    if not raw:
        return None
    try:
        doc = boundedjson.loads(raw, what="config.json", max_bytes=MAX_CONFIG_BYTES)
    except DocumentError:
        return None
    return weight_block_size_of(doc)


def weight_block_size_of(config: object) -> tuple[int, int] | None:
    """``quantization_config.weight_block_size`` of a parsed config: two positive integers, else
    None (absent, or not a block size: a caller that must not guess checks whether it was declared)."""
    qc = config.get("quantization_config") if isinstance(config, Mapping) else None
    block = qc.get("weight_block_size") if isinstance(qc, Mapping) else None
    if (
        isinstance(block, list)
        and len(block) == 2
        and all(isinstance(b, int) and not isinstance(b, bool) and 0 < b <= 1 << 20 for b in block)
    ):
        return block[0], block[1]
    return None


@dataclass(frozen=True)
class ExpertLayout:
    """How routed experts are spread over the expert-parallel ranks."""

    ep_size: int = 1
    ep_rank: int = 0
    expert_map: ExpertMapLike = "linear"  # "linear" | "round_robin" | one rank per expert
    rules: ExpertRulesLike = None  # expert rules searched in tensor names, before the presets
    presets: bool = True

    def check(self) -> None:
        if isinstance(self.ep_size, bool) or not isinstance(self.ep_size, int) or self.ep_size < 1:
            raise PlanError(f"ep_size must be a positive integer, got {self.ep_size!r}")
        if (
            isinstance(self.ep_rank, bool)
            or not isinstance(self.ep_rank, int)
            or not 0 <= self.ep_rank < self.ep_size
        ):
            raise PlanError(f"ep_rank must be in [0, {self.ep_size}), got {self.ep_rank!r}")
        if isinstance(self.expert_map, str) and self.expert_map not in ("linear", "round_robin"):
            raise PlanError(
                f"expert_map {self.expert_map!r}: use 'linear', 'round_robin' or one rank per expert"
            )

    def owners(self, num_experts: int) -> list[int]:
        """The rank holding each expert."""
        ep, m = self.ep_size, self.expert_map
        if m == "linear":
            base, extra = divmod(num_experts, ep)
            out: list[int] = []
            for r in range(ep):
                out.extend([r] * (base + (1 if r < extra else 0)))
            return out
        if m == "round_robin":
            return [e % ep for e in range(num_experts)]
        ranks: list[object] = list(m)
        if len(ranks) != num_experts:
            raise PlanError(f"expert_map has {len(ranks)} entries, the model has {num_experts} experts")
        placed: list[int] = []
        for e, rank in enumerate(ranks):
            if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < ep:
                raise PlanError(
                    f"expert_map puts expert {e} on rank {rank!r}, outside [0, {ep}) (ep_size {ep})"
                )
            placed.append(rank)
        return placed

    def digest_doc(self) -> list[object]:
        """What the ranks of a group must agree on (rules and map; not the rank)."""
        m = self.expert_map if isinstance(self.expert_map, str) else list(self.expert_map)
        return [self.ep_size, m, repr(self.rules), self.presets]


def experts_of(owners: Sequence[int], rank: int) -> tuple[int, ...]:
    return tuple(e for e, r in enumerate(owners) if r == rank)


def stacked_rows(experts: Sequence[int], what: str) -> tuple[int, int, int]:
    """(first, step, count) of ``experts`` as one strided run of a stacked tensor's rows."""
    if not experts:
        return 0, 1, 0
    if len(experts) == 1:
        return experts[0], 1, 1
    step = experts[1] - experts[0]
    if step <= 0 or any(b - a != step for a, b in itertools.pairwise(experts)):
        raise PlanError(
            f"{what}: this rank's experts {list(experts)} are not one evenly spaced run of the stacked "
            "tensor's rows; use the linear or round_robin expert map, or per-expert tensors"
        )
    return experts[0], step, len(experts)


__all__ = [
    "DEFAULT_EXPERT_RULES",
    "NUM_EXPERTS_KEYS",
    "ExpertKind",
    "ExpertLayout",
    "ExpertMapLike",
    "ExpertRulesLike",
    "compile_expert_rules",
    "experts_of",
    "match_expert",
    "num_experts_from_config",
    "stacked_rows",
    "weight_block_size",
    "weight_block_size_of",
]
