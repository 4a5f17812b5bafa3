"""Which tensors a verified block of file bytes feeds, and which parts of each span it holds.

Both verified paths (chunked and whole-layer) read a file in blocks that ignore tensor
boundaries; once a block is verified, these map it back onto the destination tensors.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping

from modelpack.loader.plan import Span


def span_block_copies(span: Span, b0: int, b1: int) -> list[tuple[int, int, int, int, int]]:
    """Parts of ``span`` inside file bytes [b0, b1): (src offset, dest offset, length, stride, rows)."""
    if span.nbytes == 0 or b1 <= b0:
        return []
    if span.contiguous:
        s, e = max(span.offset, b0), min(span.offset + span.nbytes, b1)
        return [(s, s - span.offset, e - s, e - s, 1)] if s < e else []
    length, stride, off = span.length, span.stride, span.offset
    k_lo = max(0, (b0 - off - length) // stride + 1)
    k_hi = min(span.rows - 1, (b1 - 1 - off) // stride)
    if k_lo > k_hi:
        return []
    f_lo = max(k_lo, -((off - b0) // stride))  # ceil((b0 - off) / stride)
    f_hi = min(k_hi, (b1 - length - off) // stride)
    out = []
    full = f_lo <= f_hi
    for k in range(k_lo, k_hi + 1):
        if full and f_lo <= k <= f_hi:
            continue
        o = off + k * stride
        s, e = max(o, b0), min(o + length, b1)
        if s < e:
            out.append((s, k * length + (s - o), e - s, e - s, 1))
    if full:
        out.append((off + f_lo * stride, f_lo * length, length, stride, f_hi - f_lo + 1))
    return out


class SpanIndex:
    """Tensor ids sorted by span offset, so a block finds its tensors by bisection, not a scan."""

    def __init__(self, spans: Mapping[int, Span]) -> None:
        self.order = sorted(spans, key=lambda i: spans[i].offset)
        self.starts = [spans[i].offset for i in self.order]
        self.ends = [spans[i].end for i in self.order]

    def candidates(self, b0: int, b1: int) -> list[int]:
        """Ids whose span overlaps file bytes [b0, b1)."""
        i = bisect.bisect_right(self.ends, b0)
        out = []
        while i < len(self.order) and self.starts[i] < b1:
            if self.ends[i] > b0:
                out.append(self.order[i])
            i += 1
        return out
