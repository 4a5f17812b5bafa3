"""One load's scheduling state: worker pool, in-flight window, staging slots, landed bytes, hand-over.

The read paths (``trusted``, ``chunked``, ``whole_layer``) decide what to read and when its bytes
may be used; this engine owns everything they share: destination tensors, the FIFO window of
worker tasks, the staging slots and copies (through the device seam, ``device_copier``), byte
accounting per tensor, the load's events, and an orderly abort that waits for every in-flight read
and copy before returning.

Every path is a generator of tensor ids: it yields each id once that tensor is complete and
may be handed to the consumer, so tensors leave while later reads are still running.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from modelpack.loader import device_copier
from modelpack.loader.accounting import bytes_by_split
from modelpack.loader.blocks import span_block_copies
from modelpack.loader.device_copier import Slot
from modelpack.loader.dtypes import torch_dtype
from modelpack.loader.headers import VerifiedChunks
from modelpack.loader.options import LoaderOptions, LoadStats
from modelpack.loader.plan import FilePlan, ReadPlan, TensorRead
from modelpack.loader.readers import RangeReader
from modelpack.loader.weight_files import ResolvedSource

from modelpack.errors import LoaderError, PlanError
from modelpack.events import EventLog
from modelpack.progress import Progress


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


class LoadEngine:
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
        self.copier = device_copier.copier_for(device)
        # destinations in device memory: every byte passes a staging slot and the device seam
        self.staged = self.copier.staged
        self.opts = options
        self.stats = stats
        self.events = events
        self.out = out
        self.files = {f.relpath: f for f in src.files}
        self.readers: dict[str, RangeReader] = {}
        self.header_bytes: dict[str, bytes] = {}  # what each header was parsed from (whole mode)
        self.verified: VerifiedChunks | None = None  # chunks verified with the headers (chunk mode)
        self.tensors: list[TensorRead] = []
        self.dest: list[torch.Tensor | None] = []
        self.dest_bytes: list[torch.Tensor | None] = []
        self.remaining: list[int] = []
        self.held: list[bool] = []  # tensors waiting for a verdict: a layer digest, a cache's check
        self.ready: collections.deque[int] = collections.deque()
        self.tensor_events: dict[int, Any] = {}
        self.pool: ThreadPoolExecutor | None = None
        self.inflight: collections.deque[tuple[Future[Any], Callable[[Any], None]]] = collections.deque()
        # while not None, every task ``submit`` queues is also put here (a caller that must wait
        # for a group of its own tasks: settled.py)
        self.collecting: list[Future[Any]] | None = None
        self.prog = Progress(plan.bytes_to_read, "load", progress)
        self.remote = src.remote
        self.peers: list[ReadPlan] = []  # every rank's plan when the ranks share reads (options.group)
        # with a group: bytes read by this rank → (its node, bytes read by each node), a collective
        # (shared_read.read_by_node); None: this rank alone is its node
        self.count_nodes: Callable[[int], tuple[int, list[int]]] | None = None

    # ------------------------------------------------------------------ setup
    def _needs_ring(self) -> bool:
        return self.staged or self.opts.direct_io or any(f.mode != "trusted" for f in self.src.files)

    def setup(self) -> None:
        if self._needs_ring():
            slot_bytes = self.opts.slot_bytes
            for f in self.src.files:
                if f.mode == "chunks":
                    slot_bytes = max(slot_bytes, f.chunks.chunk_size)
            if self.opts.group is not None:
                slot_bytes += 4096  # room for the status byte a shared block carries after its data
            slots = self.opts.slots or (
                (self.opts.remote_inflight if self.remote else self.opts.local_workers) + 2
            )
            self.copier.open_slots(slots, slot_bytes)
            self.stats.ring_bytes = self.copier.ring_bytes
        workers = self.opts.remote_inflight if self.remote else self.opts.local_workers
        self.pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="modelpack-load")

    @property
    def max_inflight(self) -> int:
        if self.copier.slots:
            return self.copier.slots
        return 2 * (self.opts.remote_inflight if self.remote else self.opts.local_workers)

    def alloc(self, fp: FilePlan, *, hold: bool = False) -> list[int]:
        """Destinations for one file's tensors (caller-owned ``out`` entries are checked, not copied);
        held until ``release_held`` for a whole layer, or with ``hold``."""
        ids = []
        whole = hold or self.files[fp.file].mode == "whole"
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
                d = self.copier.empty(t.shape, dt)
            idx = len(self.tensors)
            self.tensors.append(t)
            self.dest.append(d)
            self.dest_bytes.append(_byte_view(d))
            self.remaining.append(t.nbytes)
            self.held.append(whole)
            ids.append(idx)
            if t.nbytes == 0 and not whole:
                self.ready.append(idx)
        self.copier.follow_consumer()
        return ids

    def received(self, n: int) -> None:
        """Verified bytes a peer read and broadcast (``LoaderOptions.group``)."""
        self.stats.bytes_received += n

    def adopt(self, t: TensorRead, view: torch.Tensor) -> int:
        """A tensor handed out as it is (a view of a mapped store blob): complete, nothing to read."""
        if self.stats.read_start == 0.0:
            self._read_started()  # t3: the load's data phase begins here, read or mapped
        idx = len(self.tensors)
        self.tensors.append(t)
        self.dest.append(view)
        self.dest_bytes.append(None)
        self.remaining.append(0)
        self.held.append(False)
        self.ready.append(idx)
        self.prog.update(t.nbytes)
        return idx

    # ------------------------------------------------------------------ scheduling
    def submit(self, fn: Callable[[], Any], done: Callable[[Any], None]) -> Iterator[int]:
        """Queue a task; while the window is full, finish the oldest (FIFO keeps hashing ordered)."""
        while len(self.inflight) >= self.max_inflight:
            yield from self._finish_one()
        assert self.pool is not None
        if self.stats.read_start == 0.0:
            self._read_started()
        fut = self.pool.submit(fn)
        if self.collecting is not None:
            self.collecting.append(fut)
        self.inflight.append((fut, done))

    def _finish_one(self) -> Iterator[int]:
        fut, done = self.inflight.popleft()
        done(fut.result())
        while self.ready:
            yield self.ready.popleft()

    def drain(self) -> Iterator[int]:
        while self.inflight:
            yield from self._finish_one()

    def next_slot(self) -> Generator[int, None, Slot]:
        """A free staging slot, finishing the oldest tasks until one comes back."""
        while not self.copier.has_free:
            yield from self._finish_one()
        return self.copier.acquire()

    def release(self, slot: Slot) -> None:
        """Return ``slot``; on a device it is reused only after the copies queued from it completed."""
        self.copier.release(slot)

    def landed(self, idx: int, n: int) -> None:
        self.remaining[idx] -= n
        self.prog.update(n)
        if self.remaining[idx] == 0 and not self.held[idx]:
            self._mark_ready(idx)
        elif self.remaining[idx] < 0:  # pragma: no cover - a planning bug, never silently ignored
            raise LoaderError(f"tensor {self.tensors[idx].name!r}: more bytes landed than planned")

    def release_held(self, ids: Sequence[int]) -> None:
        """The whole layer's digest matched: its complete tensors may now be handed out."""
        for i in ids:
            self.held[i] = False
            if self.remaining[i] == 0:
                self._mark_ready(i)

    def _mark_ready(self, idx: int) -> None:
        if self.staged:
            self.tensor_events[idx] = self.copier.record()
        self.ready.append(idx)

    def copy_out(self, slot: Slot, b0: int, b1: int, candidates: Sequence[int]) -> None:
        """Copy the verified block [b0, b1) (in ``slot``) into every tensor that needs part of it."""
        src = self.copier.to_device(slot, 0, b1 - b0)
        for idx in candidates:
            dbytes = self.dest_bytes[idx]
            assert dbytes is not None
            landed = 0
            for s, d, length, stride, rows in span_block_copies(self.tensors[idx].span, b0, b1):
                view = src.as_strided((rows, length), (stride, 1), src.storage_offset() + s - b0)
                self.copier.copy(dbytes[d : d + rows * length].view(rows, length), view)
                landed += rows * length
            if landed:
                self.stats.staged_bytes += landed
                self.landed(idx, landed)

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
            "ep_size": self.plan.ep_size,
            "ep_rank": self.plan.ep_rank,
            "device": str(self.device),
        }

    # ------------------------------------------------------------------ hand-over & cleanup
    def hand_over(self, idx: int) -> tuple[str, torch.Tensor]:
        t = self.dest[idx]
        assert t is not None
        t = self.copier.hand_out(t, self.tensor_events.pop(idx, None))
        self.dest[idx] = None  # the consumer owns it now; we keep no reference
        self.dest_bytes[idx] = None
        self.stats.tensors += 1
        return self.tensors[idx].name, t

    def finish(self) -> None:
        self.stats.read_done = time.time()
        self.stats.bytes_read = sum(r.bytes_read for r in self.readers.values())
        self.stats.per_file_bytes = {k: r.bytes_read for k, r in self.readers.items()}
        self.stats.bytes_by_split = bytes_by_split(self.plan, {k: r.reads for k, r in self.readers.items()})
        self._count_nodes()
        fields = self._event_fields()
        self.events.emit(
            "loader.read_done",
            stage="t4",
            **fields,
            bytes=self.stats.bytes_read,
            bytes_to_read=self.plan.bytes_to_read,
            model_bytes=self.plan.total_bytes,
            bytes_received=self.stats.bytes_received,
            node=self.stats.node,
            nodes=len(self.stats.bytes_read_by_node),
            node_bytes=self.stats.node_bytes_read,
            bytes_by_node=self.stats.bytes_read_by_node,
            bytes_by_split=self.stats.bytes_by_split,
            verification=self.stats.verification,
            duration_ms=round((self.stats.read_done - self.stats.read_start) * 1000, 3),
        )
        self.copier.synchronize()
        self.stats.device_done = time.time()
        self.events.emit(
            "loader.device_done",
            stage="t5",
            **fields,
            bytes=self.stats.bytes_read,
            tensors=len(self.tensors),
            duration_ms=round((self.stats.device_done - self.stats.read_start) * 1000, 3),
        )

    def _count_nodes(self) -> None:
        """What this rank's node and every node read (a group's ranks exchange counts; nodes.py)."""
        st = self.stats
        if self.count_nodes is not None:
            st.node, st.bytes_read_by_node = self.count_nodes(st.bytes_read)
        else:
            st.node, st.bytes_read_by_node = 0, [st.bytes_read]
        st.node_bytes_read = st.bytes_read_by_node[st.node]

    def abort(self, exc: BaseException | None) -> None:
        for fut, _ in self.inflight:
            fut.cancel()
        for fut, _ in self.inflight:
            try:
                fut.exception()  # wait: a running read may still write into a buffer
            except BaseException:
                pass
        self.inflight.clear()
        self.copier.synchronize()
        self.tensor_events.clear()
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
        if self.verified is not None:
            self.verified.clear()
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
        for r in self.readers.values():
            r.close()
        self.copier.close()
        self.prog.close()
