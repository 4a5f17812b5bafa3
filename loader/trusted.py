"""Read paths for trusted files: bytes already verified (node cache) or vouched for, not hashed again.

A node-cache snapshot was hashed when it was filled; a plain directory is trusted only with
``allow_unverified=True``.

- CPU: worker threads ``preadv`` straight into the destination tensors (dim-1 shards gather their
  rows from a short mmap). No staging copy: this is the readinto ceiling.
- a device (or ``direct_io``): pieces of ≤ ``slot_bytes`` are read into the pinned staging slots,
  then copied host→device through the device seam (``device_copier``: a side stream) while the next
  reads run; a slot is reused only after its copy's event completed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from modelpack.loader.device_copier import Slot
from modelpack.loader.engine import LoadEngine
from modelpack.loader.readers import FileReader, RangeReader

from modelpack.errors import LoaderError


def read_trusted_direct(load: LoadEngine, reader: RangeReader, ids: list[int]) -> Iterator[int]:
    """Reads straight into the destinations, batched so a worker runs ~``batch_bytes`` per task.

    Batching matters on few cores: every completion wakes the scheduling thread, and a wake-up
    per 16 MiB piece measurably steals CPU from the readers.
    """
    piece = load.opts.piece_bytes
    batch: list[tuple[Callable[[], int], int]] = []
    batch_bytes = 0

    def batch_done(landed: Any) -> None:
        for idx, n in landed:
            load.landed(idx, n)

    for idx in ids:
        t = load.tensors[idx]
        span = t.span
        dbytes = load.dest_bytes[idx]
        assert dbytes is not None
        if span.nbytes == 0:
            continue
        ops: list[tuple[Callable[[], int], int, int]] = []
        if span.contiguous:
            mv = dbytes.numpy().data.cast("B")
            for off in range(0, span.nbytes, piece):
                n = min(piece, span.nbytes - off)
                ops.append((_bind_read_counted(reader, span.offset + off, mv[off : off + n]), idx, n))
        else:
            rows_per = max(1, piece // span.length)
            arr = dbytes.numpy().reshape(span.rows, span.length)
            assert isinstance(reader, FileReader)
            for r0 in range(0, span.rows, rows_per):
                r1 = min(span.rows, r0 + rows_per)
                fn = _bind_gather_counted(
                    reader, span.offset + r0 * span.stride, span.length, span.stride, r1 - r0, arr[r0:r1]
                )
                ops.append((fn, idx, (r1 - r0) * span.length))
        for fn, op_idx, n in ops:
            batch.append((fn, op_idx))
            batch_bytes += n
            if batch_bytes >= load.opts.batch_bytes:
                yield from load.submit(_run_batch(batch), batch_done)
                batch, batch_bytes = [], 0
    if batch:
        yield from load.submit(_run_batch(batch), batch_done)


def read_trusted_staged(load: LoadEngine, reader: RangeReader, ids: list[int]) -> Iterator[int]:
    """Pinned ring → device (CUDA), or aligned ring → memcpy (O_DIRECT on CPU)."""
    # O_DIRECT widens each read to 4 KiB pages on both ends: keep that inside the slot
    cap = load.copier.slot_bytes - (2 * 4096 if load.opts.direct_io else 0)
    for idx in ids:
        span = load.tensors[idx].span
        if span.nbytes == 0:
            continue
        if span.contiguous:
            parts = [(span.offset + o, o, min(cap, span.nbytes - o), 1) for o in range(0, span.nbytes, cap)]
        else:
            rows_per = max(1, cap // span.length)
            parts = [
                (
                    span.offset + r0 * span.stride,
                    r0 * span.length,
                    span.length,
                    min(rows_per, span.rows - r0),
                )
                for r0 in range(0, span.rows, rows_per)
            ]
        for src_off, dst_off, length, rows in parts:
            if not span.contiguous and span.length > cap:
                raise LoaderError(
                    f"tensor {load.tensors[idx].name!r}: a row of {span.length} bytes exceeds the staging "
                    f"slot ({cap}); raise LoaderOptions.slot_bytes"
                )
            slot = yield from load.next_slot()
            nbytes = length * rows
            fn = _bind_stage(reader, slot, src_off, length, span.stride, rows, load.opts.direct_io)
            yield from load.submit(fn, _bind_stage_done(load, slot, idx, dst_off, nbytes))


def _bind_stage_done(
    load: LoadEngine, slot: Slot, idx: int, dst_off: int, nbytes: int
) -> Callable[[Any], None]:
    def done(delta: Any) -> None:
        dbytes = load.dest_bytes[idx]
        assert dbytes is not None
        src = slot.host[delta : delta + nbytes]  # an O_DIRECT read starts at the page boundary
        load.copier.copy(dbytes[dst_off : dst_off + nbytes], src)  # pinned → device, on the seam
        load.release(slot)
        load.landed(idx, nbytes)

    return done


def _run_batch(ops: list[tuple[Callable[[], int], int]]) -> Callable[[], list[tuple[int, int]]]:
    def task() -> list[tuple[int, int]]:
        return [(idx, fn()) for fn, idx in ops]

    return task


def _read_task(reader: RangeReader, offset: int, mv: memoryview) -> int:
    reader.read_into(offset, mv)
    return len(mv)


def _gather_task(
    reader: FileReader, offset: int, length: int, stride: int, rows: int, dest: np.ndarray
) -> int:
    reader.gather_rows(offset, length, stride, rows, dest)
    return length * rows


def _bind_stage(
    reader: RangeReader, slot: Slot, offset: int, length: int, stride: int, rows: int, direct: bool
) -> Callable[[], int]:
    """Fill ``slot``; returns where the wanted bytes start in it (non-zero after an O_DIRECT read)."""

    def task() -> int:
        if rows == 1 or stride == length:
            n = length * rows
            if direct and isinstance(reader, FileReader) and reader.direct:
                a0 = offset - offset % 4096
                a1 = -(-(offset + n) // 4096) * 4096
                if a1 - a0 <= len(slot.view):
                    reader.read_direct(a0, slot.view[: a1 - a0], need=offset + n - a0)
                    return offset - a0
            reader.read_into(offset, slot.view[:n])
        else:
            assert isinstance(reader, FileReader)
            arr = slot.host[: length * rows].numpy().reshape(rows, length)
            reader.gather_rows(offset, length, stride, rows, arr)
        return 0

    return task


def _bind_read_counted(reader: RangeReader, offset: int, mv: memoryview) -> Callable[[], int]:
    return lambda: _read_task(reader, offset, mv)


def _bind_gather_counted(
    reader: FileReader, offset: int, length: int, stride: int, rows: int, dest: np.ndarray
) -> Callable[[], int]:
    return lambda: _gather_task(reader, offset, length, stride, rows, dest)
