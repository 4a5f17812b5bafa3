"""One thing GC removes (or would remove), with its bytes and the reason: the unit of a GC plan.

Why a value of its own: the dry run prints the plan and the real run executes it, so both must
speak of the same items. Sweeps (``Store.leftovers``, ``Snapshots.leftovers``) and the eviction
plan (``mount.gc_plan``) produce them; ``mount.gc`` removes them (re-checking each at removal).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: what a removal is: a crash leftover found by a sweep, or what eviction frees
KINDS = (
    "temp",  # a temp file no live writer holds (by its lock), older than the temp TTL
    "partial",  # a resumable download nobody holds: its blob is committed, or it is too old
    "quarantined",  # a corrupt blob kept for inspection, past its TTL
    "build",  # a dead builder's snapshot directory or a stale snapshot temp file
    "record",  # a lease or trust file of a snapshot that no longer exists
    "leftover",  # a manifest entry or snapshot directory a dead pull left, never ready
    "snapshot",  # an evicted snapshot (refs, marker, files, manifest entry)
    "referrer",  # a kept signature referrer whose model is no longer kept
    "blob",  # a committed blob nothing kept needs any more
)

#: the kinds a sweep finds (reported as ``swept``)
LEFTOVER_KINDS = frozenset({"temp", "partial", "quarantined", "build", "record", "leftover"})


@dataclass(frozen=True)
class Removal:
    kind: str
    what: str  # a path, or a digest for snapshots, referrers and blobs
    bytes: int
    reason: str

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "what": self.what, "bytes": self.bytes, "reason": self.reason}


__all__ = ["KINDS", "LEFTOVER_KINDS", "Removal"]
