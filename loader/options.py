"""What a caller tunes (``LoaderOptions``) and what a load reports back (``LoadStats``)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from modelpack.loader.fingerprint import Fingerprint
from modelpack.loader.plan import ReadPlan

from modelpack.errors import LoaderError
from modelpack.oci.variant_selection import VariantSelector

MiB = 1024 * 1024
#: the largest piece, batch or slot: one read call moves at most ~2 GiB (Linux MAX_RW_COUNT)
MAX_READ_BYTES = 1024 * MiB


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
    # a standalone rank's column-split shares under a table with column blocks (column_reads.py):
    # "local" reads just the rank's columns from local files and OCI layouts (a range per row costs
    # microseconds there), "always" from a registry too (one multipart range per row: ~0.4 ms of
    # registry time each, so it saves bytes and costs wall time unless the link is slow), "never"
    # reads the covering chunks
    column_reads: str = "local"
    # With trusted keys, a weight layer no signed chunk table covers is refused (UnsignedSourceError):
    # True accepts whole-layer digest checks for it instead, and says so in a loader.downgraded event.
    allow_missing_chunk_table: bool = False
    # Chunks verified while reading the headers are kept for the data pass, so each is fetched once;
    # past this budget (in plan order) a file's first chunk is fetched again with its data.
    verified_chunk_cache_bytes: int = 256 * MiB
    # CPU loads of node-cache store blobs trusted by inode: "shard" hands out this rank's shards as
    # views of the mapped blob (no allocation, no copy), "full" the whole tensors (for an engine
    # that narrows them itself); "off" reads into fresh memory. See mapped.py.
    views: str = "off"
    # a torch.distributed process group of exactly the TP ranks (group rank = TP rank): the ranks
    # share chunk-verified reads, each chunk read by one rank and broadcast (shared_read.py)
    group: Any = None
    # with a group over several nodes: ranks per node, filled in global-rank order (nodes.py);
    # 0 = torchrun's LOCAL_WORLD_SIZE, and without it the whole group is one node
    local_world_size: int = 0
    # an index of variants: which entry to load (a modelpack.oci.variant_selection.VariantSelector
    # built from the node's device arch, TP size, engine and --variant; loader/variant_source.py)
    variant: VariantSelector | None = None

    def check(self) -> None:
        """Refuse a value the load cannot honour, naming the field, before anything is read: a
        piece or slot past what one read call moves (~2 GiB, Linux's ``MAX_RW_COUNT``) would
        read as a truncated file; a zero size or count would loop or deadlock."""
        sizes = {
            "piece_bytes": self.piece_bytes,
            "batch_bytes": self.batch_bytes,
            "slot_bytes": self.slot_bytes,
        }
        for name, value in sizes.items():
            if not isinstance(value, int) or not 0 < value <= MAX_READ_BYTES:
                raise LoaderError(
                    f"LoaderOptions.{name} must be 1 byte to {MAX_READ_BYTES} (1 GiB), got {value!r}"
                )
        counts = {
            "workers": (self.workers, 0),
            "slots": (self.slots, 0),
            "remote_inflight": (self.remote_inflight, 1),
        }
        for name, (value, least) in counts.items():
            if not isinstance(value, int) or value < least:
                raise LoaderError(
                    f"LoaderOptions.{name} must be an integer of at least {least}, got {value!r}"
                )
        if self.views not in ("off", "shard", "full"):
            raise LoaderError(f"LoaderOptions.views must be 'off', 'shard' or 'full', got {self.views!r}")
        if self.column_reads not in ("local", "always", "never"):
            raise LoaderError(
                f"LoaderOptions.column_reads must be 'local', 'always' or 'never', got {self.column_reads!r}"
            )
        if self.uneven not in ("refuse", "chunk"):
            raise LoaderError(f"LoaderOptions.uneven must be 'refuse' or 'chunk', got {self.uneven!r}")

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
    bytes_received: int = 0  # chunk bytes other ranks read and broadcast to this one (options.group)
    mapped_bytes: int = 0  # bytes handed out as views of mapped store blobs (LoaderOptions.views)
    # verified bytes copied out of a staging slot into their tensors (a block read straight into
    # its destinations, scatter.py, is not staged: 0 for a CPU stream whose spans are contiguous)
    staged_bytes: int = 0
    tensors: int = 0
    read_start: float = 0.0
    read_done: float = 0.0
    device_done: float = 0.0
    ring_bytes: int = 0
    fingerprint: Fingerprint | None = None
    plan: ReadPlan | None = None
    per_file_bytes: dict[str, int] = field(default_factory=dict)
    # file → what vouched for its bytes: trusted (node-cache snapshot bound to its store), chunks
    # (signed chunk table), whole (layer digest), hashed (a snapshot file re-hashed against the
    # layer digest because it is not the store's read-only blob), unverified (--allow-unverified)
    verification: dict[str, str] = field(default_factory=dict)
    # split kind (dim0, dim1, replicate) → {tensorBytes, planned, read}; header/other → {read}:
    # the bytes the readers fetched, attributed to the tensors (of any rank) they belong to
    bytes_by_split: dict[str, dict[str, int]] = field(default_factory=dict)
    # the node this rank runs on and what each node's ranks read (options.group; nodes.py):
    # without a group, one node that read what this rank read
    node: int = 0
    node_bytes_read: int = 0
    bytes_read_by_node: list[int] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        return max(0.0, self.device_done - self.read_start)

    @property
    def gbps(self) -> float:
        return self.bytes_read / self.seconds / 1e9 if self.seconds else 0.0
