"""A test device: host memory with CUDA's asynchronous semantics, so a CPU run sees device bugs.

Not a device to load onto for real: the tests select it (``tests/fixtures/device.py``) by replacing
``device_copier.copier_for``; nothing in the package does. A load then runs its device code path
(pinned staging slots, side-stream copies, events, device-side broadcasts) over a ``StandinDevice``:

- **copies complete later than they are issued**: a queued copy runs on the device's worker thread
  after a random delay (seeded, at most ``max_delay_s``), in order within a stream and in a random
  order across streams, as CUDA's do; ``Event.synchronize`` / ``Stream.synchronize`` /
  ``wait_stream`` wait exactly as theirs;
- **a slot reused before its completion is caught**: a copy checksums its source when it is queued
  and again when it runs; different bytes mean the source (a staging slot) was overwritten while the
  copy was pending: the destination is poisoned and the violation raised at the next synchronize,
  as CUDA reports an asynchronous error (``StandinViolation``, an ``AssertionError``: no
  ``pytest.raises(LoaderError)`` swallows it);
- **a tensor handed out before its event is caught**: ``consumer_sees`` (called at hand-out) refuses
  a tensor that a pending copy still writes;
- new device memory is poisoned (0xA5 bytes: what an unwritten byte reads as);
- **device out of memory**: ``fail_after_bytes`` makes ``empty`` raise ``torch.OutOfMemoryError``
  once that many bytes of device memory were allocated;
- leaks are counted: ``pinned_live`` (pinned buffers not freed) and ``pending`` (copies not run).
"""

from __future__ import annotations

import mmap
import random
import threading
import time
import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from modelpack.loader.device_copier import Collective, DeviceStream

POISON = 0xA5


class StandinViolation(AssertionError):
    """The loader broke a rule of asynchronous device memory that a real GPU would punish silently."""


def _range(t: torch.Tensor) -> tuple[int, int]:
    if t.numel() == 0:
        return (t.data_ptr(), t.data_ptr())
    reach = sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True))
    return (t.data_ptr(), t.data_ptr() + (reach + 1) * t.element_size())


def _checksum(t: torch.Tensor) -> int:
    return zlib.crc32(t.contiguous().reshape(-1).view(torch.uint8).numpy().data)


@dataclass
class _Op:
    stream: StandinStream
    due: float
    copy: tuple[torch.Tensor, torch.Tensor, int] | None = None  # (dst, src, pinned src's crc32 or -1)
    waits_for: StandinEvent | None = None
    marks: StandinEvent | None = None
    running: bool = False  # claimed by the worker or a waiting thread
    done: bool = False


@dataclass(eq=False)
class StandinEvent:
    device: StandinDevice
    done: bool = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.device._wait(lambda: self.done)


@dataclass(eq=False)
class StandinStream:
    device: StandinDevice
    name: str
    ops: deque[_Op] = field(default_factory=deque)

    def wait_stream(self, other: StandinStream) -> None:
        """Work queued here from now on runs after everything queued on ``other`` so far."""
        ev = self.device.record(other)
        self.device._queue(_Op(self, 0.0, waits_for=ev))

    def synchronize(self) -> None:
        self.device.record(self).synchronize()


def _own(stream: DeviceStream) -> StandinStream:
    """The stand-in's stream behind a handle the seam passed back (only its own are valid)."""
    if not isinstance(stream, StandinStream):
        raise StandinViolation(f"stand-in device given a foreign stream {stream!r}")
    return stream


