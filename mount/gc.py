"""Removing models from the node cache: ``rm``, LRU garbage collection and crash-leftover sweeps.

Both ``rm`` and GC delete under the exclusive ``locks/gc.lock`` (``mount.leases``; the wait for
it is bounded), so they see every running pull's lease, and never delete a pinned, in-use,
being-pulled or held model, nor one used or published less than ``min_age`` seconds ago (the
pull that published it may not have handed it to its reader yet). Deletion order: refs →
snapshot (marker first, then files) → manifest → blobs no remaining manifest or snapshot needs.

One plan: GC lists every removal before it deletes anything (``mount.gc_plan.GCPlan``: crash
leftovers, a dead pull's manifests and directories, victims, kept referrers whose model is not
kept, blobs nothing kept needs; each with bytes and reason). The dry run returns that plan; the
real run executes it item by item, re-checking each, and reports what it did in the same shape.
What a node keeps for others stays: the signature referrers of a model it keeps, the manifests
and blobs a ``cache serve --fill`` pin names, and any temp file whose writer holds its lock.

Pulls take the same lock (shared) to register, so GC keeps the time it holds it short: the
sweep and the scan of every marker, lease and blob (``mount.gc_scan``) run before it is taken;
under it GC reads the running pulls and holds, chooses victims from what it scanned
(``mount.gc_plan``, linear) and re-checks only the victims (pin, lease, last use) before each
deletion. GC never waits on a reader's lease or on ``index.json``'s lock: what it cannot lock
now it skips, and the next GC finishes it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time

from modelpack.mount.gc_plan import EvictionRule, GCPlan, Plan, choose_victims, plan_removals, protect
from modelpack.mount.gc_scan import (
    DEFAULT_FOREIGN_LEASE_S,
    CacheScan,
    ScannedSnapshot,
    clamped_last_use,
    lease_blocks_eviction,
    manifest_blobs,
    scan_cache,
)
from modelpack.mount.leases import PullLeases
from modelpack.mount.listing import usage
from modelpack.mount.refs import Pins, RefRecords
from modelpack.mount.removals import LEFTOVER_KINDS, Removal
from modelpack.mount.reports import GCResult, to_ms
from modelpack.mount.snapshots import Snapshots
from modelpack.mount.store import Store

from modelpack.errors import CacheError, LockTimeoutError, ModelpackError, SnapshotInUseError
from modelpack.events import EventLog
from modelpack.oci.digest import Digest

# a snapshot used or published this recently is not evicted: its pull may still be handing it over
DEFAULT_MIN_AGE_S = 300.0

__all__ = ["DEFAULT_FOREIGN_LEASE_S", "DEFAULT_MIN_AGE_S", "GarbageCollector"]


class GarbageCollector:
    """Evicts snapshots and the blobs only they needed, under the GC lock."""

    def __init__(
        self,
        store: Store,
        snapshots: Snapshots,
        refs: RefRecords,
        pins: Pins,
        leases: PullLeases,
        events: EventLog,
    ) -> None:
        self.store = store
        self.snapshots = snapshots
        self.refs = refs
        self.pins = pins
        self.leases = leases
        self.events = events

    def usage(self) -> int:
        return usage(self.store, self.snapshots)

    def rm(
        self,
        reference: str,
        digest: Digest,
        *,
        force: bool = False,
        foreign_lease_s: float = DEFAULT_FOREIGN_LEASE_S,
    ) -> Digest:
        """Remove one model; refused when pinned or in use (by the owner's or root's reader, or a
        foreign one within ``foreign_lease_s``) unless ``force``."""
        d = str(digest)
        with self.leases.gc_exclusive():
            if self.pins.is_pinned(d) and not force:
                raise CacheError(f"{reference}: {d} is pinned; 'modelpack cache unpin' it first (or --force)")
            holders = self.snapshots.lease_holders(d)
            if self._lease_blocks(d, holders, foreign_lease_s) and not force:
                raise SnapshotInUseError(f"{reference}: {d} is in use by a reader; retry when it is released")
            self.refs.remove_to(d)
            self.snapshots.remove(d, force=force or holders is not None)
            self.store.remove_manifest(d)
            self.pins.remove(d)
            self._delete_unreferenced_blobs(self.leases.active_digests(), set(self.store.blob_digests()))
        self.events.emit("cache.evict", reference=reference, digest=d, reason="rm")
        return digest

    def sweep(self) -> list[str]:
        """Remove temp files, dead builders' snapshot dirs and finished partials."""
        return self.store.sweep() + self.snapshots.sweep()

    def gc(
        self,
        *,
        keep_versions: int | None = None,
        max_bytes: int | None = None,
        dry_run: bool = False,
        min_age: float = DEFAULT_MIN_AGE_S,
        foreign_lease_s: float = DEFAULT_FOREIGN_LEASE_S,
    ) -> GCResult:
        """Evict least-recently-used snapshots: beyond ``keep_versions`` per repository, then until
        the cache is under ``max_bytes``. Never a pinned, in-use, being-pulled or held model, nor
        one used less than ``min_age`` seconds ago; a lease held only by other uids counts for
        ``foreign_lease_s`` past the last use. One ``GCPlan`` lists every removal with its bytes
        and reason; ``dry_run`` reports it and deletes nothing, the real run executes it."""
        res = GCResult()
        leftovers = self.store.leftovers() + self.snapshots.leftovers()
        scan = scan_cache(self.store, self.snapshots, self.pins, rewrite_clock=not dry_run)
        res.bytes_before = scan.bytes_used(self.store)
        if not dry_run:  # outside the GC lock: a dead build's tree may take a while
            leftovers = [r for r in leftovers if self._remove_leftover(r)]
        with self.leases.gc_exclusive():
            pulling_manifests, pulling = self.leases.active()
            res.kept_pulling = sorted(set(pulling_manifests))
            held = {h.digest for h in self.leases.holds(remove_expired=not dry_run)}
            rule = EvictionRule(self.store.owner, pulling, held, time.time(), min_age, foreign_lease_s)
            protection = protect(scan, rule)
            res.kept_pinned, res.kept_in_use = protection.pinned, protection.in_use
            res.kept_held, res.kept_young = protection.held, protection.young
            eviction = choose_victims(
                scan,
                protection.all(),
                pulling,
                bytes_before=res.bytes_before,
                keep_versions=keep_versions,
                max_bytes=max_bytes,
            )
            plan = plan_removals(scan, eviction, pulling, leftovers)
            if dry_run:
                res.evicted = [s.digest for s in eviction.victims]
                done = plan.removals()
            else:
                done = self._execute(plan, scan, rule, pulling, res)
        res.plan = done
        res.swept = [r.what for r in done if r.kind in LEFTOVER_KINDS]
        res.blobs_removed = sum(1 for r in done if r.kind == "blob")
        res.bytes_freed = min(res.bytes_before, sum(r.bytes for r in done))
        res.bytes_after = res.bytes_before - res.bytes_freed
        if dry_run:
            return res
        self.events.emit(
            "cache.gc",
            evicted=len(res.evicted),
            bytes=res.bytes_freed,
            blobs=res.blobs_removed,
            kept_in_use=len(res.kept_in_use),
            kept_pinned=len(res.kept_pinned),
            kept_pulling=len(res.kept_pulling),
            kept_held=len(res.kept_held),
            kept_young=len(res.kept_young),
        )
        return res

    # ------------------------------------------------------------------ executing the plan
    def _remove_leftover(self, leftover: Removal) -> bool:
        if leftover.what.startswith(self.snapshots.dir + os.sep):
            return self.snapshots.remove_leftover(leftover)
        return self.store.remove_leftover(leftover)

    def _execute(
        self, plan: GCPlan, scan: CacheScan, rule: EvictionRule, pulling: set[str], res: GCResult
    ) -> list[Removal]:
        """Carry out ``plan`` under the GC lock, each item re-checked now; returns what was done.
        Leftovers were removed before the lock was taken (``plan.leftovers`` holds what went)."""
        done = list(plan.leftovers)
        dirs = {path: d for d, (path, _) in scan.unmarked_dirs.items()}
        for r in plan.manifests:
            d = dirs.get(r.what, r.what)
            if d in pulling or self._marked(d) or self.pins.is_pinned(d):
                continue  # a pull finished (or someone pinned it) since the scan: not a leftover
            if r.what in dirs:
                with contextlib.suppress(SnapshotInUseError):
                    self.snapshots.remove(d)
                    done.append(r)
            elif self._forget_manifest(d):
                done.append(r)
        self._evict(plan.eviction, rule, res)
        evicted = set(res.evicted)
        done += [r for r in plan.snapshots if r.what in evicted]
        for r in plan.referrers:
            subject = scan.subjects[r.what]
            if subject in plan.eviction.reasons:  # a victim's referrers went with its index entry
                if subject in evicted:
                    done.append(r)
            elif subject in pulling or self._marked(subject) or self.pins.is_pinned(subject):
                continue  # its model is kept again since the scan
            elif self._forget_manifest(r.what):
                done.append(r)
        # what needs a blob is read again now: a manifest stored since the scan keeps its blobs
        keep = set(pulling)
        for s in scan.snapshots:
            if s.digest not in evicted:
                keep |= s.blobs
        for m in self.store.manifest_digests():
            keep |= scan.manifest_blobs.get(m) or manifest_blobs(self.store, m)
        for r in plan.blobs:
            if r.what not in keep and self.store.remove_blob(r.what):
                done.append(r)
        return done

    def _marked(self, digest: str) -> bool:
        """Ready now (a valid marker of the owner): published since the scan, not a leftover."""
        try:
            return self.snapshots.ready(digest) is not None
        except ModelpackError:
            return False

    def _evict(self, plan: Plan, rule: EvictionRule, res: GCResult) -> None:
        """Delete the victims that still may go (re-checked now), into ``res.evicted``."""
        rule = dataclasses.replace(rule, now=time.time())
        for victim in plan.victims:
            d = victim.digest
            t = time.monotonic()
            now_seen = self._rescan(victim, rule.now)
            reason = rule.reason(now_seen)
            if reason is not None:
                getattr(res, f"kept_{reason}", res.kept_in_use).append(d)
                continue
            res.refs_removed += self.refs.remove_to(d)
            try:
                # a lease held only by foreign readers past their bound does not stop the removal
                self.snapshots.remove(d, force=now_seen.holders is not None)
            except SnapshotInUseError:  # a reader arrived after our check
                res.kept_in_use.append(d)
                continue
            self._forget_manifest(d)
            res.evicted.append(d)
            self.events.emit(
                "cache.evict",
                digest=d,
                reason=plan.reasons[d],
                bytes=victim.info.size,
                last_used=now_seen.last_used,
                idle_s=round(time.time() - now_seen.last_used, 3),
                duration_ms=to_ms(time.monotonic() - t),
            )

    def _rescan(self, victim: ScannedSnapshot, now: float) -> ScannedSnapshot:
        """The victim's pin, lease holders and last use as they are now (three small reads)."""
        d = victim.digest
        try:
            last_used = os.stat(self.snapshots.lease_path(d), follow_symlinks=False).st_mtime
        except FileNotFoundError:
            last_used = victim.last_used
        return dataclasses.replace(
            victim,
            pinned=self.pins.is_pinned(d),
            holders=self.snapshots.lease_holders(d),
            last_used=clamped_last_use(self.snapshots, d, last_used, now, rewrite=True),
        )

    def _lease_blocks(self, digest: str, holders: list[int | None] | None, foreign_lease_s: float) -> bool:
        now = time.time()
        info = self.snapshots.ready(digest)
        last_used = clamped_last_use(
            self.snapshots, digest, info.last_used if info else 0.0, now, rewrite=True
        )
        return lease_blocks_eviction(holders, self.store.owner, last_used, now, foreign_lease_s)

    def _forget_manifest(self, digest: str) -> bool:
        """Drop a manifest (and the referrers kept for it) from index.json without waiting for
        its lock: a held lock means this GC leaves the entry (and so its blobs) for the next one."""
        try:
            self.store.remove_manifest(digest, timeout=0)
        except LockTimeoutError:
            return False
        return True

    def _delete_unreferenced_blobs(self, protected: set[str], candidates: set[str]) -> None:
        """Delete the ``candidates`` that neither ``protected`` nor any manifest in ``index.json``
        (read now) needs."""
        live: set[str] = set(protected)
        for m in self.store.manifest_digests():
            live |= manifest_blobs(self.store, m)
        for d in sorted(candidates - live):
            self.store.remove_blob(d)
