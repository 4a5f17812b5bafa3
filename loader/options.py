"""What a caller tunes (``LoaderOptions``) and what a load reports back (``LoadStats``)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from modelpack.loader.fingerprint import Fingerprint
from modelpack.loader.plan import ReadPlan

MiB = 1024 * 1024


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
