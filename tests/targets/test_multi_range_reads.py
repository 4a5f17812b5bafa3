"""Many disjoint ranges of one blob in few requests (``MultiRangeFetcher``): a column-split
tensor-parallel share reads a slice of every row of a weight.

Against the real registry (Debian's distribution 2.8, whose Go ``http.ServeContent`` answers a
multi-range ``Range`` with ``206 multipart/byteranges``) and an OCI layout directory (``preadv``).
Hostile registries: ``test_multi_range_hostile.py``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from modelpack.mediatypes import MEDIA_TYPE_IMAGE_LAYER_TAR

from modelpack.errors import RangeListError, SizeMismatchError
from modelpack.oci.descriptor import Descriptor
from modelpack.oci.digest import Digest
from modelpack.targets.base import MultiRangeFetcher, bytes_blob_source
from modelpack.targets.layout import OCILayoutTarget
from modelpack.targets.opener import TargetOptions, open_readable, open_target
from modelpack.targets.registry import multi_range_reads
from modelpack.targets.registry.target import RegistryTarget
from tests.fixtures.faultproxy import FaultProxy
from tests.fixtures.registry import RegistryServer

ROWS = 4096
ROW_BYTES = 1024
#: this rank's columns of every row: bytes [COL_START, COL_END) of each row
COL_START, COL_END = 256, 384


def _blob() -> tuple[bytes, Descriptor]:
    data = os.urandom(ROWS * ROW_BYTES)
    return data, Descriptor(MEDIA_TYPE_IMAGE_LAYER_TAR, Digest.from_bytes(data), len(data))


def _column_share() -> list[tuple[int, int]]:
    """A slice of every row, the first rows' slices split in two adjacent ranges (joined on the wire)."""
    ranges: list[tuple[int, int]] = []
    for row in range(ROWS):
        start = row * ROW_BYTES + COL_START
        if row < 8:
            ranges += [(start, 50), (start + 50, COL_END - COL_START - 50)]
        else:
            ranges.append((start, COL_END - COL_START))
    return ranges


def _views(ranges: list[tuple[int, int]]) -> tuple[bytearray, list[memoryview]]:
    """One destination buffer (as a rank's shard would be), a view per range."""
    dest = bytearray(sum(n for _, n in ranges))
    mv = memoryview(dest)
    views, pos = [], 0
    for _, n in ranges:
        views.append(mv[pos : pos + n])
        pos += n
    return dest, views


def _expected(data: bytes, ranges: list[tuple[int, int]]) -> bytes:
    return b"".join(data[o : o + n] for o, n in ranges)


def test_a_column_share_of_thousands_of_ranges_comes_in_few_requests(registry: RegistryServer) -> None:
    data, desc = _blob()
    ref = registry.ref("multirange/share", None)
    writer = open_target(ref, TargetOptions(), for_write=True)
    writer.push_blob(bytes_blob_source(desc, data))
    target = open_readable(ref, TargetOptions())
    assert isinstance(target, RegistryTarget) and isinstance(target, MultiRangeFetcher)
    assert target.multi_range

    ranges = _column_share()
    dest, views = _views(ranges)
    mark = registry.log_mark()
    fetched = target.fetch_ranges_into(desc, ranges, views)

    assert bytes(dest) == _expected(data, ranges)
    assert fetched == sum(n for _, n in ranges)
    gets = [r for r in registry.requests_since(mark) if r[0] == "GET"]
    assert all(status == 206 for _, _, status in gets)
    # 4096 row slices (the adjacent pairs joined): a few requests, not thousands
    assert 1 < len(gets) <= ROWS // 300, gets
    assert target._repo.stats["read_resumes"] == 0


def test_ranges_at_the_blob_edges_and_a_single_range(registry: RegistryServer) -> None:
    data, desc = _blob()
    ref = registry.ref("multirange/edges", None)
    open_target(ref, TargetOptions(), for_write=True).push_blob(bytes_blob_source(desc, data))
    target = open_readable(ref, TargetOptions())
    assert isinstance(target, RegistryTarget)
    for ranges in ([(0, 1), (desc.size - 1, 1)], [(5, 1000)], [(0, 10), (10, 0), (10, 7)]):
        dest, views = _views(ranges)
        assert target.fetch_ranges_into(desc, ranges, views) == sum(n for _, n in ranges)
        assert bytes(dest) == _expected(data, ranges)
    assert target.fetch_ranges_into(desc, [], []) == 0


