"""What the node cache holds: ready snapshots with their references, pins and readers, and usage.

Read-only and local: nothing is hashed (``integrity`` re-hashes) and nothing is removed (``gc``).
"""

from __future__ import annotations

from modelpack.mount.refs import Pins, RefRecords
from modelpack.mount.reports import CacheEntry
from modelpack.mount.snapshots import Snapshots
from modelpack.mount.store import Store


def list_entries(refs: RefRecords, pins: Pins, snapshots: Snapshots) -> list[CacheEntry]:
    """Every ready snapshot, most recently used first."""
    refs_by_digest: dict[str, list[str]] = {}
    for doc in refs.all():
        refs_by_digest.setdefault(doc["digest"], []).append(doc["reference"])
    out = []
    for info in snapshots.list_ready():
        d = str(info.digest)
        out.append(
            CacheEntry(
                digest=d,
                path=info.path,
                size=info.size,
                files=len(info.files),
                references=sorted(refs_by_digest.get(d, [])),
                repository=str(info.meta.get("repository", "")),
                pinned=pins.is_pinned(d),
                in_use=snapshots.in_use(d),
                last_used=info.last_used,
                created=info.created,
            )
        )
    out.sort(key=lambda e: -e.last_used)
    return out


def usage(store: Store, snapshots: Snapshots) -> int:
    """Bytes the cache holds: blobs (hard links are not counted twice) + extracted files."""
    total = store.size_on_disk()
    for info in snapshots.list_ready():
        total += sum(f.size for f in info.files if not f.linked)
    return total
