"""The one host→device seam: staging slots, asynchronous copies, completion events, group broadcasts
(docs/loader.md#the-device-seam).

Every byte a load moves towards a device passes here, and nowhere else:

- **slots**: ``open_slots`` allocates a bounded set of staging buffers once per load (pinned host
  memory on a device, so a copy out of them runs asynchronously at full PCIe/NVLink speed; pinning is
  slow, so it is done once), each with a device scratch buffer of the same size. At most
  ``slots × slot_bytes`` of staging is ever alive, whatever the model size;
- **copies**: ``copy`` queues ``dst.copy_(src)`` on the load's side stream; ``to_device`` moves one
  contiguous block of a slot into its scratch buffer (strided shard rows are then gathered
  device-side, where HBM bandwidth makes that copy free next to PCIe);
- **completion**: ``release`` records the event of the last copy out of a slot and ``acquire`` waits
  for it before the slot is handed to a reader again; ``record`` marks a tensor's last copy and
  ``hand_out`` waits for that mark before the consumer sees the tensor;
- **broadcasts**: ``broadcast`` exchanges a slot's bytes within a process group — in host memory for
  gloo, through the device scratch buffer on the current stream for a device backend (NCCL orders its
  collective after the current stream, so the staging copy must be queued there, not on the side).

``HostCopier`` is the plain CPU load: destinations are host memory, readers write straight into them
(``LoadEngine.staged`` is false) and a copy is a synchronous memcpy, so the CPU path costs what it
did before this seam existed. ``StreamCopier`` is the device load over a ``DeviceRuntime``: ``CudaRuntime``
(torch.cuda) in production; ``loader/device_standin.py``'s test device in the tests, which gives host
memory CUDA's asynchronous semantics and catches what a CPU run otherwise cannot see.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, cast

import torch

ALIGN = 4096  # O_DIRECT needs page-aligned buffers, offsets and lengths


class DeviceEvent(Protocol):
    """A point in a stream's work (``torch.cuda.Event``, the test device's): wait for it."""

    def synchronize(self) -> None: ...


#: a stream is an opaque handle only its runtime interprets (``torch.cuda.Stream``, the test device's)
DeviceStream = object
#: runs one collective (a broadcast from the owner) on a tensor
Collective = Callable[[torch.Tensor], None]


@dataclass
class Slot:
    index: int
    host: torch.Tensor  # uint8, slot_bytes long (pinned on a device)
    view: memoryview  # writable view of ``host`` for os.preadv
    device: torch.Tensor | None = None  # uint8 scratch on the device (device loads only)
    done: DeviceEvent | None = None  # completion of the last copy out of ``host`` (device loads only)


class DeviceRuntime(Protocol):
    """The device primitives a ``StreamCopier`` needs (CUDA's, or the test device's)."""

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor: ...

    def pinned(self, nbytes: int) -> torch.Tensor: ...

    def free_pinned(self, t: torch.Tensor) -> None: ...

    def stream(self) -> DeviceStream: ...

    def current_stream(self) -> DeviceStream: ...

    def record(self, stream: DeviceStream) -> DeviceEvent: ...

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: DeviceStream) -> None: ...

    def wait(self, stream: DeviceStream, other: DeviceStream) -> None:
        """Work queued on ``stream`` from now on runs after everything queued on ``other`` so far."""

    def synchronize(self, stream: DeviceStream) -> None: ...

    def device_collectives(self, group: object) -> bool: ...

    def collective(self, run: Collective, t: torch.Tensor) -> None: ...

    def consumer_sees(self, t: torch.Tensor) -> None: ...


class CudaRuntime:
    """``DeviceRuntime`` over torch.cuda: streams, events, ``cudaMemcpyAsync`` from pinned memory."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=self.device)

    def pinned(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def free_pinned(self, t: torch.Tensor) -> None:
        pass  # the caching host allocator takes it back when the last reference goes

    def stream(self) -> DeviceStream:
        return torch.cuda.Stream(device=self.device)

    def current_stream(self) -> DeviceStream:
        return torch.cuda.current_stream(self.device)

    def record(self, stream: DeviceStream) -> DeviceEvent:
        ev = torch.cuda.Event()
        ev.record(cast(torch.cuda.Stream, stream))
        return ev

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: DeviceStream) -> None:
        with torch.cuda.stream(cast(torch.cuda.Stream, stream)):
            dst.copy_(src, non_blocking=True)

    def wait(self, stream: DeviceStream, other: DeviceStream) -> None:
        cast(torch.cuda.Stream, stream).wait_stream(cast(torch.cuda.Stream, other))

    def synchronize(self, stream: DeviceStream) -> None:
        cast(torch.cuda.Stream, stream).synchronize()

    def device_collectives(self, group: object) -> bool:
        import torch.distributed as dist

        return bool(dist.get_backend(cast("dist.ProcessGroup | None", group)) == "nccl")

    def collective(self, run: Collective, t: torch.Tensor) -> None:
        run(t)  # NCCL queues it after the current stream's work, and the current stream after it

    def consumer_sees(self, t: torch.Tensor) -> None:
        pass


