"""Removing models from the node cache: ``rm``, LRU garbage collection and crash-leftover sweeps.

Both ``rm`` and GC run under the exclusive ``locks/gc.lock`` (``mount.leases``; the wait for it
is bounded), so they see every running pull's lease, and never delete a pinned, in-use,
being-pulled or held model, nor one used or published less than ``min_age`` seconds ago (the
pull that published it may not have handed it to its reader yet). Deletion order: refs →
snapshot (marker first, then files) → manifest → blobs no remaining manifest or snapshot needs.
GC never waits on a reader's lease or on ``index.json``'s lock: what it cannot lock now it skips,
and the next GC finishes it.
"""

from __future__ import annotations

import contextlib
import os
import time

from modelpack.mount.assets import version_kind
from modelpack.mount.leases import PullLeases
from modelpack.mount.listing import usage
from modelpack.mount.refs import Pins, RefRecords
from modelpack.mount.reports import GCResult, to_ms
from modelpack.mount.snapshots import SnapshotInfo, Snapshots
from modelpack.mount.store import Store

from modelpack.errors import CacheError, LockTimeoutError, ModelpackError, SnapshotInUseError
from modelpack.events import EventLog
from modelpack.oci.descriptor import Index, parse_manifest_or_index
from modelpack.oci.digest import Digest

