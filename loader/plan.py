"""Per-rank read plans: which bytes of which file a tensor-parallel rank needs
(docs/loader.md#tensor-parallel-read-plans).

Built from the safetensors headers alone, before any tensor data is read. Each tensor gets one
``Span``: a contiguous range (replicated tensors and dim-0 shards) or a strided run of rows
(dim-1 shards: ``rows`` runs of ``length`` bytes every ``stride`` bytes). A dim-1 shard is thus
described exactly; readers choose how to fetch it. Local files gather the rows (so a rank reads
≈ 1/TP of the bytes); remote readers fetch the covering range (``Span.offset`` … ``Span.end``)
and slice after, because thousands of tiny HTTP ranges cost more than the extra bytes.

Uneven splits: by default a dimension that TP does not divide is refused (``PlanError``), as
vLLM and Megatron do, because a silent uneven split breaks the matching model code.
``uneven="chunk"`` instead splits exactly like ``torch.chunk(t, tp_size, dim)[tp_rank]``
(chunks of ceil(n / tp_size), the last shorter, ranks past the end get an empty shard).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from modelpack.loader.experts import (
    ExpertKind,
    ExpertLayout,
    compile_expert_rules,
    experts_of,
    match_expert,
    num_experts_from_config,
    stacked_rows,
    weight_block_size,
)
from modelpack.loader.tp_rules import DEFAULT_RULES as DEFAULT_RULES  # re-exported: where callers find it
from modelpack.loader.tp_rules import (
    RulesLike,
    ShardRule,
    compile_rules,
    match_rule,
    shard_bounds,
)
from modelpack.loader.tp_rules import rule_for as rule_for  # re-exported

from modelpack.errors import PlanError
from modelpack.packing.safetensors_format import DTYPE_BITS, SafetensorsHeader, TensorInfo

if TYPE_CHECKING:
    import torch


def group_position(tp_size: int, tp_rank: int, ep_size: int, ep_rank: int, grouped: bool) -> tuple[int, int]:
    """(size, rank) of the process group that shares a load's reads: the TP ranks, or with
    expert parallelism the EP ranks, where EP rank r must be TP rank r % tp_size (vLLM's order)."""
    if ep_size == 1:
        return tp_size, tp_rank
    if grouped and (ep_size % tp_size or tp_rank != ep_rank % tp_size):
        raise PlanError(
            f"LoaderOptions.group with --ep-size {ep_size}: the group holds the EP ranks in order and EP "
            f"rank r is TP rank r % tp_size; EP rank {ep_rank} is TP rank {tp_rank} of {tp_size}"
        )
    return ep_size, ep_rank


@dataclass(frozen=True)
class Span:
    """File bytes → destination bytes: ``rows`` runs of ``length`` bytes, ``stride`` apart.

    Row ``k`` is file bytes ``[offset + k*stride, +length)`` and lands at destination bytes
    ``[k*length, +length)`` (destinations are contiguous). A contiguous span has ``rows == 1``.
    """

    offset: int
    length: int
    stride: int
    rows: int

    @property
    def nbytes(self) -> int:
        return self.length * self.rows

    @property
    def end(self) -> int:
        """End of the covering range."""
        if self.rows == 0 or self.length == 0:
            return self.offset
        return self.offset + (self.rows - 1) * self.stride + self.length

    @property
    def contiguous(self) -> bool:
        return self.rows <= 1 or self.stride == self.length

    def row_extents(self) -> Iterable[tuple[int, int]]:
        if self.contiguous:
            if self.nbytes:
                yield self.offset, self.offset + self.nbytes
            return
        for k in range(self.rows):
            start = self.offset + k * self.stride
            yield start, start + self.length


@dataclass(frozen=True)
class TensorRead:
    """One tensor as this rank sees it: where it lives, its full and shard shape, and its bytes."""

    name: str
    file: str  # relative path of the safetensors file (= the layer's filepath)
    dtype: str
    full_shape: tuple[int, ...]
    shape: tuple[int, ...]
    rule: ShardRule
    span: Span
    # the part of the full tensor this rank holds: (dim, start, stop, step) along one dimension;
    # None: all of it
    part: tuple[int, int, int, int] | None = None

    @property
    def nbytes(self) -> int:
        return self.span.nbytes

    def select(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of ``full`` (the whole tensor), as a view."""
        if self.part is None:
            return full
        dim, start, stop, step = self.part
        index: list[slice] = [slice(None)] * dim + [slice(start, stop, step)]
        return full[tuple(index)]

    @property
    def sharded(self) -> bool:
        return self.shape != self.full_shape


@dataclass
class FilePlan:
    file: str
    header: SafetensorsHeader
    tensors: list[TensorRead] = field(default_factory=list)
    # every tensor of the file → its split kind, those this rank skips included (accounting)
    kinds: dict[str, str] = field(default_factory=dict)

    @property
    def bytes_to_read(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def extents(self, max_gap: int = 0, *, covering: bool = False) -> list[tuple[int, int]]:
        """Sorted, coalesced [start, end) file ranges holding every needed byte.

        ``covering=True`` treats each strided span as its covering range (remote readers);
        ranges separated by at most ``max_gap`` bytes are merged.
        """
        raw: list[tuple[int, int]] = []
        for t in self.tensors:
            if covering or t.span.contiguous:
                if t.span.nbytes:
                    raw.append((t.span.offset, t.span.end))
            else:
                raw.extend(t.span.row_extents())
        return coalesce(raw, max_gap)


def coalesce(ranges: Iterable[tuple[int, int]], max_gap: int = 0) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        if out and start - out[-1][1] <= max_gap:
            if end > out[-1][1]:
                out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


@dataclass
class ReadPlan:
    """Everything one rank will read, grouped by file, before any data is touched."""

    tp_size: int
    tp_rank: int
    files: dict[str, FilePlan]
    rules_digest: str
    total_bytes: int  # tensor bytes of the whole model (all ranks)
    uneven: str = "refuse"
    ep_size: int = 1
    ep_rank: int = 0
    experts: tuple[int, ...] = ()  # the routed experts this rank holds (EP), ascending
    num_experts: int = 0  # routed experts of the model (EP; 0 without expert parallelism)

    @property
    def tensors(self) -> list[TensorRead]:
        return [t for fp in self.files.values() for t in fp.tensors]

    @property
    def bytes_to_read(self) -> int:
        """Exact tensor bytes this rank needs (a dim-1 shard counts only its own columns)."""
        return sum(fp.bytes_to_read for fp in self.files.values())

    @property
    def replicated_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors if t.rule is ShardRule.REPLICATE)

    @property
    def group_size(self) -> int:
        """Ranks of a process group sharing this load's reads: the EP ranks, else the TP ranks."""
        return self.ep_size if self.ep_size > 1 else self.tp_size

    @property
    def group_rank(self) -> int:
        return self.ep_rank if self.ep_size > 1 else self.tp_rank

    def layout(self) -> dict[str, str]:
        """name → rule, for the fingerprint's rank layout."""
        return {t.name: t.rule.value for t in self.tensors}

    @classmethod
    def build(
        cls,
        headers: Mapping[str, SafetensorsHeader],
        tp_size: int = 1,
        tp_rank: int = 0,
        rules: RulesLike = None,
        *,
        presets: bool = True,
        uneven: str = "refuse",
        experts: ExpertLayout | None = None,
        config: bytes | None = None,
    ) -> ReadPlan:
        """Plan rank ``tp_rank`` of ``tp_size``; ``headers`` maps each file's relative path to its header.

        ``experts``: the expert-parallel layout (``experts.py``); ``config``: the model's
        ``config.json`` (its routed-expert count and FP8 block size)."""
        if not isinstance(tp_size, int) or tp_size < 1:
            raise PlanError(f"tp_size must be a positive integer, got {tp_size!r}")
        if not isinstance(tp_rank, int) or not 0 <= tp_rank < tp_size:
            raise PlanError(f"tp_rank must be in [0, {tp_size}), got {tp_rank!r}")
        if uneven not in ("refuse", "chunk"):
            raise PlanError(f"uneven must be 'refuse' or 'chunk', got {uneven!r}")
        ep = experts or ExpertLayout()
        ep.check()
        compiled = compile_rules(rules, presets=presets)
        seen: dict[str, str] = {}
        entries: list[tuple[str, SafetensorsHeader, TensorInfo]] = []
        total = 0
        for rel in sorted(headers):
            hdr = headers[rel]
            for info in hdr.tensors:
                if info.name in seen:
                    raise PlanError(f"tensor {info.name!r} appears in both {seen[info.name]} and {rel}")
                seen[info.name] = rel
                total += info.nbytes
                entries.append((rel, hdr, info))
        routed: dict[str, int | None] = {}  # name → expert index (None: stacked)
        rule_of: dict[str, ShardRule | None] = {}  # None: no TP rule matched
        ecompiled = compile_expert_rules(ep.rules, presets=ep.presets) if ep.ep_size > 1 else []
        for _, _, info in entries:
            matched = match_expert(info.name, ecompiled) if ecompiled else None
            if matched is not None and matched[0] is ExpertKind.ROUTED:
                routed[info.name] = matched[1]
                rule_of[info.name] = ShardRule.EXPERT
            elif matched is not None and matched[0] is ExpertKind.ROUTER:
                rule_of[info.name] = ShardRule.REPLICATE
            else:
                rule_of[info.name] = match_rule(info.name, info.shape, compiled) if tp_size > 1 else None
        mine: tuple[int, ...] = ()
        num_experts = 0
        if ep.ep_size > 1:
            num_experts = _count_experts(entries, routed, num_experts_from_config(config), ep.ep_size)
            mine = experts_of(ep.owners(num_experts), ep.ep_rank)
        block = weight_block_size(config)
        by_name = {info.name: info for _, _, info in entries}
        files: dict[str, FilePlan] = {rel: FilePlan(rel, headers[rel]) for rel in sorted(headers)}
        for rel, hdr, info in entries:
            fp = files[rel]
            rule = rule_of[info.name]
            what = f"{hdr.path}: tensor {info.name!r}"
            if rule is ShardRule.EXPERT:
                fp.kinds[info.name] = rule.value
                index = routed[info.name]
                if index is None:
                    fp.tensors.append(_plan_stacked(rel, hdr, info, mine, what))
                elif index in mine:
                    fp.tensors.append(_plan_tensor(rel, hdr, info, ShardRule.EXPERT, None))
                continue
            if rule is None:
                companion = _scale_companion(info, by_name, rule_of, block, tp_size, tp_rank, uneven, what)
                rule, part = companion if companion else (ShardRule.REPLICATE, None)
            elif rule is ShardRule.REPLICATE:
                part = None
            else:
                dim = 0 if rule is ShardRule.DIM0 else 1
                b, e = shard_bounds(info.shape[dim], tp_size, tp_rank, uneven=uneven, what=what)
                part = (dim, b, e, 1)
            fp.kinds[info.name] = rule.value
            fp.tensors.append(_plan_tensor(rel, hdr, info, rule, part))
        rules_doc: list[Any] = [[p.pattern, r.value] for p, r in compiled]
        if ep.ep_size > 1:
            rules_doc.append(["experts", [[p.pattern, k.value] for p, k in ecompiled], ep.digest_doc()])
        rules_digest = "sha256:" + hashlib.sha256(json.dumps(rules_doc).encode()).hexdigest()
        return cls(
            tp_size, tp_rank, files, rules_digest, total, uneven, ep.ep_size, ep.ep_rank, mine, num_experts
        )


def _count_experts(
    entries: Sequence[tuple[str, SafetensorsHeader, TensorInfo]],
    routed: Mapping[str, int | None],
    declared: int | None,
    ep_size: int,
) -> int:
    """The routed-expert count: config.json's, else the names'; every routed tensor must agree."""
    if not routed:
        raise PlanError(
            f"--ep-size {ep_size}: no tensor of the model is a routed expert by the expert rules "
            "(a dense model, or experts named otherwise: add an expert rule)"
        )
    count = declared
    if count is None:
        indexes = [i for i in routed.values() if i is not None]
        stacked = {
            info.shape[0]
            for _, _, info in entries
            if info.name in routed and routed[info.name] is None and info.shape
        }
        count = max(indexes) + 1 if indexes else (min(stacked) if stacked else 0)
        declared_by = "the tensor names"
    else:
        declared_by = "config.json declares"
    if count <= 0:
        raise PlanError("the model's stacked expert tensors have no expert dimension")
    for _, hdr, info in entries:
        if info.name not in routed:
            continue
        index = routed[info.name]
        if index is not None and index >= count:
            raise PlanError(
                f"{hdr.path}: tensor {info.name!r} is expert {index}, past the {count} experts {declared_by}"
            )
        if index is None and (not info.shape or info.shape[0] != count):
            first = info.shape[0] if info.shape else "none"
            raise PlanError(
                f"{hdr.path}: stacked expert tensor {info.name!r} has first dimension {first}, "
                f"but {declared_by} {count} experts"
            )
    return count


SCALE_SUFFIXES = ("_scale_inv", "_scale")  # weight_scale_inv (block FP8), weight_scale (per-channel)


def _scale_companion(
    info: TensorInfo,
    by_name: Mapping[str, TensorInfo],
    rule_of: Mapping[str, ShardRule | None],
    block: tuple[int, int] | None,
    tp_size: int,
    tp_rank: int,
    uneven: str,
    what: str,
) -> tuple[ShardRule, tuple[int, int, int, int]] | None:
    """A weight's scale that no rule names is split with its weight: along the weight's split
    dimension, at the granularity of the blocks the scale covers. None: replicate it."""
    if tp_size == 1 or not info.name.endswith(tuple(".weight" + s for s in SCALE_SUFFIXES)):
        return None
    base = info.name[: info.name.rindex("_scale")]
    weight = by_name.get(base)
    rule = rule_of.get(base)
    if weight is None or rule not in (ShardRule.DIM0, ShardRule.DIM1):
        return None
    dim = 0 if rule is ShardRule.DIM0 else 1
    if len(info.shape) <= dim or info.shape[dim] <= 1 or len(weight.shape) <= dim:
        return None  # a per-tensor scale, or one per output channel of a column-split weight
    n, blocks = weight.shape[dim], info.shape[dim]
    size = block[dim] if block and -(-n // block[dim]) == blocks else -(-n // blocks)
    if -(-n // size) != blocks:
        raise PlanError(
            f"{what}: {blocks} scales along dimension {dim} do not divide {base!r}'s {n} into blocks; "
            "set quantization_config.weight_block_size or replicate the scale with a rule"
        )
    b, e = shard_bounds(n, tp_size, tp_rank, uneven=uneven, what=f"tensor {base!r}")
    if b % size or (e % size and e != n):
        raise PlanError(
            f"{what}: TP rank {tp_rank}'s part [{b}, {e}) of dimension {dim} of {base!r} cuts a scale "
            f"block of {size}; the TP size must split {n} at block boundaries (as vLLM requires)"
        )
    return rule, (dim, b // size, -(-e // size), 1)


def _plan_stacked(
    rel: str, hdr: SafetensorsHeader, info: TensorInfo, mine: Sequence[int], what: str
) -> TensorRead:
    """A stacked expert tensor (dim 0 = expert): this rank's experts' rows, one (strided) run."""
    bits = DTYPE_BITS[info.dtype]
    if bits % 8:
        raise PlanError(f"{what}: cannot split sub-byte dtype {info.dtype} by expert; name it with a rule")
    first, step, count = stacked_rows(mine, what)
    row = math.prod(info.shape[1:]) * bits // 8
    base = hdr.data_start + info.begin + first * row
    shape = (count, *info.shape[1:])
    if count <= 1 or step == 1:
        span = Span(base, count * row, count * row, 1)
    else:
        span = Span(base, row, step * row, count)
    part = (0, first, first + step * (count - 1) + 1 if count else first, step)
    return TensorRead(info.name, rel, info.dtype, info.shape, shape, ShardRule.EXPERT, span, part)


def _plan_tensor(
    rel: str,
    hdr: SafetensorsHeader,
    info: TensorInfo,
    rule: ShardRule,
    part: tuple[int, int, int, int] | None,
) -> TensorRead:
    """One tensor: whole (``part`` None), or rows ``[b, e)`` of dimension 0 or 1."""
    bits = DTYPE_BITS[info.dtype]
    base = hdr.data_start + info.begin
    shape = info.shape
    what = f"{hdr.path}: tensor {info.name!r}"
    if part is None:
        return TensorRead(
            info.name, rel, info.dtype, shape, shape, rule, Span(base, info.nbytes, info.nbytes, 1)
        )
    if bits % 8:
        raise PlanError(f"{what}: cannot shard sub-byte dtype {info.dtype}; replicate it with a rule")
    es = bits // 8
    dim, b, e, _ = part
    if dim == 0:
        row = math.prod(shape[1:]) * es
        new_shape = (e - b, *shape[1:])
        n = (e - b) * row
        return TensorRead(
            info.name, rel, info.dtype, shape, new_shape, rule, Span(base + b * row, n, n, 1), part
        )
    inner = math.prod(shape[2:]) * es
    new_shape = (shape[0], e - b, *shape[2:])
    length = (e - b) * inner
    stride = shape[1] * inner
    rows = shape[0]
    if length == 0:
        rows = 0
    span = Span(base + b * inner, length, stride, rows)
    if rows == 1 or length == stride:
        span = Span(span.offset, length * rows, length * rows, 1)
    return TensorRead(info.name, rel, info.dtype, shape, new_shape, rule, span, part)
