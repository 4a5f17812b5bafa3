"""``NodeCache``: the node cache's facade; pull-and-verify, snapshots, pins, verify, GC (docs/node.md#the-node-cache).

Layout under the cache root (default ``$MODELPACK_CACHE``, else ``$XDG_CACHE_HOME/modelpack``,
else ``~/.cache/modelpack``), and the module that owns each part::

    oci-layout, index.json, blobs/sha256/   content-addressed store              ``mount.store``
    ingest/, locks/<hex>.lock               partial downloads, per-blob locks    ``mount.ingest``
    locks/m-<hex>.lock                      one pull per manifest per node       ``mount.pull``
    snapshots/<hex>{,.ready,.lease}         published models, ready markers      ``mount.snapshots``
    snapshots/<hex>.trust.json              what verified a digest's signature   ``mount.trust``
    refs/<key>.json, pins/<hex>             reference → digest at pull time; pins ``mount.refs``
    tag-history/<key>.json                  per tag: newest signed version accepted ``mount.rollback``
    leases/<id>.json, locks/gc.lock         running pulls' digests, GC handshake ``mount.leases``
    leases/hold-<id>.json                   ``pull --hold``: kept from GC until a deadline
    events.jsonl                            one JSON line per decision

Eviction, ``rm`` and sweeps live in ``mount.gc`` (what GC reads without its lock in
``mount.gc_scan``, which snapshots go in ``mount.gc_plan``; trees are deleted by
``mount.treewalk``, which never follows a symlink); re-hashing in ``mount.integrity`` (against
the manifest, ``mount.contents``); ``ls`` and usage in ``mount.listing``; the records returned in
``mount.reports``; modes and ownership in ``mount.modes``. This module wires them to one cache
root and keeps the public methods in one place.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from modelpack.mount.gc import DEFAULT_FOREIGN_LEASE_S, DEFAULT_MIN_AGE_S, GarbageCollector
from modelpack.mount.ingest import BlobIngest, IngestWatch
from modelpack.mount.integrity import verify_snapshots
from modelpack.mount.leases import PullLeases
from modelpack.mount.listing import list_entries, usage
from modelpack.mount.locks import DEFAULT_STALE_AFTER_S, default_lock_timeout
from modelpack.mount.modes import FILE_MODE, open_private
from modelpack.mount.pull import Puller
from modelpack.mount.refs import Pins, RefRecords
from modelpack.mount.reports import CacheEntry, GCResult, PullResult, VerifyReport
from modelpack.mount.rollback import RollbackGuard, TagHistory
from modelpack.mount.snapshots import SnapshotInfo, Snapshots
from modelpack.mount.store import Store
from modelpack.mount.trust import PolicySource, TrustRecords
from modelpack.mount.variants import IndexRecords, VariantResolver

from modelpack import settings
from modelpack.errors import NotFoundError
from modelpack.events import EventLog
from modelpack.oci.digest import Digest
from modelpack.oci.reference import Reference
from modelpack.oci.variant_selection import VariantSelector
from modelpack.targets.base import ReadableTarget
from modelpack.targets.opener import TargetOptions

if TYPE_CHECKING:
    from modelpack.mount.trust import PolicySource

__all__ = ["CacheEntry", "GCResult", "NodeCache", "PullResult", "VerifyReport", "default_cache_dir"]


def default_cache_dir() -> str:
    explicit = settings.CACHE.get()
    if explicit:
        return explicit
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = xdg if xdg else os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "modelpack")


class NodeCache:
    """A node-local model cache. Safe for many threads and processes on one filesystem.

    ``create=False`` opens an existing cache only (``NotFoundError`` otherwise) and creates
    nothing, for commands that inspect or maintain a cache. ``lock_timeout`` bounds every wait
    on the GC gate, ``index.json``'s lock and reader leases (default ``$MODELPACK_LOCK_TIMEOUT``,
    else 120 s).
    """

    def __init__(
        self,
        root: str | None = None,
        *,
        max_cache_bytes: int | None = None,
        reserve_bytes: int = 0,
        stale_after: float = DEFAULT_STALE_AFTER_S,
        events: EventLog | str | None = None,
        create: bool = True,
        lock_timeout: float | None = None,
    ) -> None:
        self.root = os.path.abspath(root or default_cache_dir())
        self.lock_timeout = default_lock_timeout() if lock_timeout is None else lock_timeout
        self.store = Store(self.root, create=create, lock_timeout=self.lock_timeout)
        writable = self.store.writable
        owner = self.store.owner
        self.snapshots = Snapshots(self.store)
        self.refs = RefRecords(self.root, owner, create=writable)
        self.pins = Pins(self.root, owner, create=writable)
        self.leases = PullLeases(
            self.root, self.store.locks_dir, owner=owner, lock_timeout=self.lock_timeout, create=writable
        )
        self.refs_dir = self.refs.dir
        self.pins_dir = self.pins.dir
        self.leases_dir = self.leases.dir
        self.blobs = BlobIngest(self.store, stale_after=stale_after)
        self.trust = TrustRecords(self.store, self.snapshots)
        self.tags = TagHistory(self.root, owner, locks_dir=self.store.locks_dir)
        self.indexes = IndexRecords(self.root, owner, create=writable)
        self.max_cache_bytes = max_cache_bytes
        self.reserve_bytes = reserve_bytes
        self.stale_after = stale_after
        self.events_path = os.path.join(self.root, "events.jsonl")
        if writable:  # created 0644, never through a symlink another uid may have left there
            with contextlib.suppress(OSError):
                os.close(open_private(self.events_path, os.O_WRONLY, owner, FILE_MODE))
        self.events = self._event_log(events)

    def _event_log(self, events: EventLog | str | None) -> EventLog:
        """The cache's ``events.jsonl`` is best effort (a read-only cache, or a reader of another
        uid, cannot write it: never a reason to fail a read); ``events`` (``-`` or a file the
        caller named) is required and checked now."""
        if isinstance(events, EventLog):
            return events
        return EventLog.from_spec(self.events_path, events, best_effort=True)

    @property
    def gc_lock_path(self) -> str:
        return self.leases.gc_lock_path

    # ------------------------------------------------------------------ refs & pins
    def resolve_local(self, reference: str | Reference) -> Digest:
        """The manifest digest a reference stands for on this node, without any network I/O.

        A digest-pinned reference is itself; a tag is what the last pull resolved it to. A bare
        ``sha256:…`` names a cached manifest directly.
        """
        digest = self.refs.resolve_local(reference)
        chosen = self.indexes.chosen_entry(str(digest))  # an index: the entry this node took
        return Digest(chosen) if chosen else digest

    def is_pinned(self, digest: str) -> bool:
        return self.pins.is_pinned(digest)

    def pin(self, reference: str) -> Digest:
        digest = self.resolve_local(reference)
        if self.snapshots.ready(digest) is None:
            raise NotFoundError(f"{reference}: {digest} is not ready in {self.root}")
        self.pins.add(digest, reference)
        self.events.emit("cache.pin", reference=reference, digest=str(digest))
        return digest

    def unpin(self, reference: str) -> Digest:
        digest = self.resolve_local(reference)
        self.pins.remove(digest)
        self.events.emit("cache.unpin", reference=reference, digest=str(digest))
        return digest

    # ------------------------------------------------------------------ pull
    def pull(
        self,
        reference: str | Reference,
        target_options: TargetOptions | None = None,
        *,
        policy: PolicySource | None = None,
        jobs: int = 4,
        events: EventLog | str | None = None,
        source: ReadableTarget | None = None,
        start_id: str | None = None,
        progress: str = "off",
        hold: float | None = None,
        allow_rollback: bool = False,
        variant: VariantSelector | None = None,
        watch: IngestWatch | None = None,
    ) -> PullResult:
        """Make ``reference`` available as a verified snapshot; returns where and what it cost.

        ``policy`` is a ``TrustPolicy``, a path to one, public keys, or None (no signature check).
        ``source`` overrides the target the reference names (tests, custom backings).
        ``progress`` is ``auto|on|off`` (bars on stderr while blobs download). ``hold`` keeps the
        snapshot from GC for that many seconds after the pull, so the process it is handed to
        finds it (``result.hold_path``; ``release_hold`` ends it early). Under a policy, a tag
        naming a version signed before the newest one accepted for it here is refused
        (``RollbackRefused``) unless ``allow_rollback`` (``mount.rollback``). A reference to an
        index of variants is resolved to the entry ``variant`` selects (``mount.variants``; no
        selector: one that knows no node facts), which is then pulled as any manifest.
        ``watch`` hears each write of downloaded bytes into an ingest partial and each blob whose
        bytes matched their digest (a streamed load reading the ingest as it lands,
        ``loader.stream_through``).
        """
        log = self.events if events is None else self._event_log(events)
        puller = Puller(
            store=self.store,
            snapshots=self.snapshots,
            refs=self.refs,
            trust=self.trust,
            leases=self.leases,
            blobs=self.blobs,
            stale_after=self.stale_after,
            max_cache_bytes=self.max_cache_bytes,
            reserve_bytes=self.reserve_bytes,
            usage=self.usage,
            progress=progress,
            hold=hold,
            rollback=RollbackGuard(self.tags, allow_rollback) if policy is not None else None,
            variants=VariantResolver(self.indexes, self.store, self.trust, variant),
            watch=watch,
        )
        return puller.pull(
            reference, target_options, policy=policy, jobs=jobs, log=log, source=source, start_id=start_id
        )

    def release_hold(self, hold_path: str) -> bool:
        """End a ``pull(hold=…)`` hold early (its reader has its own lease now)."""
        return self.leases.release_hold(hold_path)

    # ------------------------------------------------------------------ readers
    @contextlib.contextmanager
    def open_snapshot(self, reference: str | Reference) -> Iterator[SnapshotInfo]:
        """Use a cached model: holds a reader lease so GC and ``rm`` leave it alone. No network."""
        digest = self.resolve_local(reference)
        with self.snapshots.lease(digest) as info:
            yield info

    def snapshot_path(self, reference: str | Reference) -> str:
        digest = self.resolve_local(reference)
        info = self.snapshots.ready(digest)
        if info is None:
            raise NotFoundError(f"{reference}: {digest} is not ready in {self.root}")
        return info.path

    # ------------------------------------------------------------------ listing
    def ls(self) -> list[CacheEntry]:
        entries = list_entries(self.refs, self.pins, self.snapshots)
        by_entry: dict[str, list[dict[str, Any]]] = {}
        for rec in self.indexes.all():  # which index each snapshot was chosen from
            for chosen in rec["taken"].values():
                if isinstance(chosen, dict) and chosen.get("digest"):
                    by_entry.setdefault(str(chosen["digest"]), []).append(
                        {
                            "index": rec["digest"],
                            "reference": chosen.get("reference"),
                            "variant": chosen.get("variant"),
                        }
                    )
        for e in entries:
            e.indexes = by_entry.get(e.digest, [])
        return entries

    def usage(self) -> int:
        """Bytes the cache holds: blobs (hard links are not counted twice) + extracted files."""
        return usage(self.store, self.snapshots)

    # ------------------------------------------------------------------ verify
    def verify(self, reference: str | None = None, *, repair: bool = True) -> list[VerifyReport]:
        """Re-hash snapshots on demand; a damaged one is unpublished and its bad blobs removed."""
        if reference is not None:
            digest = self.resolve_local(reference)
            info = self.snapshots.ready(digest)
            if info is None:
                raise NotFoundError(f"{reference}: {digest} is not ready in {self.root}")
            infos = [info]
        else:
            infos = self.snapshots.list_ready()
        return verify_snapshots(infos, self.store, self.snapshots, self.events, repair=repair)

    # ------------------------------------------------------------------ removal & GC
    def _collector(self) -> GarbageCollector:
        return GarbageCollector(self.store, self.snapshots, self.refs, self.pins, self.leases, self.events)

    def rm(
        self, reference: str, *, force: bool = False, foreign_lease_s: float = DEFAULT_FOREIGN_LEASE_S
    ) -> Digest:
        return self._collector().rm(
            reference, self.resolve_local(reference), force=force, foreign_lease_s=foreign_lease_s
        )

    def sweep(self) -> list[str]:
        """Remove temp files, dead builders' snapshot dirs and finished partials."""
        return self._collector().sweep()

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
        one used or published less than ``min_age`` seconds ago. A reader lease held only by
        other uids keeps a snapshot at most ``foreign_lease_s`` past its last use by the owner."""
        return self._collector().gc(
            keep_versions=keep_versions,
            max_bytes=max_bytes,
            dry_run=dry_run,
            min_age=min_age,
            foreign_lease_s=foreign_lease_s,
        )