# a snapshot used or published this recently is not evicted: its pull may still be handing it over
DEFAULT_MIN_AGE_S = 300.0


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

    def rm(self, reference: str, digest: Digest, *, force: bool = False) -> Digest:
        """Remove one model; refused when pinned or in use unless ``force``."""
        d = str(digest)
        with self.leases.gc_exclusive():
            if self.pins.is_pinned(d) and not force:
                raise CacheError(f"{reference}: {d} is pinned; 'modelpack cache unpin' it first (or --force)")
            if self.snapshots.in_use(d) and not force:
                raise SnapshotInUseError(f"{reference}: {d} is in use by a reader; retry when it is released")
            self.refs.remove_to(d)
            self.snapshots.remove(d, force=force)
            self.store.remove_manifest(d)
            self.pins.remove(d)
            self._delete_unreferenced_blobs(self.leases.active_digests())
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
    ) -> GCResult:
        """Evict least-recently-used snapshots: beyond ``keep_versions`` per repository, then until
        the cache is under ``max_bytes``. Never a pinned, in-use, being-pulled or held model, nor
        one used less than ``min_age`` seconds ago. Deletes refs → snapshots → manifests → blobs
        no remaining manifest needs. ``dry_run`` deletes nothing and reports what would go."""
        res = GCResult()
        with self.leases.gc_exclusive():
            res.swept = [] if dry_run else self.sweep()
            res.bytes_before = self.usage()
            pulling_manifests, pulling = self.leases.active()
            res.kept_pulling = sorted(set(pulling_manifests))
            held = {h.digest for h in self.leases.holds(remove_expired=not dry_run)}
            now = time.time()
            infos = sorted(self.snapshots.list_ready(), key=lambda i: i.last_used)  # LRU first
            protected: set[str] = set()
            for info in infos:
                d = str(info.digest)
                if self.pins.is_pinned(d):
                    res.kept_pinned.append(d)
                    protected.add(d)
                elif self.snapshots.in_use(d):
                    res.kept_in_use.append(d)
                    protected.add(d)
                elif d in pulling:
                    protected.add(d)
                elif d in held:
                    res.kept_held.append(d)
                    protected.add(d)
                elif now - info.last_used < min_age:
                    res.kept_young.append(d)
                    protected.add(d)
            evict: list[SnapshotInfo] = []
            reasons: dict[str, str] = {}
            if keep_versions is not None:
                # versions of one kind per repository: a model's runtime assets (compile caches,
                # mount.assets) never count as versions of the model itself
                by_repo: dict[tuple[str, str], list[SnapshotInfo]] = {}
                for info in infos:
                    key = (
                        str(info.meta.get("repository", "")),
                        version_kind(self.store, str(info.digest)),
                    )
                    by_repo.setdefault(key, []).append(info)
                for group in by_repo.values():
                    newest_first = sorted(group, key=lambda i: -i.last_used)
                    for info in newest_first[max(0, keep_versions) :]:
                        if str(info.digest) not in protected:
                            evict.append(info)
                            reasons[str(info.digest)] = "keep_versions"
            if max_bytes is not None:
                usage_now = res.bytes_before - sum(self._freed_by(evict, infos, pulling))
                for info in infos:
                    if usage_now <= max_bytes:
                        break
                    d = str(info.digest)
                    if d in protected or d in reasons:
                        continue
                    freed = sum(self._freed_by([*evict, info], infos, pulling)) - sum(
                        self._freed_by(evict, infos, pulling)
                    )
                    evict.append(info)
                    reasons[d] = "max_bytes"
                    usage_now -= freed
            if dry_run:
                res.evicted = [str(i.digest) for i in evict]
                res.bytes_freed = min(res.bytes_before, sum(self._freed_by(evict, infos, pulling)))
                res.bytes_after = res.bytes_before - res.bytes_freed
                return res
            # leftovers of pulls that died after storing their manifest or renaming their snapshot
            # directory but before the marker: never ready, so never trusted; remove them
            ready = {str(i.digest) for i in infos}
            for m in self.store.manifest_digests():
                if m not in ready and m not in pulling:
                    self._forget_manifest(m)
            for entry in list(os.scandir(self.snapshots.dir)):
                if len(entry.name) == 64 and entry.is_dir(follow_symlinks=False):
                    d = "sha256:" + entry.name
                    if d not in ready and d not in pulling:
                        with contextlib.suppress(SnapshotInUseError):
                            self.snapshots.remove(d)
                            res.swept.append(entry.path)
            evict.sort(key=lambda i: i.last_used)
            for info in evict:
                d = str(info.digest)
                t = time.monotonic()
                res.refs_removed += self.refs.remove_to(d)
                try:
                    self.snapshots.remove(d)
                except SnapshotInUseError:  # a reader arrived after our check
                    res.kept_in_use.append(d)
                    continue
                self._forget_manifest(d)
                res.evicted.append(d)
                self.events.emit(
                    "cache.evict",
                    digest=d,
                    reason=reasons[d],
                    bytes=info.size,
                    last_used=info.last_used,
                    idle_s=round(time.time() - info.last_used, 3),
                    duration_ms=to_ms(time.monotonic() - t),
                )
            keep = set(pulling)
            for info in infos:
                if str(info.digest) not in res.evicted:
                    keep |= info.blob_digests() | {str(info.digest)}
            removed, freed = self._delete_unreferenced_blobs(keep)
            res.blobs_removed = removed
            res.bytes_after = self.usage()
            res.bytes_freed = max(0, res.bytes_before - res.bytes_after)
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

    def _forget_manifest(self, digest: str) -> None:
        """Drop a manifest from index.json without waiting for its lock: a held lock means this
        GC leaves the entry (and so its blobs) for the next one."""
        with contextlib.suppress(LockTimeoutError):
            self.store.remove_manifest(digest, timeout=0)

    def _manifest_blobs(self, digest: str) -> set[str]:
        """Digests a stored manifest keeps alive (itself, config, layers)."""
        try:
            raw = self.store.read_small(digest)
            parsed = parse_manifest_or_index(raw)
        except (OSError, ModelpackError):
            return {digest}
        if isinstance(parsed, Index):
            return {digest, *(str(m.digest) for m in parsed.manifests)}
        return {digest, str(parsed.config.digest), *(str(layer.digest) for layer in parsed.layers)}

    def _delete_unreferenced_blobs(self, protected: set[str]) -> tuple[int, int]:
        live: set[str] = set(protected)
        for m in self.store.manifest_digests():
            live |= self._manifest_blobs(m)
        removed = freed = 0
        for d in self.store.blob_digests():
            if d not in live:
                freed += self.store.remove_blob(d)
                removed += 1
        return removed, freed

    def _freed_by(self, evict: list[SnapshotInfo], infos: list[SnapshotInfo], pulling: set[str]) -> list[int]:
        """Bytes that evicting ``evict`` would free: their extracted files + blobs nobody else uses."""
        gone = {str(i.digest) for i in evict}
        keep_blobs: set[str] = set(pulling)
        for info in infos:
            if str(info.digest) not in gone:
                keep_blobs |= info.blob_digests() | {str(info.digest)}
        sizes: dict[str, int] = {}
        extracted = 0
        for info in evict:
            extracted += sum(f.size for f in info.files if not f.linked)
            for b in info.blob_digests() | {str(info.digest)}:
                if b not in keep_blobs and b not in sizes:
                    try:
                        sizes[b] = os.stat(self.store.blob_path(b)).st_size
                    except FileNotFoundError:
                        sizes[b] = 0
        return [extracted, *sizes.values()]