class StandinDevice:
    """``DeviceRuntime`` (``device_copier``) over host memory, with a device worker thread."""

    def __init__(
        self, seed: int = 0, max_delay_s: float = 0.002, fail_after_bytes: int | None = None
    ) -> None:
        self.rng = random.Random(seed)
        self.max_delay_s = max_delay_s
        self.fail_after_bytes = fail_after_bytes
        self.allocated = 0
        self.pinned_live = 0
        self.violations: list[str] = []
        self._reported = 0
        self._cv = threading.Condition()
        self._streams: list[StandinStream] = []
        self._pinned: list[tuple[int, int]] = []  # (start, end) of every live pinned buffer
        self._hurry = 0  # callers blocked in a synchronize: due times no longer matter
        self._closed = False
        self.default = self._new_stream("default")
        self._worker = threading.Thread(target=self._run, name="standin-device", daemon=True)
        self._worker.start()

    # ------------------------------------------------------------------ DeviceRuntime
    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype)
        with self._cv:
            if self.fail_after_bytes is not None and self.allocated + t.nbytes > self.fail_after_bytes:
                raise torch.OutOfMemoryError(
                    f"stand-in device: out of memory allocating {t.nbytes} bytes "
                    f"({self.allocated} of {self.fail_after_bytes} in use)"
                )
            self.allocated += t.nbytes
        t.reshape(-1).view(torch.uint8).fill_(POISON)
        return t

    def pinned(self, nbytes: int) -> torch.Tensor:
        with self._cv:
            self.pinned_live += 1
        # page-aligned, as cudaHostAlloc's memory is (O_DIRECT reads into it)
        t = torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)
        t.fill_(POISON)
        with self._cv:
            self._pinned.append(_range(t))
        return t

    def free_pinned(self, t: torch.Tensor) -> None:
        with self._cv:
            self.pinned_live -= 1
            self._pinned.remove(_range(t))

    def stream(self) -> StandinStream:
        with self._cv:
            return self._new_stream(f"side-{len(self._streams)}")

    def current_stream(self) -> StandinStream:
        return self.default

    def record(self, stream: DeviceStream) -> StandinEvent:
        ev = StandinEvent(self)
        self._queue(_Op(_own(stream), 0.0, marks=ev))
        return ev

    def wait(self, stream: DeviceStream, other: DeviceStream) -> None:
        _own(stream).wait_stream(_own(other))

    def synchronize(self, stream: DeviceStream) -> None:
        _own(stream).synchronize()

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: DeviceStream) -> None:
        stream = _own(stream)
        if tuple(dst.shape) != tuple(src.shape) or dst.dtype != src.dtype:
            raise RuntimeError(
                f"stand-in copy: {tuple(src.shape)} {src.dtype} into {tuple(dst.shape)} {dst.dtype}"
            )
        delay = self.rng.uniform(0.0, self.max_delay_s)
        # a pinned source is written by the host (readers), outside any stream's order: its bytes
        # must not change until the copy ran. A device source may be written by earlier work on
        # the stream (the staging copy a gather reads): stream order covers that.
        lo, hi = _range(src)
        with self._cv:
            pinned = any(p0 <= lo and hi <= p1 for p0, p1 in self._pinned)
        self._queue(_Op(stream, time.monotonic() + delay, copy=(dst, src, _checksum(src) if pinned else -1)))

    def device_collectives(self, group: object) -> bool:
        return True  # stand-in device memory is host memory: gloo carries it, as NCCL would a GPU's

    def collective(self, run: Collective, t: torch.Tensor) -> None:
        """As NCCL: the collective starts after the current (default) stream's work so far, and
        work queued there afterwards follows it (gloo here is synchronous)."""
        self.default.synchronize()
        run(t)

    def consumer_sees(self, t: torch.Tensor) -> None:
        lo, hi = _range(t)
        with self._cv:
            for s in self._streams:
                for op in s.ops:
                    if op.copy is not None and not op.done:
                        d0, d1 = _range(op.copy[0])
                        if d0 < hi and lo < d1:
                            self._violate(
                                f"a tensor of {t.nbytes} bytes was handed out while a copy into it was "
                                "still pending (handed out before its event completed)"
                            )
        self.check()

    # ------------------------------------------------------------------ test hooks
    @property
    def pending(self) -> int:
        """Operations queued and not yet run."""
        with self._cv:
            return sum(len(s.ops) for s in self._streams)

    def check(self) -> None:
        """Raise the first violation not raised yet (CUDA's sticky asynchronous error)."""
        with self._cv:
            if self._reported < len(self.violations):
                self._reported = len(self.violations)
                raise StandinViolation(self.violations[-1])

    def close(self) -> None:
        """Run what is queued, then stop the worker."""
        for s in list(self._streams):
            s.synchronize()
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._worker.join(timeout=5)

    # ------------------------------------------------------------------ the worker
    def _new_stream(self, name: str) -> StandinStream:
        s = StandinStream(self, name)
        self._streams.append(s)
        return s

    def _violate(self, what: str) -> None:
        self.violations.append(what)

    def _queue(self, op: _Op) -> None:
        with self._cv:
            if self._closed:
                raise RuntimeError("stand-in device: closed")
            op.stream.ops.append(op)
            self._cv.notify_all()

    def _wait(self, cond: Callable[[], bool]) -> None:
        """Block until ``cond()``; meanwhile the waiting thread runs ready work itself (the same
        choice the worker would make: any stream's head, due or not), as a device would keep
        working while the host waits: no thread hand-off per operation."""
        with self._cv:
            self._hurry += 1
            self._cv.notify_all()
        try:
            while True:
                with self._cv:
                    if cond():
                        break
                    op = self._take(time.monotonic())
                    if op is None:
                        self._cv.wait(timeout=0.5)
                        continue
                self._execute(op)
        finally:
            with self._cv:
                self._hurry -= 1
        self.check()

    def _take(self, now: float) -> _Op | None:
        """A ready operation, claimed (caller holds the lock); ``None`` when none is ready."""
        ready, _ = self._runnable(now)
        if not ready:
            return None
        op = self.rng.choice(ready)  # any stream's head: CUDA does not order streams
        op.running = True
        return op

    def _runnable(self, now: float) -> tuple[list[_Op], float]:
        ready: list[_Op] = []
        soonest = now + 0.05
        for s in self._streams:
            if not s.ops:
                continue
            op = s.ops[0]
            if op.running or (op.waits_for is not None and not op.waits_for.done):
                continue
            if op.copy is not None and op.due > now and not self._hurry:
                soonest = min(soonest, op.due)
                continue
            ready.append(op)
        return ready, soonest

    def _run(self) -> None:
        while True:
            with self._cv:
                while True:
                    if self._closed:
                        return
                    now = time.monotonic()
                    op = self._take(now)
                    if op is not None:
                        break
                    _, soonest = self._runnable(now)
                    self._cv.wait(timeout=max(0.0, soonest - now))
            self._execute(op)

    def _execute(self, op: _Op) -> None:
        """Run a claimed operation (outside the lock), then retire it from its stream."""
        if op.copy is not None:
            dst, src, queued = op.copy
            if queued != -1 and _checksum(src) != queued:
                with self._cv:
                    self._violate(
                        f"the source of a pending copy ({src.nbytes} bytes) changed before the copy "
                        "ran: a staging slot was reused before its copy completed"
                    )
                dst.fill_(POISON if dst.dtype == torch.uint8 else 0)
            else:
                dst.copy_(src)
        with self._cv:
            op.done = True
            if op.marks is not None:
                op.marks.done = True
            op.stream.ops.popleft()
            self._cv.notify_all()
