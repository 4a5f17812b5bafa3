"""Which split kind the bytes a rank fetched belong to: the per-rank cost report of a load.

Why: a rank's read cost depends on how its tensors are split. A dim-0 (row-split) shard is one
contiguous range and costs ≈ 1/TP of the tensor; a dim-1 (column-split) shard interleaves every
rank's columns row by row, so under chunk verification a rank fetches the whole tensor; a
replicated tensor costs all of it on every rank. Attributing each fetched byte to the tensor whose
bytes it is (whichever rank needs them) makes that visible per kind, next to what the plan needed.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence

from modelpack.loader.plan import ReadPlan, ShardRule

KINDS = tuple(rule.value for rule in ShardRule)


def bytes_by_split(
    plan: ReadPlan, reads: Mapping[str, Sequence[tuple[int, int, int]]]
) -> dict[str, dict[str, int]]:
    """``{kind: {tensorBytes, planned, read}}`` for dim0/dim1/replicate, plus ``header`` (and
    ``other``, bytes between tensors, when there are any) with ``read`` only.

    ``reads`` maps each file to the reader's log of ``(offset, bytes, end)``: a contiguous read has
    ``end - offset == bytes``; a strided gather (dim-1 rows of one tensor) covers ``[offset, end)``.
    """
    out: dict[str, dict[str, int]] = {k: {"tensorBytes": 0, "planned": 0, "read": 0} for k in KINDS}
    out["header"] = {"read": 0}
    other = 0
    for rel, fp in plan.files.items():
        kind_of = {**fp.kinds, **{t.name: t.rule.value for t in fp.tensors}}
        for t in fp.tensors:
            out[t.rule.value]["planned"] += t.nbytes
        hdr = fp.header
        spans: list[tuple[int, int, str]] = []
        for info in hdr.tensors:
            kind = kind_of.get(info.name, ShardRule.REPLICATE.value)
            out[kind]["tensorBytes"] += info.nbytes
            if info.nbytes:
                spans.append((hdr.data_start + info.begin, hdr.data_start + info.end, kind))
        spans.sort()
        starts = [s for s, _, _ in spans]
        for offset, n, end in reads.get(rel, ()):
            if end - offset != n:  # a strided gather stays inside one tensor
                i = bisect.bisect_right(starts, offset) - 1
                if i >= 0 and spans[i][0] <= offset < spans[i][1]:
                    out[spans[i][2]]["read"] += n
                else:
                    other += n
                continue
            counted = 0
            if offset < hdr.data_start:
                h = min(end, hdr.data_start) - offset
                out["header"]["read"] += h
                counted += h
            i = max(0, bisect.bisect_right(starts, offset) - 1)
            while i < len(spans) and spans[i][0] < end:
                s, e, kind = spans[i]
                overlap = min(e, end) - max(s, offset)
                if overlap > 0:
                    out[kind]["read"] += overlap
                    counted += overlap
                i += 1
            other += n - counted
    if other:
        out["other"] = {"read": other}
    return out
