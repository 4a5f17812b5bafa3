"""The streaming load: plan → read (worker threads) → verify → stage → device, tensors as they land.

Paths through the pipeline, chosen per file by how far its bytes can be trusted
(``sources.WeightFile.mode``) and by the device:

- trusted file, CPU: worker threads ``preadv`` straight into the destination tensors (dim-1 shards
  gather their rows from a short mmap). No staging copy: this is the readinto ceiling.
- trusted file, CUDA (or ``direct_io``): pieces of ≤ ``slot_bytes`` are read into the pinned
  staging ring, then copied host→device on a side stream while the next reads run; a slot is
  reused only after its copy's event completed.
- chunk table: each needed chunk (reads are expanded to chunk boundaries) is read into a ring
  slot and hashed; only a verified chunk is copied out (CPU memcpy, or H2D into a device scratch
  buffer and a device-side gather into the destination).
- no table: the whole layer is read in order and hashed; its tensors are handed out only after
  the layer's sha256 matched the manifest.

Safeguards: the manifest digest is pinned (``expected_digest``), the compatibility fingerprint is
checked before any data is read, and a failure at any point raises after waiting for in-flight
reads and copies: ``load_state_dict`` then returns nothing and ``load_into`` leaves the module
untouched (it loads into fresh tensors and swaps them in at the end).
"""

from __future__ import annotations

import bisect
import collections
import hashlib
import math
import os
import struct
import time
import uuid
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from modelpack.loader.fingerprint import (
    Fingerprint,
    FingerprintLike,
    check_fingerprint,
    device_arch,
    rank_layout_digest,
)
from modelpack.loader.plan import FilePlan, ReadPlan, RulesLike, Span, TensorRead
from modelpack.loader.readers import FileReader, RangeReader
from modelpack.loader.sources import ResolvedSource, WeightFile, resolve_source
from modelpack.loader.staging import Slot, StagingRing

from modelpack.errors import (
    DigestMismatchError,
    LoaderError,
    PlanError,
    SizeMismatchError,
    UnsupportedDtypeError,
)
from modelpack.events import EventLog, NullEventLog
from modelpack.packing.safetensors_format import MAX_HEADER_BYTES, SafetensorsHeader, parse_header_bytes
from modelpack.progress import Progress

MiB = 1024 * 1024

_TORCH_DTYPES: dict[str, str] = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "I16": "int16",
    "U16": "uint16",
    "F16": "float16",
    "BF16": "bfloat16",
    "I32": "int32",
    "U32": "uint32",
    "F32": "float32",
    "C64": "complex64",
    "I64": "int64",
    "U64": "uint64",
    "F64": "float64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E8M0": "float8_e8m0fnu",
}


def torch_dtype(st_dtype: str, *, where: str = "") -> torch.dtype:
    name = _TORCH_DTYPES.get(st_dtype)
    dt = getattr(torch, name, None) if name else None
    if not isinstance(dt, torch.dtype):
        raise UnsupportedDtypeError(f"{where}: safetensors dtype {st_dtype} has no torch equivalent here")
    return dt


@dataclass
class LoaderOptions:
    """Tuning knobs; the defaults suit a 2–16 core node reading NVMe or a loopback registry."""

    workers: int = 0  # local read threads; 0 = cores + 1, at most 8 (one spare keeps a read in flight)
    remote_inflight: int = 8  # range requests in flight for a registry / S3
    piece_bytes: int = 16 * MiB  # unit of a direct read and of a remote range
    batch_bytes: int = 64 * MiB  # direct reads one worker task runs back to back
    slot_bytes: int = 16 * MiB  # staging buffer size (raised to the chunk size when larger)
    slots: int = 0  # staging buffers; 0 = workers + 2 (local) or remote_inflight + 2 (remote)
    direct_io: bool = False  # O_DIRECT reads through the aligned ring (cold NVMe)
    uneven: str = "refuse"  # or "chunk" (torch.chunk-compatible split), see plan.py

    @property
    def local_workers(self) -> int:
        if self.workers > 0:
            return self.workers
        return min(8, (os.cpu_count() or 2) + 1)


