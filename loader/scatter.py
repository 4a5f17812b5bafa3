"""A verified block read straight into the tensors it feeds: no staging copy, hashed where it lands.

The verified paths (``chunked``, ``whole_layer``) read a file in blocks that ignore tensor
boundaries. On the CPU, a block whose tensors take contiguous runs of it (every tensor at TP=1,
replicated tensors and dim-0 shards at any TP) is described as an ordered list of segments,
each a destination tensor's bytes or a gap (header bytes, another rank's rows) in the block's
staging slot at the same position. The reader fills the segments in one range read
(``read_scatter``: ``preadv`` for a file, ``recv_into`` for a registry), and the block's chunks
are hashed over the segments where the bytes lie.

What keeps this as safe as staging: a destination holds unverified bytes only until its chunk
(or layer) is checked, and a tensor is handed to the consumer only after every byte of it was
verified (``LoadEngine.landed`` is called after the check; whole layers stay ``held`` until the
digest matched). A failed check raises before ``landed``, and the load's abort drops every
destination, so no unverified byte is ever served. Strided spans (dim-1 shards) and spans that
overlap (a forged header placing two tensors on the same bytes) are not described here: those
blocks are staged and copied as before.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from modelpack.loader.blocks import SpanIndex
from modelpack.loader.engine import LoadEngine

from modelpack.errors import ChunkDigestMismatch


@dataclass(frozen=True)
class Segment:
    """File bytes ``[start, end)`` of a block and where they land: ``view`` (writable, that
    long), a destination tensor's bytes (``tensor`` its id) or, for a gap, the staging slot."""

    start: int
    end: int
    view: memoryview
    tensor: int | None


def scatter_plan(
    load: LoadEngine, index: SpanIndex, b0: int, b1: int, gap: memoryview
) -> list[Segment] | None:
    """Segments covering file bytes ``[b0, b1)`` in order, or ``None`` when the block must be
    staged (device memory, a strided or overlapping span). ``gap`` is the block's slot (gap bytes land at
    their offset from ``b0``, as a staged read would put them)."""
    if load.staged:
        return None
    segments: list[Segment] = []
    pos = b0
    for idx in sorted(index.candidates(b0, b1), key=lambda i: load.tensors[i].span.offset):
        span = load.tensors[idx].span
        dbytes = load.dest_bytes[idx]
        if not span.contiguous or dbytes is None:
            return None
        s, e = max(span.offset, b0), min(span.end, b1)
        if s < pos:  # spans overlap: only a staged copy can feed both
            return None
        if s > pos:
            segments.append(Segment(pos, s, gap[pos - b0 : s - b0], None))
        view = dbytes[s - span.offset : e - span.offset].numpy().data.cast("B")
        segments.append(Segment(s, e, view, idx))
        pos = e
    if pos < b1:
        segments.append(Segment(pos, b1, gap[pos - b0 : b1 - b0], None))
    return segments


def parts(segments: Sequence[Segment], s: int, e: int) -> list[memoryview]:
    """The pieces of the segments that hold file bytes ``[s, e)``, in order."""
    out = []
    for seg in segments:
        if seg.end <= s or seg.start >= e:
            continue
        a, b = max(seg.start, s), min(seg.end, e)
        out.append(seg.view[a - seg.start : b - seg.start])
    return out


def verify_chunk_parts(table: Any, layer: str, index: int, pieces: Sequence[memoryview]) -> None:
    """``ChunkTable.verify_chunk`` over a chunk held in several pieces (hashed where they lie)."""
    _, length = table.chunk_range(layer, index)
    expected: bytes = table.layers[layer].digests[index]
    h = hashlib.sha256()
    got = 0
    for p in pieces:
        h.update(p)
        got += len(p)
    actual = h.digest()
    if got != length or not hmac.compare_digest(actual, expected):
        raise ChunkDigestMismatch(
            layer,
            index,
            f"sha256:{expected.hex()} ({length} bytes)",
            f"sha256:{actual.hex()} ({got} bytes)",
        )


def land(load: LoadEngine, segments: Sequence[Segment]) -> None:
    """Count each destination segment as landed (after its bytes were verified)."""
    for seg in segments:
        if seg.tensor is not None:
            load.landed(seg.tensor, seg.end - seg.start)


__all__ = ["Segment", "land", "parts", "scatter_plan", "verify_chunk_parts"]
