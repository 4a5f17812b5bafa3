"""Which snapshots GC evicts: pure decisions over a ``CacheScan``, linear in its size.

Protection first (pinned, leased, being pulled, held, used within ``min_age``), then
``keep_versions`` per (repository, artifact kind), then least recently used until the cache is
under ``max_bytes``. What evicting a snapshot frees is counted with one reference count per blob
(a blob shared with a snapshot that stays frees nothing), decremented as victims are chosen, so
the whole choice is O(snapshots + blobs) — not a recount of every snapshot per candidate.

``plan_removals`` completes the choice into the one ``GCPlan``: the crash leftovers, the
manifests a dead pull left, the kept signature referrers whose model is not kept (a referrer
stays exactly as long as the model it signs: a snapshot, a pin, a running pull, a fill), and the
blobs nothing kept needs. The dry run reports that plan; the real run executes it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from modelpack.mount.gc_scan import CacheScan, ScannedSnapshot, lease_blocks_eviction
from modelpack.mount.removals import Removal


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


@dataclass
class GCPlan:
    """Everything one GC removes, in the order it removes it, each with its bytes and reason:
    the dry run reports it, the real run executes it (re-checking each item as it goes)."""

    leftovers: list[Removal]  # crash leftovers (temp files, partials, dead builds), swept first
    eviction: Plan
    manifests: list[Removal]  # index.json entries and snapshot dirs a dead pull left
    referrers: list[Removal]  # kept referrers whose model is not kept (those of victims included)
    blobs: list[Removal]  # committed blobs nothing kept needs

    @property
    def snapshots(self) -> list[Removal]:
        return [
            Removal("snapshot", s.digest, s.extracted, self.eviction.reasons[s.digest])
            for s in self.eviction.victims
        ]

    def removals(self) -> list[Removal]:
        return [*self.leftovers, *self.manifests, *self.snapshots, *self.referrers, *self.blobs]


def plan_removals(scan: CacheScan, eviction: Plan, pulling: set[str], leftovers: list[Removal]) -> GCPlan:
    """What goes besides the victims, from the scan: index entries a dead pull left (not ready,
    not being pulled, not pinned, not an entry of a kept index), kept referrers whose model
    stays nowhere (no snapshot that stays, no pin, no pull, no fill), and every blob that
    neither a snapshot that stays, a pull, nor an ``index.json`` entry that stays needs.
    Linear in the scan."""
    victims = {s.digest for s in eviction.victims}
    ready = scan.ready
    manifests: list[Removal] = []
    kept_models = (ready - victims) | pulling
    work = [
        m
        for m in scan.manifest_blobs
        if m not in scan.subjects
        and m not in victims
        and (m in ready or m in pulling or m in scan.pinned_manifests)
    ]
    kept_models.update(work)
    while work:  # a kept index (a ``--fill`` pin of a variant index) keeps its entries' manifests
        for n in scan.manifest_blobs[work.pop()]:
            if n in scan.manifest_blobs and n not in kept_models and n not in scan.subjects:
                kept_models.add(n)
                work.append(n)
    for m in scan.manifest_blobs:
        if m not in scan.subjects and m not in victims and m not in kept_models:
            manifests.append(Removal("leftover", m, 0, "a manifest a pull stored but never made ready"))
    for d, (path, size) in scan.unmarked_dirs.items():
        if d not in pulling:
            manifests.append(Removal("leftover", path, size, "a snapshot directory never made ready"))
    referrers: list[Removal] = []
    for r, subject in sorted(scan.subjects.items()):
        if subject in victims:
            referrers.append(Removal("referrer", r, 0, "the model it signs is evicted"))
        elif subject not in kept_models:
            referrers.append(Removal("referrer", r, 0, "the model it signs is not kept"))
    gone = {r.what for r in referrers}
    live: set[str] = set(pulling)
    for s in scan.snapshots:
        if s.digest not in victims:
            live |= s.blobs
    for m, needs in scan.manifest_blobs.items():
        if m in kept_models or (m in scan.subjects and m not in gone):
            live |= needs
    blobs = [
        Removal("blob", b, size, "no kept model needs it")
        for b, size in sorted(scan.blob_sizes.items())
        if b not in live
    ]
    return GCPlan(leftovers, eviction, manifests, referrers, blobs)
