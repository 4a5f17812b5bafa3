"""A column-split share read alone: only the rank's columns, checked against signed column blocks.

A dim-1 (column-split) share is strided over every row of its tensor, so every contiguous chunk
of a chunk table holds every rank's columns, and a standalone rank (no process group to share
reads with) fetched the whole tensor to check its chunks. An aligned table also signs each 2-D
tensor's column blocks (``signing.chunk_bounds.column_blocks``): when the rank's share is whole
blocks, it reads just its columns — one range per row (``read_rows``: ``gather_rows`` for a local
file, a multi-range request for a registry, ``preadv`` per row for a layout) straight into the
destination, which then holds the share row-major, i.e. the share's blocks interleaved row by
row — and hashes each block there (``ColumnDigester``) against the table before the tensor
counts a byte (``LoadEngine.landed``), as the scattered chunk path does.

Used only where it saves bytes and keeps every guarantee: a standalone load (a group shares the
covering chunks instead), a reader that can read rows without the rest of the tensor (``RowsReader.reads_rows``: not
through mirrors or peers, whose wrong bytes only the contiguous chunk path refetches from the
next source), and a share of whole signed blocks (TP ∈ {2, 4, 8} for a tensor cut in 8 blocks).
By default only from local files and OCI layouts (``LoaderOptions.column_reads="local"``): a
registry answers a multi-range request at ~0.4 ms per range (distribution reopens the blob for
each part), so on a fast link reading the rows costs more wall time than the bytes it saves;
``"always"`` takes that trade where bytes cost more than time (a slow or metered link). Anywhere
else the tensor's chunks are read as before.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from modelpack.loader.device_copier import Slot
from modelpack.loader.engine import LoadEngine
from modelpack.loader.plan import FilePlan, Span, TensorRead
from modelpack.loader.readers import RangeReader, RowsReader
from modelpack.signing.column_digests import ColumnDigester

from modelpack.errors import ChunkDigestMismatch
from modelpack.packing.safetensors_format import TensorInfo
from modelpack.targets.base import BlobFiles

if TYPE_CHECKING:
    from modelpack.signing.chunks import ChunkTable, ColumnBlocks

__all__ = ["ColumnShare", "column_shares", "read_column_shares"]


@dataclass(frozen=True)
class ColumnShare:
    """A tensor's dim-1 share that is blocks ``first … first + count - 1`` of its signed columns."""

    tensor: int  # the load's tensor id
    blocks: ColumnBlocks
    first: int
    count: int


def _share_of(
    t: TensorRead, table: ChunkTable, layer: str, fp: FilePlan, infos: Mapping[str, TensorInfo]
) -> tuple[ColumnBlocks, int, int] | None:
    span = t.span
    if span.contiguous or not span.nbytes or t.part is None or t.part[0] != 1 or t.part[3] != 1:
        return None
    info = infos.get(t.name)
    if info is None:
        return None
    start, end = fp.header.absolute(info)
    cb = table.column_blocks(layer, start, end)
    if cb is None or cb.rows != span.rows or cb.row_bytes != span.stride:
        return None
    skip, width = span.offset - start, cb.block_bytes
    if skip < 0 or skip % width or span.length % width or skip + span.length > cb.row_bytes:
        return None
    return cb, skip // width, span.length // width


def column_shares(
    load: LoadEngine, reader: RangeReader, table: ChunkTable, layer: str, fp: FilePlan, ids: list[int]
) -> list[ColumnShare]:
    """The tensors of ``fp`` (ids ``ids``, in plan order) this load reads by their columns."""
    mode = load.opts.column_reads
    if mode == "never" or not (isinstance(reader, RowsReader) and reader.reads_rows):
        return []
    if mode == "local" and not (reader.local or isinstance(getattr(reader, "target", None), BlobFiles)):
        return []  # a registry: a range per row costs more wall time than the bytes it saves
    infos = fp.header.by_name()
    out = []
    for t, idx in zip(fp.tensors, ids, strict=True):
        if load.dest_bytes[idx] is None:
            continue
        share = _share_of(t, table, layer, fp, infos)
        if share is not None and not (load.staged and t.span.length > load.copier.slot_bytes):
            out.append(ColumnShare(idx, *share))  # (staged: a row must fit a slot)
    return out


def _digester(share: ColumnShare, rows: int) -> ColumnDigester:
    """Hashes the share (row-major: its blocks interleaved row by row) into its blocks."""
    return ColumnDigester(rows, share.count * share.blocks.block_bytes, share.count)


def _check(layer: str, share: ColumnShare, digester: ColumnDigester) -> None:
    """Raise ``ChunkDigestMismatch`` unless the share fed to ``digester`` hashes to its blocks."""
    for k, actual in enumerate(digester.digests()):
        j = share.first + k
        expected = share.blocks.digests[j]
        if not hmac.compare_digest(actual, expected):
            what = f"column block {j} of the tensor at byte {share.blocks.start}"
            raise ChunkDigestMismatch(layer, j, f"sha256:{expected.hex()} ({what})", f"sha256:{actual.hex()}")


def read_column_shares(
    load: LoadEngine, reader: RangeReader, layer: str, shares: list[ColumnShare]
) -> Iterator[int]:
    """Read each share's rows, check its blocks, then count it: on the CPU straight into the
    destination and hashed there by the worker; on a device through staging slots, a band of rows
    each, hashed in order as each band is copied on (the tensor counts its bytes only after its
    last band matched, as the scattered chunk path holds unverified bytes only until its check)."""
    if not shares:
        return
    assert isinstance(reader, RowsReader)
    for share in shares:
        span = load.tensors[share.tensor].span
        if load.staged:
            yield from _read_staged(load, reader, layer, share, span)
            continue
        dest = load.dest_bytes[share.tensor]
        assert dest is not None
        view = dest.numpy().data.cast("B")

        def task(share: ColumnShare = share, view: memoryview = view, span: Span = span) -> None:
            reader.read_rows(span.offset, span.length, span.stride, span.rows, view)
            digester = _digester(share, span.rows)
            digester.update(view)
            _check(layer, share, digester)

        def done(_: object, share: ColumnShare = share, n: int = span.nbytes) -> None:
            load.landed(share.tensor, n)

        yield from load.submit(task, done)


def _read_staged(
    load: LoadEngine, reader: RowsReader, layer: str, share: ColumnShare, span: Span
) -> Iterator[int]:
    """One share through the staging slots: each band of rows is read into a slot by a worker; its
    ``done`` (run in submission order) feeds the band to the share's digester and copies it on."""
    digester = _digester(share, span.rows)
    per = max(1, load.copier.slot_bytes // span.length)
    for r0 in range(0, span.rows, per):
        rows = min(per, span.rows - r0)
        n = rows * span.length
        slot = yield from load.next_slot()

        def task(slot: Slot = slot, r0: int = r0, rows: int = rows, n: int = n) -> None:
            reader.read_rows(span.offset + r0 * span.stride, span.length, span.stride, rows, slot.view[:n])

        def done(
            _: object, slot: Slot = slot, r0: int = r0, n: int = n, last: bool = r0 + rows == span.rows
        ) -> None:
            digester.update(slot.view[:n])
            dbytes = load.dest_bytes[share.tensor]
            assert dbytes is not None
            d0 = r0 * span.length
            load.copier.copy(dbytes[d0 : d0 + n], slot.host[:n])
            load.stats.staged_bytes += n
            load.release(slot)
            if last:
                _check(layer, share, digester)
                load.landed(share.tensor, span.nbytes)

        yield from load.submit(task, done)