class HostCopier:
    """The plain CPU load: synchronous copies, no events; readers may write into destinations."""

    staged = False  # True: destinations are device memory, every byte passes a staging slot

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.slot_bytes = 0
        self._all: list[Slot] = []
        self._free: list[Slot] = []
        self._maps: list[mmap.mmap] = []

    # ------------------------------------------------------------------ memory
    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A destination tensor on the load's device."""
        return torch.empty(shape, dtype=dtype, device=self.device)

    def open_slots(self, count: int, slot_bytes: int) -> None:
        """Allocate ``count`` staging slots of ``slot_bytes`` (rounded up to a page), once per load."""
        if count < 1 or slot_bytes < ALIGN:
            raise ValueError(f"staging needs ≥ 1 slot of ≥ {ALIGN} bytes")
        self.slot_bytes = -(-slot_bytes // ALIGN) * ALIGN
        for i in range(count):
            host, view = self._host(self.slot_bytes)
            slot = Slot(i, host, view, self._scratch(self.slot_bytes))
            self._all.append(slot)
        self._free = list(self._all)

    def _host(self, nbytes: int) -> tuple[torch.Tensor, memoryview]:
        # anonymous mmap: page-aligned (O_DIRECT-safe) and returned to the OS on close
        m = mmap.mmap(-1, nbytes)
        self._maps.append(m)
        return torch.frombuffer(m, dtype=torch.uint8), memoryview(m)

    def _scratch(self, nbytes: int) -> torch.Tensor | None:
        return None

    @property
    def slots(self) -> int:
        return len(self._all)

    @property
    def ring_bytes(self) -> int:
        return len(self._all) * self.slot_bytes

    @property
    def has_free(self) -> bool:
        return bool(self._free)

    @property
    def slots_out(self) -> int:
        """Slots handed out and not yet released (0 once a load ended, however it ended)."""
        return len(self._all) - len(self._free)

    def acquire(self) -> Slot:
        """A free slot, after every copy queued out of it completed."""
        slot = self._free.pop()
        if slot.done is not None:
            slot.done.synchronize()
            slot.done = None
        return slot

    def release(self, slot: Slot) -> None:
        """Return ``slot``; it is reused only after the copies queued from it completed."""
        slot.done = self.record()
        self._free.append(slot)

    # ------------------------------------------------------------------ copies
    def follow_consumer(self) -> None:
        """Order the copies queued from now on after the consumer's work so far."""

    def to_device(self, slot: Slot, start: int, nbytes: int) -> torch.Tensor:
        """``slot``'s bytes ``[start, start + nbytes)`` where the device can read them."""
        return slot.host[start : start + nbytes]

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def record(self) -> DeviceEvent | None:
        """An event that completes when every copy queued so far has (``None``: already done)."""
        return None

    def hand_out(self, t: torch.Tensor, done: DeviceEvent | None) -> torch.Tensor:
        """``t`` for the consumer, once ``done`` (its last copy's event) completed."""
        if done is not None:
            done.synchronize()
        return t

    def synchronize(self) -> None:
        """Wait for every queued copy."""

    def broadcast(self, slot: Slot, nbytes: int, owned: bool, group: object, collective: Collective) -> None:
        """Exchange ``slot``'s first ``nbytes`` within ``group``: ``collective(tensor)`` broadcasts
        from the owner; on return ``slot.host`` holds the owner's bytes on every rank."""
        collective(slot.host[:nbytes])

    def close(self) -> None:
        """Wait for in-flight copies, then drop the buffers (mmaps are unmapped)."""
        self.synchronize()
        for slot in self._all:
            if slot.done is not None:
                slot.done.synchronize()
                slot.done = None
            slot.view.release()
        self._all.clear()
        self._free.clear()
        for m in self._maps:
            try:
                m.close()
            except BufferError:
                pass  # a tensor view is still alive somewhere; the GC unmaps it later
        self._maps.clear()


class StreamCopier(HostCopier):
    """A device load: pinned slots, copies queued on a side stream, events guard reuse and hand-out."""

    staged = True

    def __init__(self, device: torch.device, runtime: DeviceRuntime) -> None:
        super().__init__(device)
        self.rt = runtime
        self.side = runtime.stream()

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return self.rt.empty(shape, dtype)

    def _host(self, nbytes: int) -> tuple[torch.Tensor, memoryview]:
        t = self.rt.pinned(nbytes)
        # cudaHostAlloc returns page-aligned memory, so O_DIRECT works into it as well
        return t, t.numpy().data.cast("B")

    def _scratch(self, nbytes: int) -> torch.Tensor | None:
        return self.rt.empty((nbytes,), torch.uint8)

    def follow_consumer(self) -> None:
        # memory the consumer freed on its stream may be handed to new tensors while its kernels
        # still read it; our copies run on the side stream, so order them after that work
        self.rt.wait(self.side, self.rt.current_stream())

    def to_device(self, slot: Slot, start: int, nbytes: int) -> torch.Tensor:
        assert slot.device is not None
        self.rt.copy(slot.device[:nbytes], slot.host[start : start + nbytes], self.side)
        return slot.device[:nbytes]

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.rt.copy(dst, src, self.side)

    def record(self) -> DeviceEvent | None:
        return self.rt.record(self.side)

    def hand_out(self, t: torch.Tensor, done: DeviceEvent | None) -> torch.Tensor:
        if done is not None:
            done.synchronize()
        self.rt.consumer_sees(t)
        return t

    def synchronize(self) -> None:
        self.rt.synchronize(self.side)

    def broadcast(self, slot: Slot, nbytes: int, owned: bool, group: object, collective: Collective) -> None:
        if not self.rt.device_collectives(group):
            collective(slot.host[:nbytes])  # gloo: host memory, synchronous
            return
        assert slot.device is not None
        dev = slot.device[:nbytes]
        current = self.rt.current_stream()
        # the collective runs after the current stream's work (NCCL's ordering), so the owner's
        # staging copy is queued there; a receiver's copy back follows the collective there too
        if owned:
            self.rt.copy(dev, slot.host[:nbytes], current)
        self.rt.collective(collective, dev)
        if not owned:
            self.rt.copy(slot.host[:nbytes], dev, current)
        self.rt.synchronize(current)

    def close(self) -> None:
        slots = list(self._all)
        super().close()
        for slot in slots:
            self.rt.free_pinned(slot.host)


def copier_for(device: torch.device) -> HostCopier:
    """The copier a load on ``device`` uses (tests replace this one function with the test device)."""
    if device.type == "cuda":
        return StreamCopier(device, CudaRuntime(device))
    return HostCopier(device)