@dataclass
class LoadStats:
    """Filled in place while a load runs; final once the iterator is exhausted."""

    reference: str = ""
    digest: str | None = None
    start_id: str = ""
    state: str = ""
    bytes_to_read: int = 0
    bytes_read: int = 0
    tensors: int = 0
    read_start: float = 0.0
    read_done: float = 0.0
    device_done: float = 0.0
    ring_bytes: int = 0
    fingerprint: Fingerprint | None = None
    plan: ReadPlan | None = None
    per_file_bytes: dict[str, int] = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        return max(0.0, self.device_done - self.read_start)

    @property
    def gbps(self) -> float:
        return self.bytes_read / self.seconds / 1e9 if self.seconds else 0.0


# --------------------------------------------------------------------------- helpers
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


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def read_header(
    reader: RangeReader, name: str, size: int, verify: Callable[[int, int], bytes] | None
) -> SafetensorsHeader:
    """Header of one file; ``verify(offset, length)`` returns verified bytes (chunk mode)."""

    def get(offset: int, length: int) -> bytes:
        if verify is not None:
            return verify(offset, length)
        buf = bytearray(length)
        reader.read_into(offset, memoryview(buf))
        return bytes(buf)

    from modelpack.errors import SafetensorsError

    if size < 8:
        raise SafetensorsError(name, f"file is {size} bytes; a safetensors file has at least 8")
    prefix = get(0, 8)
    (n,) = struct.unpack("<Q", prefix)
    if n > MAX_HEADER_BYTES:
        raise SafetensorsError(name, f"header length {n} exceeds the 100 MB limit")
    if 8 + n > size:
        raise SafetensorsError(name, f"header length {n} runs past the end of the file ({size} bytes)")
    return parse_header_bytes(name, prefix, get(8, n), size)


class _ChunkFetcher:
    """Verified reads of arbitrary byte ranges through whole chunks (header parsing in chunk mode)."""

    def __init__(self, reader: RangeReader, file: WeightFile) -> None:
        self.reader = reader
        self.file = file
        self.table = file.chunks
        self.layer = str(file.descriptor.digest) if file.descriptor else ""
        # the last verified chunk: the 8-byte prefix and the header JSON are two reads that
        # usually fall in the same chunk, which should cross the network once
        self._last: tuple[int, bytearray] | None = None

    def __call__(self, offset: int, length: int) -> bytes:
        cs = self.table.chunk_size
        out = bytearray()
        first, last = offset // cs, (offset + length - 1) // cs
        for idx in range(first, last + 1):
            c0, clen = self.table.chunk_range(self.layer, idx)
            if self._last is not None and self._last[0] == idx:
                buf = self._last[1]
            else:
                buf = bytearray(clen)
                self.reader.read_into(c0, memoryview(buf))
                self.table.verify_chunk(self.layer, idx, memoryview(buf))
                self._last = (idx, buf)
            s = max(offset, c0) - c0
            e = min(offset + length, c0 + clen) - c0
            out += buf[s:e]
        return bytes(out)


