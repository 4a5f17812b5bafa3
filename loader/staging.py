"""One bounded set of staging buffers, allocated once and reused for the whole load
(docs/loader.md#pipeline).

Why a ring: fresh allocations cost 3–6× a reused buffer here, and pinned (page-locked) host
memory is what lets a host→device copy run asynchronously at full PCIe/NVLink speed — pinning is
slow, so it is done once. The ring also bounds memory: at most ``slots × slot_bytes`` of staging
is ever alive, whatever the model size.

This module only allocates and frees the buffers. Handing them out is the load's job: the engine
(``loader/engine.py``, ``Load.next_slot`` / ``Load.release``) keeps the free list on its one
scheduler thread, and on CUDA a returned slot carries the event of the last copy out of it, which
is waited for before the slot is filled again. Each slot also owns a device scratch buffer of the
same size: the host→device copy always moves one contiguous block, and strided shard rows are then
gathered device-side (HBM bandwidth makes that copy free next to PCIe).
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from typing import Any

import torch

ALIGN = 4096  # O_DIRECT needs page-aligned buffers, offsets and lengths


@dataclass
class Slot:
    index: int
    host: torch.Tensor  # uint8, slot_bytes long (pinned on CUDA)
    view: memoryview  # writable view of ``host`` for os.preadv
    device: torch.Tensor | None = None  # uint8 scratch on the device (CUDA only)
    event: Any = None  # torch.cuda.Event of the last copy out of ``host``


class StagingRing:
    """``slots`` reusable buffers of ``slot_bytes``, handed out by the load's own free list."""

    def __init__(self, slots: int, slot_bytes: int, device: torch.device | str = "cpu") -> None:
        if slots < 1 or slot_bytes < ALIGN:
            raise ValueError(f"a staging ring needs ≥ 1 slot of ≥ {ALIGN} bytes")
        self.device = torch.device(device)
        self.slot_bytes = -(-slot_bytes // ALIGN) * ALIGN
        self.slots = slots
        self.cuda = self.device.type == "cuda"
        self._all: list[Slot] = []
        self._maps: list[mmap.mmap] = []
        for i in range(slots):
            host, view = self._alloc_host()
            dev = torch.empty(self.slot_bytes, dtype=torch.uint8, device=self.device) if self.cuda else None
            slot = Slot(i, host, view, dev)
            self._all.append(slot)

    def _alloc_host(self) -> tuple[torch.Tensor, memoryview]:
        if self.cuda:
            t = torch.empty(self.slot_bytes, dtype=torch.uint8, pin_memory=True)
            # cudaHostAlloc returns page-aligned memory, so O_DIRECT works into it as well
            view = t.numpy().data.cast("B")
            return t, view
        # anonymous mmap: page-aligned (O_DIRECT-safe) and returned to the OS on close
        m = mmap.mmap(-1, self.slot_bytes)
        self._maps.append(m)
        t = torch.frombuffer(m, dtype=torch.uint8)
        return t, memoryview(m)

    @property
    def buffers(self) -> list[Slot]:
        """Every slot, for the load's scheduler to keep in its own free list."""
        return list(self._all)

    @property
    def nbytes(self) -> int:
        return self.slots * self.slot_bytes

    def close(self) -> None:
        """Wait for in-flight copies, then drop the buffers (mmaps are unmapped)."""
        for slot in self._all:
            if slot.event is not None:
                slot.event.synchronize()
                slot.event = None
        for slot in self._all:
            slot.view.release()
        self._all.clear()
        for m in self._maps:
            try:
                m.close()
            except BufferError:
                pass  # a tensor view is still alive somewhere; the GC unmaps it later
        self._maps.clear()

    def __enter__(self) -> StagingRing:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
