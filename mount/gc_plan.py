"""Which snapshots GC evicts: pure decisions over a ``CacheScan``, linear in its size.

Protection first (pinned, leased, being pulled, held, used within ``min_age``), then
``keep_versions`` per (repository, artifact kind), then least recently used until the cache is
under ``max_bytes``. What evicting a snapshot frees is counted with one reference count per blob
(a blob shared with a snapshot that stays frees nothing), decremented as victims are chosen, so
the whole choice is O(snapshots + blobs) — not a recount of every snapshot per candidate.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from modelpack.mount.gc_scan import CacheScan, ScannedSnapshot, lease_blocks_eviction


@dataclass
class Protection:
    """Why snapshots are kept, as the GC result reports them."""

    pinned: list[str] = field(default_factory=list)
    in_use: list[str] = field(default_factory=list)
    held: list[str] = field(default_factory=list)
    young: list[str] = field(default_factory=list)
    pulling: list[str] = field(default_factory=list)

    def all(self) -> set[str]:
        return {*self.pinned, *self.in_use, *self.held, *self.young, *self.pulling}


@dataclass
class Plan:
    victims: list[ScannedSnapshot]  # least recently used first
    reasons: dict[str, str]
    bytes_freed: int  # estimated: extracted files + blobs no remaining snapshot or pull needs


@dataclass
class EvictionRule:
    """What keeps a snapshot, given the pulls and holds GC saw under its lock."""

    owner: int
    pulling: set[str]
    held: set[str]
    now: float
    min_age: float
    foreign_lease_s: float

    def reason(self, s: ScannedSnapshot) -> str | None:
        """The first reason ``s`` must stay (``pinned``, ``in_use``, ``pulling``, ``held``,
        ``young``), or None when it may go."""
        if s.pinned:
            return "pinned"
        if lease_blocks_eviction(s.holders, self.owner, s.last_used, self.now, self.foreign_lease_s):
            return "in_use"
        if s.digest in self.pulling:
            return "pulling"
        if s.digest in self.held:
            return "held"
        if self.now - s.last_used < self.min_age:
            return "young"
        return None


def protect(scan: CacheScan, rule: EvictionRule) -> Protection:
    out = Protection()
    for s in scan.snapshots:
        reason = rule.reason(s)
        if reason is not None:
            getattr(out, reason).append(s.digest)
    return out


class _Freed:
    """Bytes freed as victims are taken, from one reference count per blob."""

    def __init__(self, scan: CacheScan, pulling: set[str]) -> None:
        self.sizes = scan.blob_sizes
        self.refs: Counter[str] = Counter()
        for s in scan.snapshots:
            self.refs.update(s.blobs)
        self.pulling = pulling

    def take(self, s: ScannedSnapshot) -> int:
        freed = s.extracted
        for b in s.blobs:
            self.refs[b] -= 1
            if self.refs[b] == 0 and b not in self.pulling:
                freed += self.sizes.get(b, 0)
        return freed


def choose_victims(
    scan: CacheScan,
    protected: set[str],
    pulling: set[str],
    *,
    bytes_before: int,
    keep_versions: int | None,
    max_bytes: int | None,
) -> Plan:
    freed = _Freed(scan, pulling)
    victims: list[ScannedSnapshot] = []
    reasons: dict[str, str] = {}
    total = 0
    if keep_versions is not None:
        by_kind: dict[tuple[str, str], list[ScannedSnapshot]] = {}
        for s in scan.snapshots:
            by_kind.setdefault(s.kind, []).append(s)
        for group in by_kind.values():
            for s in sorted(group, key=lambda x: -x.last_used)[max(0, keep_versions) :]:
                if s.digest not in protected:
                    victims.append(s)
                    reasons[s.digest] = "keep_versions"
                    total += freed.take(s)
    if max_bytes is not None:
        for s in scan.snapshots:  # least recently used first
            if bytes_before - total <= max_bytes:
                break
            if s.digest in protected or s.digest in reasons:
                continue
            victims.append(s)
            reasons[s.digest] = "max_bytes"
            total += freed.take(s)
    victims.sort(key=lambda s: s.last_used)
    return Plan(victims, reasons, min(bytes_before, total))
