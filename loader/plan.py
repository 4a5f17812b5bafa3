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
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum

from modelpack.errors import PlanError
from modelpack.packing.safetensors_format import DTYPE_BITS, SafetensorsHeader, TensorInfo


class ShardRule(str, Enum):
    """How one tensor is split across the ranks of a tensor-parallel group."""

    REPLICATE = "replicate"
    DIM0 = "dim0"  # column-parallel (output rows) / vocab-parallel: one contiguous range per rank
    DIM1 = "dim1"  # row-parallel (input columns): a strided run of rows per rank

    @classmethod
    def parse(cls, value: ShardRule | str) -> ShardRule:
        if isinstance(value, ShardRule):
            return value
        try:
            return cls(str(value).lower())
        except ValueError as exc:
            raise PlanError(f"unknown shard rule {value!r}: use replicate, dim0 or dim1") from exc


# Presets for Llama / Qwen / Mistral-style names (regexes, searched; first match wins). Only
# ``.weight`` matrices are sharded; 1-D tensors (norms, biases) fall through to replicate.
# Callers whose model shards biases with their columns (Qwen's q/k/v biases under vLLM) add a
# rule such as ``{r"\.(q|k|v)_proj\.bias$": "dim0"}``.
DEFAULT_RULES: tuple[tuple[str, ShardRule], ...] = (
    (r"(^|\.)(q_proj|k_proj|v_proj|qkv_proj|gate_proj|up_proj|gate_up_proj)\.weight$", ShardRule.DIM0),
    (r"(^|\.)(o_proj|down_proj)\.weight$", ShardRule.DIM1),
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
    for pattern, rule in compiled:
        if pattern.search(name):
            if rule is ShardRule.DIM1 and len(shape) < 2:
                # a dim-1 rule matched a vector: only explicit caller rules may shard vectors,
                # and they can only do so along dim 0
                return ShardRule.REPLICATE
            if rule is ShardRule.DIM0 and len(shape) < 1:
                return ShardRule.REPLICATE
            return rule
    return ShardRule.REPLICATE


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

    @property
    def nbytes(self) -> int:
        return self.span.nbytes

    @property
    def sharded(self) -> bool:
        return self.shape != self.full_shape


@dataclass
class FilePlan:
    file: str
    header: SafetensorsHeader
    tensors: list[TensorRead] = field(default_factory=list)

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
    ) -> ReadPlan:
        """Plan rank ``tp_rank`` of ``tp_size``; ``headers`` maps each file's relative path to its header."""
        if not isinstance(tp_size, int) or tp_size < 1:
            raise PlanError(f"tp_size must be a positive integer, got {tp_size!r}")
        if not isinstance(tp_rank, int) or not 0 <= tp_rank < tp_size:
            raise PlanError(f"tp_rank must be in [0, {tp_size}), got {tp_rank!r}")
        if uneven not in ("refuse", "chunk"):
            raise PlanError(f"uneven must be 'refuse' or 'chunk', got {uneven!r}")
        compiled = compile_rules(rules, presets=presets)
        seen: dict[str, str] = {}
        files: dict[str, FilePlan] = {}
        total = 0
        for rel in sorted(headers):
            hdr = headers[rel]
            fp = FilePlan(rel, hdr)
            for info in hdr.tensors:
                if info.name in seen:
                    raise PlanError(f"tensor {info.name!r} appears in both {seen[info.name]} and {rel}")
                seen[info.name] = rel
                total += info.nbytes
                rule = rule_for(info.name, info.shape, compiled) if tp_size > 1 else ShardRule.REPLICATE
                fp.tensors.append(_plan_tensor(rel, hdr, info, rule, tp_size, tp_rank, uneven))
            files[rel] = fp
        rules_doc = [[p.pattern, r.value] for p, r in compiled]
        rules_digest = "sha256:" + hashlib.sha256(json.dumps(rules_doc).encode()).hexdigest()
        return cls(tp_size, tp_rank, files, rules_digest, total, uneven)


def _plan_tensor(
    rel: str,
    hdr: SafetensorsHeader,
    info: TensorInfo,
    rule: ShardRule,
    tp_size: int,
    tp_rank: int,
    uneven: str,
) -> TensorRead:
    bits = DTYPE_BITS[info.dtype]
    base = hdr.data_start + info.begin
    shape = info.shape
    what = f"{hdr.path}: tensor {info.name!r}"
    if rule is not ShardRule.REPLICATE and bits % 8:
        raise PlanError(f"{what}: cannot shard sub-byte dtype {info.dtype}; replicate it with a rule")
    es = bits // 8 if bits % 8 == 0 else 0
    if rule is ShardRule.REPLICATE:
        return TensorRead(
            info.name, rel, info.dtype, shape, shape, rule, Span(base, info.nbytes, info.nbytes, 1)
        )
    if rule is ShardRule.DIM0:
        b, e = shard_bounds(shape[0], tp_size, tp_rank, uneven=uneven, what=what)
        row = math.prod(shape[1:]) * es
        new_shape = (e - b, *shape[1:])
        n = (e - b) * row
        return TensorRead(info.name, rel, info.dtype, shape, new_shape, rule, Span(base + b * row, n, n, 1))
    # DIM1
    b, e = shard_bounds(shape[1], tp_size, tp_rank, uneven=uneven, what=what)
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
    return TensorRead(info.name, rel, info.dtype, shape, new_shape, rule, span)
