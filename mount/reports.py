"""What the node cache hands back: pull results, ``ls`` entries, verify reports and GC results.

These are plain records so the CLI can print them as JSON and tests can compare them; the
operations that fill them live in ``pull``, ``listing``, ``integrity`` and ``gc``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from modelpack.mount.removals import Removal

from modelpack.oci.digest import Digest
from modelpack.timestamps import rfc3339_utc, rfc3339_utc_or_none
from modelpack.transfer.pull_document import pull_document


def to_ms(seconds: float) -> float:
    """Timings are reported in milliseconds, rounded to the microsecond."""
    return round(seconds * 1000.0, 3)


@dataclass
class PullResult:
    reference: str
    digest: Digest
    path: str
    state: str  # hit | cold
    files: int = 0
    bytes_total: int = 0
    bytes_downloaded: int = 0
    bytes_reused: int = 0  # already in the store, or a resumed prefix
    bytes_resumed: int = 0
    blobs_downloaded: int = 0
    blobs_reused: int = 0
    timings: dict[str, float] = field(default_factory=dict)  # milliseconds
    start_id: str = ""
    signature: str = "not-checked"
    hold_path: str = ""  # ``pull --hold``: the hold GC honours until ``hold_until`` (epoch seconds)
    hold_until: float = 0.0
    #: blob bytes per source host (mirrors, peers, the origin) when mirrors were configured
    bytes_by_source: dict[str, int] = field(default_factory=dict)
    #: an index reference: the selection (index digest, chosen entry, every entry's verdict)
    variant: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        """``pull --json`` for the node cache (``pull_document``: the same keys as a directory
        pull; hit or cold, what the store already had and the GC hold under ``cache``)."""
        details: dict[str, Any] = {
            "state": self.state,
            "bytes": {"total": self.bytes_total, "reused": self.bytes_reused, "resumed": self.bytes_resumed},
            "blobs": {"downloaded": self.blobs_downloaded, "reused": self.blobs_reused},
        }
        if self.hold_path:
            details["hold"] = {"path": self.hold_path, "until": rfc3339_utc(self.hold_until)}
        return pull_document(
            mode="cache",
            reference=self.reference,
            digest=str(self.digest),
            path=self.path,
            files=self.files,
            bytes_downloaded=self.bytes_downloaded,
            bytes_by_source=self.bytes_by_source,
            timings_ms=self.timings,
            signature=self.signature,
            start_id=self.start_id,
            variant=self.variant,
            details=details,
        )


@dataclass
class CacheEntry:
    digest: str
    path: str
    size: int
    files: int
    references: list[str]
    repository: str
    pinned: bool
    in_use: bool
    last_used: float
    created: float
    #: the variant indexes whose chosen entry this snapshot is ({index, reference, variant})
    indexes: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "digest": self.digest,
            "path": self.path,
            "size": self.size,
            "files": self.files,
            "references": list(self.references),
            "repository": self.repository,
            "pinned": self.pinned,
            "inUse": self.in_use,
            "lastUsed": rfc3339_utc_or_none(self.last_used),
            "created": rfc3339_utc_or_none(self.created),
            "indexes": list(self.indexes),
        }


@dataclass
class VerifyReport:
    digest: str
    ok: bool
    files: int
    bytes: int
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "digest": self.digest,
            "ok": self.ok,
            "files": self.files,
            "bytes": self.bytes,
            "problems": list(self.problems),
            "seconds": round(self.seconds, 3),
        }


@dataclass
class GCResult:
    evicted: list[str] = field(default_factory=list)
    kept_in_use: list[str] = field(default_factory=list)
    kept_pinned: list[str] = field(default_factory=list)
    kept_pulling: list[str] = field(default_factory=list)
    kept_held: list[str] = field(default_factory=list)  # a ``pull --hold`` has not expired
    kept_young: list[str] = field(default_factory=list)  # used or published within ``min_age``
    refs_removed: int = 0
    blobs_removed: int = 0
    bytes_freed: int = 0  # with ``dry_run``: what the run would free (the plan's bytes)
    swept: list[str] = field(default_factory=list)
    bytes_before: int = 0
    bytes_after: int = 0
    #: every removal with its bytes and reason: with ``dry_run`` the plan, else what was done
    plan: list[Removal] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "evicted": list(self.evicted),
            "keptInUse": list(self.kept_in_use),
            "keptPinned": list(self.kept_pinned),
            "keptPulling": list(self.kept_pulling),
            "keptHeld": list(self.kept_held),
            "keptYoung": list(self.kept_young),
            "refsRemoved": self.refs_removed,
            "blobsRemoved": self.blobs_removed,
            "bytesFreed": self.bytes_freed,
            "swept": list(self.swept),
            "bytesBefore": self.bytes_before,
            "bytesAfter": self.bytes_after,
            "plan": [r.to_json() for r in self.plan],
        }
