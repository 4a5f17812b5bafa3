"""Many disjoint ranges of one blob, as ``MultiRangeFetcher.fetch_ranges_into`` takes them.

``plan_runs`` checks the caller's ranges and views once (ascending, non-overlapping, inside the
blob, each view exactly its range's length, writable bytes) and joins adjacent ranges into one
``Run``: one range on the wire, its bytes received into the views one after the other.
``bands`` groups runs into covering contiguous reads of at most ``COVERING_BAND`` bytes, for a
source that reads one range at a time (a registry that ignored a multi-range request, mirrors):
the gaps between runs land in scratch memory, the runs' bytes still straight in the views.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from modelpack.errors import RangeListError, SizeMismatchError
from modelpack.oci.descriptor import Descriptor

#: the most one covering read spans (a run longer than this is read alone, gaps never exceed it)
COVERING_BAND = 16 * 1024 * 1024


@dataclass
class Run:
    """Adjacent ranges as one: ``length`` bytes at ``offset`` filling ``views`` in order;
    ``have`` bytes of it arrived (a cut run continues from there)."""

    offset: int
    length: int
    views: list[memoryview] = field(default_factory=list)
    have: int = 0

    @property
    def pos(self) -> int:
        """The first byte still missing."""
        return self.offset + self.have

    @property
    def end(self) -> int:
        return self.offset + self.length

    @property
    def done(self) -> bool:
        return self.have >= self.length

    def pending_views(self) -> Iterator[memoryview]:
        """The views past the ``have`` bytes already received."""
        skip = self.have
        for view in self.views:
            if skip >= len(view):
                skip -= len(view)
                continue
            yield view[skip:] if skip else view
            skip = 0


def byte_view(view: memoryview, index: int) -> memoryview:
    """``view`` as writable, contiguous bytes (a tensor's memory may come typed)."""
    if not isinstance(view, memoryview):
        try:
            view = memoryview(view)
        except TypeError:
            raise RangeListError(f"view {index} is a {type(view).__name__}, not a buffer") from None
    if view.readonly:
        raise RangeListError(f"view {index} is read-only")
    if not view.c_contiguous:
        raise RangeListError(f"view {index} is not contiguous")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def plan_runs(
    descriptor: Descriptor,
    ranges: Sequence[tuple[int, int]],
    views: Sequence[memoryview],
    *,
    source: str,
) -> list[Run]:
    """The ranges checked and joined into runs (empty ranges dropped). A range past the blob's
    end is ``SizeMismatchError`` naming the digest; anything else wrong is ``RangeListError``."""
    if len(ranges) != len(views):
        raise RangeListError(f"{len(ranges)} ranges of blob {descriptor.digest} but {len(views)} views")
    runs: list[Run] = []
    last_end = 0
    for i, (rng, raw_view) in enumerate(zip(ranges, views, strict=True)):
        try:
            offset, length = (int(x) for x in rng)
        except (TypeError, ValueError):
            raise RangeListError(f"range {i} of blob {descriptor.digest} is not (offset, length)") from None
        if offset < 0 or length < 0:
            raise RangeListError(f"range {i} of blob {descriptor.digest} is negative: {offset}+{length}")
        if offset < last_end:
            raise RangeListError(
                f"range {i} of blob {descriptor.digest} ({offset}+{length}) starts before the end of "
                f"the one before ({last_end}): ranges must ascend without overlapping"
            )
        view = byte_view(raw_view, i)
        if len(view) != length:
            raise RangeListError(
                f"range {i} of blob {descriptor.digest} is {length} bytes, its view {len(view)}"
            )
        if offset + length > descriptor.size:
            raise SizeMismatchError(
                descriptor.digest, descriptor.size, offset + length, source=f"{source} range {offset}"
            )
        last_end = offset + length
        if not length:
            continue
        if runs and runs[-1].end == offset:
            runs[-1].length += length
            runs[-1].views.append(view)
        else:
            runs.append(Run(offset, length, [view]))
    return runs


@dataclass
class Band:
    """One covering read: ``length`` bytes at ``offset`` filling ``views`` in order (the runs'
    pending views, with scratch views over the gaps between them)."""

    offset: int
    length: int
    views: list[memoryview]
    runs: list[Run]


def bands(runs: Sequence[Run], max_band: int = COVERING_BAND) -> list[Band]:
    """The pending parts of ``runs`` grouped into covering reads of at most ``max_band`` bytes
    (a longer run alone, no gap). The gaps of a band share one scratch buffer."""
    groups: list[list[Run]] = []
    for run in runs:
        if run.done:
            continue
        if groups and run.end - groups[-1][0].pos <= max_band:
            groups[-1].append(run)
        else:
            groups.append([run])
    gap_most = max(
        (sum(b.pos - a.end for a, b in itertools.pairwise(group)) for group in groups),
        default=0,
    )
    scratch = memoryview(bytearray(gap_most))
    out: list[Band] = []
    for group in groups:
        views: list[memoryview] = []
        used = 0
        for i, run in enumerate(group):
            if i:
                gap = run.pos - group[i - 1].end
                if gap:
                    views.append(scratch[used : used + gap])
                    used += gap
            views.extend(run.pending_views())
        start = group[0].pos
        out.append(Band(start, group[-1].end - start, views, group))
    return out


def fill_views(views: Sequence[memoryview], data: memoryview | bytes) -> None:
    """Copy ``data`` (exactly as long as the views together) into the views in order."""
    src = memoryview(data)
    pos = 0
    for view in views:
        view[:] = src[pos : pos + len(view)]
        pos += len(view)