def test_ranges_the_caller_got_wrong_are_refused_before_any_request(registry: RegistryServer) -> None:
    data, desc = _blob()
    ref = registry.ref("multirange/refused", None)
    open_target(ref, TargetOptions(), for_write=True).push_blob(bytes_blob_source(desc, data))
    target = open_readable(ref, TargetOptions())
    assert isinstance(target, RegistryTarget)
    mark = registry.log_mark()
    with pytest.raises(SizeMismatchError) as past:
        target.fetch_ranges_into(desc, [(0, 4), (desc.size - 2, 4)], _views([(0, 4), (0, 4)])[1])
    assert str(desc.digest) in str(past.value)
    for ranges, views in (
        ([(10, 4), (0, 4)], _views([(0, 4), (0, 4)])[1]),  # descending
        ([(0, 8), (4, 4)], _views([(0, 8), (0, 4)])[1]),  # overlapping
        ([(0, 4)], _views([(0, 5)])[1]),  # a view of another length
        ([(-1, 4)], _views([(0, 4)])[1]),  # negative
        ([(0, 4), (8, 4)], _views([(0, 4)])[1]),  # fewer views than ranges
        ([(0, 4)], [memoryview(b"abcd")]),  # a read-only view
    ):
        with pytest.raises(RangeListError):
            target.fetch_ranges_into(desc, ranges, views)
    assert registry.requests_since(mark) == []


def test_through_mirrors_the_share_is_read_as_covering_bands(registry: RegistryServer) -> None:
    """With mirrors the ranges come right, by covering reads through the mirror chain, and the
    target says it does not read them from one source (``multi_range`` False)."""
    data, desc = _blob()
    ref = registry.ref("multirange/mirrored", None)
    open_target(ref, TargetOptions(), for_write=True).push_blob(bytes_blob_source(desc, data))
    # the registry itself, through a proxy on another port, as the mirror (one that has every blob)
    proxy = FaultProxy(registry.host)
    try:
        target = open_readable(ref, TargetOptions(mirrors=[f"http://{proxy.host}"]))
        _mirrored_share(target, data, desc)
    finally:
        proxy.close()


def _mirrored_share(target: object, data: bytes, desc: Descriptor) -> None:
    assert isinstance(target, RegistryTarget) and target.mirrors is not None
    assert isinstance(target, MultiRangeFetcher) and not target.multi_range
    ranges = _column_share()
    dest, views = _views(ranges)
    fetched = target.fetch_ranges_into(desc, ranges, views)
    assert bytes(dest) == _expected(data, ranges)
    span = ranges[-1][0] + ranges[-1][1] - ranges[0][0]
    assert fetched == span  # one covering band: the whole span fits 16 MiB


def test_an_oci_layout_reads_the_ranges_from_its_blob_file(tmp_path: Path) -> None:
    data, desc = _blob()
    target = OCILayoutTarget(tmp_path / "layout", create=True)
    target.push_blob(bytes_blob_source(desc, data))
    assert isinstance(target, MultiRangeFetcher) and target.multi_range
    ranges = _column_share()
    dest, views = _views(ranges)
    assert target.fetch_ranges_into(desc, ranges, views) == sum(n for _, n in ranges)
    assert bytes(dest) == _expected(data, ranges)

    # a typed destination (a tensor's memory) is filled as bytes
    typed = memoryview(bytearray(8)).cast("I")
    assert target.fetch_ranges_into(desc, [(16, 8)], [typed]) == 8
    assert typed.tobytes() == data[16:24]

    # the blob file cut short under the reader
    os.truncate(target.blob_path(desc.digest), desc.size // 2)
    dest, views = _views(ranges)
    with pytest.raises(SizeMismatchError) as exc:
        target.fetch_ranges_into(desc, ranges, views)
    assert str(desc.digest) in str(exc.value)


def test_the_batch_limits_hold_the_range_header_under_a_proxys_line_limit() -> None:
    """Each request's ``Range`` header stays within ``MAX_RANGE_HEADER_BYTES`` (nginx refuses
    header lines over 8 KiB) and ``MAX_RANGES_PER_REQUEST``, whatever the offsets' widths."""
    from modelpack.targets.ranges import Run

    runs = [Run(10**12 + i * 1000, 10) for i in range(5000)]
    pending = list(runs)
    while pending:
        batch, header = multi_range_reads._next_batch(pending)
        assert batch and len(header) <= multi_range_reads.MAX_RANGE_HEADER_BYTES
        assert len(batch) <= multi_range_reads.MAX_RANGES_PER_REQUEST
        assert header.count(",") == len(batch) - 1
        pending = pending[len(batch) :]