# --------------------------------------------------------------------------- the load
class _Load:
    """One load's state. Driven by ``iter_tensors``; every buffer and thread is released in close()."""

    def __init__(
        self,
        src: ResolvedSource,
        plan: ReadPlan,
        device: torch.device,
        options: LoaderOptions,
        stats: LoadStats,
        events: EventLog,
        out: Mapping[str, torch.Tensor] | None,
        progress: str,
    ) -> None:
        self.src = src
        self.plan = plan
        self.device = device
        self.cuda = device.type == "cuda"
        self.opts = options
        self.stats = stats
        self.events = events
        self.out = out
        self.files = {f.relpath: f for f in src.files}
        self.readers: dict[str, RangeReader] = {}
        self.tensors: list[TensorRead] = []
        self.dest: list[torch.Tensor | None] = []
        self.dest_bytes: list[torch.Tensor | None] = []
        self.remaining: list[int] = []
        self.held: list[bool] = []  # whole-mode tensors wait for their layer digest
        self.ready: collections.deque[int] = collections.deque()
        self.ring: StagingRing | None = None
        self.free_slots: list[Slot] = []
        self.side: Any = None
        self.tensor_events: dict[int, Any] = {}
        self.pool: ThreadPoolExecutor | None = None
        self.inflight: collections.deque[tuple[Future[Any], Callable[[Any], None]]] = collections.deque()
        self.prog = Progress(plan.bytes_to_read, "load", progress)
        self.remote = src.remote

    # ------------------------------------------------------------------ setup
    def _needs_ring(self) -> bool:
        return self.cuda or self.opts.direct_io or any(f.mode != "trusted" for f in self.src.files)

    def setup(self) -> None:
        if self._needs_ring():
            slot_bytes = self.opts.slot_bytes
            for f in self.src.files:
                if f.mode == "chunks":
                    slot_bytes = max(slot_bytes, f.chunks.chunk_size)
            slots = self.opts.slots or (
                (self.opts.remote_inflight if self.remote else self.opts.local_workers) + 2
            )
            self.ring = StagingRing(slots, slot_bytes, self.device)
            self.free_slots = self.ring.buffers
            self.stats.ring_bytes = self.ring.nbytes
        if self.cuda:
            self.side = torch.cuda.Stream(device=self.device)
        workers = self.opts.remote_inflight if self.remote else self.opts.local_workers
        self.pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="modelpack-load")

    @property
    def max_inflight(self) -> int:
        if self.ring is not None:
            return self.ring.slots
        return 2 * (self.opts.remote_inflight if self.remote else self.opts.local_workers)

    def _alloc(self, fp: FilePlan) -> list[int]:
        ids = []
        whole = self.files[fp.file].mode == "whole"
        for t in fp.tensors:
            where = f"{fp.file}: tensor {t.name!r}"
            dt = torch_dtype(t.dtype, where=where)
            if self.out is not None and t.name in self.out:
                d = self.out[t.name]
                if (
                    tuple(d.shape) != t.shape
                    or d.dtype != dt
                    or d.device != self.device
                    or not d.is_contiguous()
                ):
                    raise PlanError(
                        f"{where}: destination is {tuple(d.shape)} {d.dtype} on {d.device}, "
                        f"the plan needs contiguous {t.shape} {dt} on {self.device}"
                    )
            else:
                d = torch.empty(t.shape, dtype=dt, device=self.device)
            idx = len(self.tensors)
            self.tensors.append(t)
            self.dest.append(d)
            self.dest_bytes.append(_byte_view(d))
            self.remaining.append(t.nbytes)
            self.held.append(whole)
            ids.append(idx)
            if t.nbytes == 0 and not whole:
                self.ready.append(idx)
        if self.cuda:
            # memory the consumer freed on its stream may be handed to these new tensors while its
            # kernels still read it; our copies run on the side stream, so order them after that work
            self.side.wait_stream(torch.cuda.current_stream(self.device))
        return ids

    # ------------------------------------------------------------------ scheduling
    def _submit(self, fn: Callable[[], Any], done: Callable[[Any], None]) -> Iterator[int]:
        """Queue a task; while the window is full, finish the oldest (FIFO keeps hashing ordered)."""
        while len(self.inflight) >= self.max_inflight:
            yield from self._finish_one()
        assert self.pool is not None
        if self.stats.read_start == 0.0:
            self._read_started()
        self.inflight.append((self.pool.submit(fn), done))

    def _finish_one(self) -> Iterator[int]:
        fut, done = self.inflight.popleft()
        done(fut.result())
        while self.ready:
            yield self.ready.popleft()

    def _drain(self) -> Iterator[int]:
        while self.inflight:
            yield from self._finish_one()

    def _acquire(self) -> Slot:
        slot = self.free_slots.pop()
        if slot.event is not None:
            slot.event.synchronize()
            slot.event = None
        return slot

    def _release(self, slot: Slot) -> None:
        if self.cuda:
            ev = torch.cuda.Event()
            ev.record(self.side)
            slot.event = ev
        self.free_slots.append(slot)

    def _landed(self, idx: int, n: int) -> None:
        self.remaining[idx] -= n
        self.prog.update(n)
        if self.remaining[idx] == 0 and not self.held[idx]:
            if self.cuda:
                ev = torch.cuda.Event()
                ev.record(self.side)
                self.tensor_events[idx] = ev
            self.ready.append(idx)
        elif self.remaining[idx] < 0:  # pragma: no cover - a planning bug, never silently ignored
            raise LoaderError(f"tensor {self.tensors[idx].name!r}: more bytes landed than planned")

    def _read_started(self) -> None:
        self.stats.read_start = time.time()
        self.events.emit(
            "loader.read_start",
            stage="t3",
            **self._event_fields(),
            bytes=self.plan.bytes_to_read,
        )

    def _event_fields(self) -> dict[str, Any]:
        return {
            "start_id": self.stats.start_id,
            "state": self.stats.state,
            "reference": self.src.name,
            "digest": self.src.digest,
            "tp_size": self.plan.tp_size,
            "tp_rank": self.plan.tp_rank,
            "device": str(self.device),
        }

    # ------------------------------------------------------------------ per-file task streams
    def run(self) -> Iterator[int]:
        for rel, fp in self.plan.files.items():
            f = self.files[rel]
            ids = self._alloc(fp)
            reader = self.readers[rel]
            if f.mode == "trusted" and not self.cuda and not self.opts.direct_io:
                yield from self._trusted_direct(reader, ids)
            elif f.mode == "trusted":
                yield from self._trusted_staged(reader, ids)
            elif f.mode == "chunks":
                yield from self._chunked(reader, f, fp, ids)
            else:
                yield from self._whole(reader, f, fp, ids)
            while self.ready:
                yield self.ready.popleft()
        yield from self._drain()

    def _trusted_direct(self, reader: RangeReader, ids: list[int]) -> Iterator[int]:
        """Reads straight into the destinations, batched so a worker runs ~``batch_bytes`` per task.

        Batching matters on few cores: every completion wakes the scheduling thread, and a wake-up
        per 16 MiB piece measurably steals CPU from the readers.
        """
        piece = self.opts.piece_bytes
        batch: list[tuple[Callable[[], int], int]] = []
        batch_bytes = 0
        for idx in ids:
            t = self.tensors[idx]
            span = t.span
            dbytes = self.dest_bytes[idx]
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
                if batch_bytes >= self.opts.batch_bytes:
                    yield from self._submit(_run_batch(batch), self._batch_done)
                    batch, batch_bytes = [], 0
        if batch:
            yield from self._submit(_run_batch(batch), self._batch_done)

    def _batch_done(self, landed: Any) -> None:
        for idx, n in landed:
            self._landed(idx, n)

    def _trusted_staged(self, reader: RangeReader, ids: list[int]) -> Iterator[int]:
        """Pinned ring → device (CUDA), or aligned ring → memcpy (O_DIRECT on CPU)."""
        assert self.ring is not None
        # O_DIRECT widens each read to 4 KiB pages on both ends: keep that inside the slot
        cap = self.ring.slot_bytes - (2 * 4096 if self.opts.direct_io else 0)
        for idx in ids:
            span = self.tensors[idx].span
            if span.nbytes == 0:
                continue
            if span.contiguous:
                parts = [
                    (span.offset + o, o, min(cap, span.nbytes - o), 1) for o in range(0, span.nbytes, cap)
                ]
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
                        f"tensor {self.tensors[idx].name!r}: a row of {span.length} bytes exceeds the staging "
                        f"slot ({cap}); raise LoaderOptions.slot_bytes"
                    )
                slot = yield from self._slot()
                nbytes = length * rows
                fn = _bind_stage(reader, slot, src_off, length, span.stride, rows, self.opts.direct_io)
                yield from self._submit(fn, self._bind_stage_done(slot, idx, dst_off, nbytes))

    def _slot(self) -> Generator[int, None, Slot]:
        while not self.free_slots:
            yield from self._finish_one()
        return self._acquire()

    def _bind_stage_done(self, slot: Slot, idx: int, dst_off: int, nbytes: int) -> Callable[[Any], None]:
        def done(delta: Any) -> None:
            dbytes = self.dest_bytes[idx]
            assert dbytes is not None
            src = slot.host[delta : delta + nbytes]  # an O_DIRECT read starts at the page boundary
            if self.cuda:
                with torch.cuda.stream(self.side):
                    dbytes[dst_off : dst_off + nbytes].copy_(src, non_blocking=True)
            else:
                dbytes[dst_off : dst_off + nbytes].copy_(src)
            self._release(slot)
            self._landed(idx, nbytes)

        return done

    def _copy_out(self, slot: Slot, b0: int, b1: int, candidates: Sequence[int]) -> None:
        """Copy the verified block [b0, b1) (in ``slot``) into every tensor that needs part of it."""
        src = slot.host
        if self.cuda:
            assert slot.device is not None
            with torch.cuda.stream(self.side):
                slot.device[: b1 - b0].copy_(slot.host[: b1 - b0], non_blocking=True)
            src = slot.device
        for idx in candidates:
            dbytes = self.dest_bytes[idx]
            assert dbytes is not None
            landed = 0
            for s, d, length, stride, rows in span_block_copies(self.tensors[idx].span, b0, b1):
                view = src.as_strided((rows, length), (stride, 1), s - b0)
                dst = dbytes[d : d + rows * length].view(rows, length)
                if self.cuda:
                    with torch.cuda.stream(self.side):
                        dst.copy_(view, non_blocking=True)
                else:
                    dst.copy_(view)
                landed += rows * length
            if landed:
                self._landed(idx, landed)

    def _index(self, ids: list[int]) -> tuple[list[int], list[int], list[int]]:
        order = sorted(ids, key=lambda i: self.tensors[i].span.offset)
        starts = [self.tensors[i].span.offset for i in order]
        ends = [self.tensors[i].span.end for i in order]
        return order, starts, ends

    @staticmethod
    def _candidates(index: tuple[list[int], list[int], list[int]], b0: int, b1: int) -> list[int]:
        order, starts, ends = index
        i = bisect.bisect_right(ends, b0)
        out = []
        while i < len(order) and starts[i] < b1:
            if ends[i] > b0:
                out.append(order[i])
            i += 1
        return out

    def _chunked(self, reader: RangeReader, f: WeightFile, fp: FilePlan, ids: list[int]) -> Iterator[int]:
        table = f.chunks
        layer = str(f.descriptor.digest) if f.descriptor else ""
        cs = table.chunk_size
        needed: set[int] = set()
        for s, e in fp.extents(covering=True):
            needed.update(range(s // cs, (e - 1) // cs + 1))
        index = self._index([i for i in ids if self.tensors[i].span.nbytes])
        assert self.ring is not None
        cap = max(1, self.ring.slot_bytes // cs)  # consecutive chunks fetched by one range read
        groups: list[list[int]] = []
        for c in sorted(needed):
            if groups and groups[-1][-1] == c - 1 and len(groups[-1]) < cap:
                groups[-1].append(c)
            else:
                groups.append([c])
        for group in groups:
            g0, _ = table.chunk_range(layer, group[0])
            last0, last_len = table.chunk_range(layer, group[-1])
            glen = last0 + last_len - g0
            slot = yield from self._slot()

            def task(slot: Slot = slot, group: list[int] = group, g0: int = g0, glen: int = glen) -> None:
                reader.read_into(g0, slot.view[:glen])
                for c in group:  # every chunk checked before ANY byte is copied towards a tensor
                    c0, clen = table.chunk_range(layer, c)
                    table.verify_chunk(layer, c, slot.view[c0 - g0 : c0 - g0 + clen])

            def done(_: Any, slot: Slot = slot, g0: int = g0, glen: int = glen) -> None:
                self._copy_out(slot, g0, g0 + glen, self._candidates(index, g0, g0 + glen))
                self._release(slot)

            yield from self._submit(task, done)

    def _whole(self, reader: RangeReader, f: WeightFile, fp: FilePlan, ids: list[int]) -> Iterator[int]:
        assert self.ring is not None and f.descriptor is not None
        desc = f.descriptor
        size = desc.size
        block = self.ring.slot_bytes
        hasher = hashlib.sha256()
        index = self._index([i for i in ids if self.tensors[i].span.nbytes])
        nblocks = max(1, math.ceil(size / block))
        for b in range(nblocks):
            b0 = b * block
            b1 = min(size, b0 + block)
            slot = yield from self._slot()

            def task(slot: Slot = slot, b0: int = b0, b1: int = b1) -> None:
                reader.read_into(b0, slot.view[: b1 - b0])

            def done(_: Any, slot: Slot = slot, b0: int = b0, b1: int = b1) -> None:
                hasher.update(slot.view[: b1 - b0])  # FIFO completion keeps the hash in file order
                self._copy_out(slot, b0, b1, self._candidates(index, b0, b1))
                self._release(slot)

            yield from self._submit(task, done)
        # every block must be hashed before the verdict: finish this file's reads first
        yield from self._drain()
        actual = "sha256:" + hasher.hexdigest()
        if actual != desc.digest:
            raise DigestMismatchError(desc.digest, actual, what=f"layer {f.relpath}", source=self.src.name)
        for i in ids:
            self.held[i] = False
            if self.remaining[i] == 0:
                if self.cuda:
                    ev = torch.cuda.Event()
                    ev.record(self.side)
                    self.tensor_events[i] = ev
                self.ready.append(i)

    # ------------------------------------------------------------------ hand-over & cleanup
    def hand_over(self, idx: int) -> tuple[str, torch.Tensor]:
        ev = self.tensor_events.pop(idx, None)
        if ev is not None:
            ev.synchronize()
        t = self.dest[idx]
        assert t is not None
        self.dest[idx] = None  # the consumer owns it now; we keep no reference
        self.dest_bytes[idx] = None
        self.stats.tensors += 1
        return self.tensors[idx].name, t

    def finish(self) -> None:
        self.stats.read_done = time.time()
        self.stats.bytes_read = sum(r.bytes_read for r in self.readers.values())
        self.stats.per_file_bytes = {k: r.bytes_read for k, r in self.readers.items()}
        fields = self._event_fields()
        self.events.emit(
            "loader.read_done",
            stage="t4",
            **fields,
            bytes=self.stats.bytes_read,
            duration_ms=round((self.stats.read_done - self.stats.read_start) * 1000, 3),
        )
        if self.cuda:
            self.side.synchronize()
        self.stats.device_done = time.time()
        self.events.emit(
            "loader.device_done",
            stage="t5",
            **fields,
            bytes=self.stats.bytes_read,
            tensors=len(self.tensors),
            duration_ms=round((self.stats.device_done - self.stats.read_start) * 1000, 3),
        )

    def abort(self, exc: BaseException | None) -> None:
        for fut, _ in self.inflight:
            fut.cancel()
        for fut, _ in self.inflight:
            try:
                fut.exception()  # wait: a running read may still write into a buffer
            except BaseException:
                pass
        self.inflight.clear()
        if self.cuda and self.side is not None:
            self.side.synchronize()
        self.dest.clear()
        self.dest_bytes.clear()
        self.ready.clear()
        if exc is None:
            self.events.emit("loader.abandoned", **self._event_fields(), tensors=self.stats.tensors)
            return
        self.events.emit(
            "loader.failed",
            **self._event_fields(),
            reason=f"{type(exc).__name__}: {exc}"[:2000],
        )

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
        for r in self.readers.values():
            r.close()
        if self.ring is not None:
            self.free_slots.clear()
            self.ring.close()
        self.prog.close()


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


# --------------------------------------------------------------------------- public API
EventsLike = EventLog | str | None


def _event_log(events: EventsLike) -> EventLog:
    if events is None:
        return NullEventLog()
    if isinstance(events, str):
        return EventLog(events)
    return events


@dataclass
class PreparedLoad:
    """A resolved source with its headers, plan and fingerprint — everything short of reading data."""

    source: ResolvedSource
    headers: dict[str, SafetensorsHeader]
    plan: ReadPlan
    fingerprint: Fingerprint
    readers: dict[str, RangeReader]

    def close(self) -> None:
        for r in self.readers.values():
            r.close()
        self.source.close()


def prepare(
    source: Any,
    *,
    device: str | torch.device = "cpu",
    tp_size: int = 1,
    tp_rank: int = 0,
    rules: RulesLike = None,
    presets: bool = True,
    expected_digest: str | None = None,
    trusted_keys: Sequence[Any] | None = None,
    chunk_table: Any = None,
    target_options: Any = None,
    allow_unverified: bool = False,
    options: LoaderOptions | None = None,
) -> PreparedLoad:
    """Resolve the source, read (and verify, where a table exists) the headers, plan this rank."""
    opts = options or LoaderOptions()
    src = resolve_source(
        source,
        expected_digest=expected_digest,
        chunk_table=chunk_table,
        trusted_keys=trusted_keys,
        target_options=target_options,
        allow_unverified=allow_unverified,
        direct=opts.direct_io,
    )
    readers: dict[str, RangeReader] = {}
    try:
        if not src.files:
            raise LoaderError(f"{src.name}: the model has no safetensors weight files")
        headers: dict[str, SafetensorsHeader] = {}
        for f in src.files:
            reader = f.open()
            readers[f.relpath] = reader
            if f.size >= 0 and reader.size != f.size:
                raise SizeMismatchError(
                    str(f.descriptor.digest) if f.descriptor else f.relpath,
                    f.size,
                    reader.size,
                    source=src.name,
                )
            verify = _ChunkFetcher(reader, f) if f.mode == "chunks" else None
            headers[f.relpath] = read_header(reader, f"{src.name}/{f.relpath}", reader.size, verify)
        plan = ReadPlan.build(headers, tp_size, tp_rank, rules, presets=presets, uneven=opts.uneven)
        dev = torch.device(device)
        for t in plan.tensors:
            torch_dtype(t.dtype, where=f"{t.file}: tensor {t.name!r}")
        fp = Fingerprint(
            manifest_digest=src.digest or "",
            dtype=",".join(sorted({t.dtype for t in plan.tensors})),
            quantization=src.quantization,
            tp_size=tp_size,
            tp_rank=tp_rank,
            rank_layout=rank_layout_digest({t.name: (t.rule.value, t.shape) for t in plan.tensors}),
            device_arch=device_arch(dev),
        )
        return PreparedLoad(src, headers, plan, fp, readers)
    except BaseException:
        for r in readers.values():
            r.close()
        src.close()
        raise


def iter_tensors(
    source: Any,
    device: str | torch.device = "cpu",
    tp_size: int = 1,
    tp_rank: int = 0,
    rules: RulesLike = None,
    *,
    expected_digest: str | None = None,
    fingerprint: FingerprintLike | None = None,
    trusted_keys: Sequence[Any] | None = None,
    chunk_table: Any = None,
    progress: str = "off",
    events: EventsLike = None,
    start_id: str | None = None,
    state: str | None = None,
    presets: bool = True,
    target_options: Any = None,
    allow_unverified: bool = False,
    options: LoaderOptions | None = None,
    stats: LoadStats | None = None,
    out: Mapping[str, torch.Tensor] | None = None,
    on_plan: Callable[[ReadPlan], None] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for this rank's shard of every tensor, as each one lands.

    ``source``: a snapshot directory, ``(NodeCache, ref)``, ``(ReadableTarget, ref)`` or a reference
    string. A remote reference must be pinned (``expected_digest`` or ``@sha256:…``). If the load
    fails the iterator raises; tensors already yielded must then be discarded by the caller
    (``load_state_dict`` and ``load_into`` do that for you). ``out`` maps names to caller-owned
    destinations to fill in place (no allocation; on failure their content is undefined).
    """
    opts = options or LoaderOptions()
    st = stats if stats is not None else LoadStats()
    # one start = one id across the node cache's and the loader's events (the k8s recipes set
    # MODELPACK_START_ID to the pod UID in both containers)
    st.start_id = start_id or os.environ.get("MODELPACK_START_ID") or uuid.uuid4().hex
    log = _event_log(events)
    try:
        prep = prepare(
            source,
            device=device,
            tp_size=tp_size,
            tp_rank=tp_rank,
            rules=rules,
            presets=presets,
            expected_digest=expected_digest,
            trusted_keys=trusted_keys,
            chunk_table=chunk_table,
            target_options=target_options,
            allow_unverified=allow_unverified,
            options=opts,
        )
    except BaseException as exc:
        log.emit(
            "loader.refused",
            start_id=st.start_id,
            state=state,
            reference=source if isinstance(source, str) else type(source).__name__,
            digest=expected_digest,
            reason=f"{type(exc).__name__}: {exc}"[:2000],
        )
        raise
    st.reference = prep.source.name
    st.digest = prep.source.digest
    st.state = state or prep.source.state
    st.fingerprint = prep.fingerprint
    st.plan = prep.plan
    st.bytes_to_read = prep.plan.bytes_to_read
    if st.state == "streamed":
        # no node cache said "version confirmed" for this start: the pinned manifest (and its
        # chunk table) just resolved and verified here is that point
        log.emit(
            "loader.version_confirmed",
            stage="t2",
            start_id=st.start_id,
            state=st.state,
            reference=prep.source.name,
            digest=prep.source.digest,
        )
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    load: _Load | None = None
    try:
        if fingerprint is not None:
            check_fingerprint(fingerprint, prep.fingerprint)
        if on_plan is not None:
            on_plan(prep.plan)
        load = _Load(prep.source, prep.plan, dev, opts, st, log, out, progress)
        load.readers = prep.readers
        load.setup()
        try:
            for idx in load.run():
                yield load.hand_over(idx)
            load.finish()
        except GeneratorExit:
            load.abort(None)  # the consumer stopped early: not a failure, but nothing more lands
            raise
        except BaseException as exc:
            load.abort(exc)
            raise
    except BaseException as exc:
        if load is None:
            log.emit(
                "loader.refused",
                start_id=st.start_id,
                state=st.state,
                reference=prep.source.name,
                digest=prep.source.digest,
                reason=f"{type(exc).__name__}: {exc}"[:2000],
            )
        raise
    finally:
        if load is not None:
            load.close()
        prep.close()


def load_state_dict(
    source: Any, device: str | torch.device = "cpu", **kwargs: Any
) -> dict[str, torch.Tensor]:
    """All of this rank's tensors, or an exception and nothing: the dict exists only on success."""
    result: dict[str, torch.Tensor] = {}
    try:
        for name, tensor in iter_tensors(source, device, **kwargs):
            result[name] = tensor
    except BaseException:
        result.clear()
        raise
    return result


def load_into(
    module: torch.nn.Module,
    source: Any,
    device: str | torch.device | None = None,
    *,
    strict: bool = True,
    **kwargs: Any,
) -> LoadStats:
    """Load this rank's weights into ``module``: fresh tensors first, one swap at the end.

    Shapes and dtypes are checked against the module before any data is read, so a mismatch
    refuses the load without touching the module; a failure while reading leaves it untouched.
    """
    if device is None:
        try:
            device = next(module.parameters()).device
        except StopIteration:
            device = "cpu"
    stats: LoadStats = kwargs.pop("stats", None) or LoadStats()
    expected = module.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    it = iter_tensors(
        source,
        device,
        stats=stats,
        on_plan=lambda plan: _check_against_module(plan, expected, strict),
        **kwargs,
    )
    try:
        for name, tensor in it:
            tensors[name] = tensor
    except BaseException:
        tensors.clear()
        raise
    missing, unexpected = module.load_state_dict(tensors, strict=strict, assign=True)
    del missing, unexpected
    return stats


def _check_against_module(plan: ReadPlan | None, expected: Mapping[str, torch.Tensor], strict: bool) -> None:
    if plan is None:
        return
    problems = []
    names = set()
    for t in plan.tensors:
        names.add(t.name)
        e = expected.get(t.name)
        if e is None:
            if strict:
                problems.append(f"{t.name}: not in the module")
            continue
        if tuple(e.shape) != t.shape:
            problems.append(f"{t.name}: module has {tuple(e.shape)}, the checkpoint shard is {t.shape}")
        elif e.dtype != torch_dtype(t.dtype):
            problems.append(f"{t.name}: module has {e.dtype}, the checkpoint has {t.dtype}")
    if strict:
        problems.extend(f"{n}: missing from the checkpoint" for n in sorted(set(expected) - names))
    if problems:
        raise LoaderError("checkpoint does not fit the module: " + "; ".join(problems[:20]))


def emit_check(
    events: EventsLike,
    *,
    start_id: str,
    digest: str | None,
    passed: bool,
    duration_ms: float | None = None,
    **fields: Any,
) -> None:
    """Record the t9 point (first deterministic check after the load) for ``modelpack timeline``."""
    _event_log(events).emit(
        "loader.check",
        stage="t9" if passed else None,
        start_id=start_id,
        digest=digest,
        passed=passed,
        duration_ms=duration_ms,
        **fields,
    )


__all__ = [
    "LoadStats",
    "LoaderOptions",
    "PreparedLoad",
    "emit_check",
    "iter_tensors",
    "load_into",
    "load_state_dict",
    "prepare",
    "span_block_copies",
    "torch_dtype",
]
