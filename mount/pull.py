"""Pull-and-verify one reference into a published snapshot: a hit from the ready marker, or a miss.

A hit costs one tag resolution (none when the reference is pinned by digest), one small file
read (the ready marker) and one ``utime``; nothing is hashed. A miss takes the manifest lock
``locks/m-<hex>.lock`` (one pull per manifest per node; a waiter re-checks the marker when it
gets the lock), fetches and verifies the manifest, checks signatures per policy, registers a
pull lease for GC, checks free space and quota, ingests missing blobs (resuming partial ones),
stores the manifest, builds the snapshot in a temp directory and publishes it (rename, then the
ready marker, in ``mount.snapshots``). Trust is recorded only once the snapshot is ready.

Tar layers expand when the snapshot is built, by an amount only their headers tell: extraction
gets what is left of the quota and the free space as one budget, and crossing it is the same
typed refusal as a download that would not fit (``mount.expansion``). A reference naming an
index of variants is handed to ``mount.variants`` (``VariantResolver.pull_index``). With ``hold`` the snapshot is held for GC
(``mount.leases``) before the pull's own lease ends, so the process it is handed to finds it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from modelpack.mount.expansion import describe_room, expansion_refused, expansion_room
from modelpack.mount.ingest import BlobIngest, IngestWatch, check_space
from modelpack.mount.leases import Hold, PullLeases
from modelpack.mount.locks import acquire
from modelpack.mount.refs import RefRecords
from modelpack.mount.reports import PullResult, to_ms
from modelpack.mount.rollback import PendingAcceptance, RollbackGuard
from modelpack.mount.snapshots import SnapshotInfo, Snapshots
from modelpack.mount.store import Store
from modelpack.mount.trust import PolicySource, TrustRecords

from modelpack.errors import (
    CacheError,
    ExpansionLimitError,
    ManifestError,
)
from modelpack.events import EventLog
from modelpack.files import write_error
from modelpack.oci.descriptor import Descriptor, Index, Manifest, parse_manifest_or_index
from modelpack.oci.digest import Digest, verify_bytes
from modelpack.oci.reference import Reference, parse_reference
from modelpack.progress import Progress
from modelpack.settings import resolve_start_id
from modelpack.targets.base import ReadableTarget, SourceAccounting
from modelpack.targets.opener import TargetOptions, open_readable
from modelpack.transfer.layer_formats import manifest_layer_formats, needs_config

if TYPE_CHECKING:
    from modelpack.mount.trust import PolicySource


@dataclass
class Puller:
    """The pull path over one cache's parts; ``NodeCache`` builds one per pull, so it sees the
    cache's current quota and reserve."""

    store: Store
    snapshots: Snapshots
    refs: RefRecords
    trust: TrustRecords
    leases: PullLeases
    blobs: BlobIngest
    stale_after: float
    max_cache_bytes: int | None
    reserve_bytes: int
    usage: Callable[[], int]
    progress: str = "off"  # --progress auto|on|off: bars on stderr for the blobs a miss downloads
    hold: float | None = None  # --hold: keep the snapshot from GC this many seconds after the pull
    rollback: RollbackGuard | None = None  # tag pulls under a policy: no older signed version
    variants: Any = None  # mount.variants.VariantResolver: an index reference → the entry that fits
    # told what the ingest lands and verifies (a streamed load follows it: loader.stream_through)
    watch: IngestWatch | None = None

    def pull(
        self,
        reference: str | Reference,
        target_options: TargetOptions | None,
        *,
        policy: PolicySource | None,
        jobs: int,
        log: EventLog,
        source: ReadableTarget | None,
        start_id: str | None,
    ) -> PullResult:
        """Make ``reference`` available as a verified snapshot; returns where and what it cost."""
        t0 = time.monotonic()
        ref = parse_reference(reference) if isinstance(reference, str) else reference
        ref_text = str(ref)
        # one start_id groups a model start's events across processes (init container → loader)
        sid = resolve_start_id(start_id)
        timings: dict[str, float] = {}

        def ev(name: str, **fields: Any) -> None:
            fields.setdefault("reference", ref_text)
            fields.setdefault("start_id", sid)
            log.emit(name, **fields)

        ev("cache.pull_start", pinned=ref.is_pinned)
        target_options = _with_events(target_options, log)
        target: ReadableTarget | None = source
        desc: Descriptor | None = None
        try:
            if ref.digest:
                digest = ref.digest
            else:
                target = target or open_readable(ref, target_options)
                desc = target.resolve(ref.identifier)
                digest = desc.digest
                timings["resolve"] = to_ms(time.monotonic() - t0)
            info = self._ready_unquarantined(digest, ev)
            if info is None and self.variants is not None:
                found = self.variants.index_for(ref, digest, desc, target, target_options)
                if found is not None:
                    return self.variants.pull_index(
                        self, found, ref, target_options, policy, jobs, log, sid, ev
                    )
            if info is not None:
                signature = "not-checked"
                if policy is not None:
                    target, signature = self.trust.on_hit(
                        info, ref, target, target_options, policy, log, ev, timings
                    )
                    self._no_rollback_on_hit(ref, str(info.digest), policy, ev).accept()
                if desc is not None:  # the tag names this digest here only once it was accepted
                    self.refs.record(ref, digest)
                return self._hit(info, ref_text, sid, t0, timings, ev, signature=signature)
            ev("cache.miss", digest=str(digest))
            if target is None:
                target = open_readable(ref, target_options)
            if ref.digest and not desc:
                self.refs.record(ref, digest)
            return self._miss(ref, ref_text, digest, target, policy, jobs, sid, t0, timings, ev, log)
        except BaseException as exc:
            failure = _full_disk(exc, self.store.root)
            ev(
                "cache.pull_failed",
                digest=str(desc.digest) if desc else (str(ref.digest) if ref.digest else None),
                error=type(failure).__name__,
                reason=str(failure),
                duration_ms=to_ms(time.monotonic() - t0),
            )
            if failure is not exc:
                raise failure from exc
            raise

    def no_rollback(
        self, ref: Reference, digest: str, signed_at: float | None, ev: Callable[..., None]
    ) -> PendingAcceptance:
        """``mount.rollback``: refuse a tag's version signed before the newest one accepted (also
        for an index's tag, ``mount.variants``)."""
        if self.rollback is None:
            return PendingAcceptance(None, ref, digest, signed_at or 0.0)
        return self.rollback.check(ref, digest, signed_at, ev)

    def _no_rollback_on_hit(
        self, ref: Reference, digest: str, policy: PolicySource, ev: Callable[..., None]
    ) -> PendingAcceptance:
        """A hit under a policy: its signing time is in the trust record ``on_hit`` checked."""
        if self.rollback is None:
            return PendingAcceptance(None, ref, digest, 0.0)
        return self.rollback.check(ref, digest, self.trust.signed_time(digest, ref, policy), ev)

    def _ready_unquarantined(self, digest: str, ev: Callable[..., None]) -> SnapshotInfo | None:
        """The ready snapshot, unless a blob it holds was quarantined after it was published (a
        ``cache verify`` killed between quarantine and unmarking): then the repair is finished
        here (the marker removed) and the pull rebuilds it from verified blobs."""
        info = self.snapshots.ready(digest)
        if info is None:
            return None
        bad = self.store.quarantined_since(info.blob_digests(), info.created)
        if not bad:
            return info
        ev("cache.verify_failed", digest=str(digest), reason=f"quarantined blobs: {', '.join(sorted(bad))}")
        # a read-only cache cannot unmark it: it is still never served (the miss path says why)
        with contextlib.suppress(OSError):
            os.unlink(self.snapshots.marker_path(digest))
        return None

    def _hit(
        self,
        info: SnapshotInfo,
        ref_text: str,
        sid: str,
        t0: float,
        timings: dict[str, float],
        ev: Callable[..., None],
        *,
        waited_s: float = 0.0,
        signature: str = "not-checked",
    ) -> PullResult:
        self.snapshots.touch(info.digest)
        hold = self._add_hold(info.digest, ref_text, ev) if self.hold else None
        now = time.monotonic()
        ev(
            "cache.version_confirmed",
            digest=str(info.digest),
            stage="t2",
            state="hit",
            duration_ms=to_ms(now - t0),
        )
        total = to_ms(time.monotonic() - t0)
        timings["total"] = total
        ev(
            "cache.hit",
            digest=str(info.digest),
            stage="t4",
            state="hit",
            bytes=info.size,
            files=len(info.files),
            duration_ms=total,
            waited_ms=to_ms(waited_s) if waited_s else None,
            path=info.path,
        )
        return PullResult(
            ref_text,
            info.digest,
            info.path,
            "hit",
            files=len(info.files),
            bytes_total=int(info.meta.get("bytes_total", info.size)),
            bytes_reused=int(info.meta.get("bytes_total", info.size)),
            timings=timings,
            start_id=sid,
            signature=signature,
            hold_path=hold.path if hold else "",
            hold_until=hold.until if hold else 0.0,
        )

    def _add_hold(self, digest: str, ref_text: str, ev: Callable[..., None]) -> Hold:
        """Keep the snapshot from GC until its reader has opened it (``--hold``)."""
        seconds = float(self.hold or 0)
        try:
            hold = self.leases.add_hold(
                digest, seconds, ref_text, still_there=lambda: self.snapshots.ready(digest) is not None
            )
        except FileNotFoundError:
            raise CacheError(
                f"{ref_text}: {digest} was evicted from {self.store.root} before it could be held; pull again"
            ) from None
        ev("cache.hold", digest=str(digest), until=round(hold.until, 3), seconds=seconds, path=hold.path)
        return hold

    def _miss(
        self,
        ref: Reference,
        ref_text: str,
        digest: Digest,
        target: ReadableTarget,
        policy: PolicySource | None,
        jobs: int,
        sid: str,
        t0: float,
        timings: dict[str, float],
        ev: Callable[..., None],
        log: EventLog,
    ) -> PullResult:
        def waiting(holder: str) -> None:
            ev("cache.lock_wait", digest=str(digest), holder=holder)

        mlock = acquire(
            os.path.join(self.store.locks_dir, "m-" + digest.hex + ".lock"),
            stale_after=self.stale_after,
            on_wait=waiting,
        )
        try:
            info = self.snapshots.ready(digest)
            if info is not None:  # another process published it while we waited
                signature = "not-checked"
                if policy is not None:
                    _, signature = self.trust.on_hit(info, ref, target, None, policy, log, ev, timings)
                    self._no_rollback_on_hit(ref, str(digest), policy, ev).accept()
                if not ref.digest:
                    self.refs.record(ref, digest)
                return self._hit(
                    info, ref_text, sid, t0, timings, ev, waited_s=mlock.waited_s, signature=signature
                )
            t = time.monotonic()
            raw, media_type = target.fetch_manifest(str(digest))
            verify_bytes(raw, digest, None, what="manifest", source=target.name)
            parsed = parse_manifest_or_index(raw, media_type)
            if isinstance(parsed, Index):
                raise ManifestError(f"{ref_text}: {digest} is an index; pull one of its manifests by digest")
            manifest: Manifest = parsed
            timings["manifest"] = to_ms(time.monotonic() - t)
            ev(
                "cache.version_confirmed",
                digest=str(digest),
                stage="t2",
                state="cold",
                duration_ms=to_ms(time.monotonic() - t0),
            )
            verification = None
            pending = PendingAcceptance(None, ref, str(digest), 0.0)
            if policy is not None:
                t = time.monotonic()
                verification = self.trust.check(target, ref, manifest, policy, log, ev, record=False)
                timings["signature"] = to_ms(time.monotonic() - t)
                pending = self.no_rollback(ref, str(digest), verification.signed_at, ev)
            if not ref.digest:  # only a version that passed the checks becomes the tag's here
                self.refs.record(ref, digest)

            blobs = _unique_blobs(manifest)
            with self.leases.hold([str(digest), *(str(b.digest) for b in blobs)]):
                result = self._download(
                    manifest, target, blobs, jobs, ref_text, sid, timings, ev, mlock.heartbeat
                )
                self._publish(ref, ref_text, manifest, blobs, result, t0, timings, ev)
                if self.hold:  # registered before this pull's own lease ends: no gap for GC
                    hold = self._add_hold(digest, ref_text, ev)
                    result.hold_path, result.hold_until = hold.path, hold.until
            if verification is not None:
                self.trust.record(str(digest), verification)
                pending.accept()
                result.signature = str(verification.status)
            return result
        finally:
            mlock.release()

    def _download(
        self,
        manifest: Manifest,
        target: ReadableTarget,
        blobs: list[Descriptor],
        jobs: int,
        ref_text: str,
        sid: str,
        timings: dict[str, float],
        ev: Callable[..., None],
        heartbeat: Callable[[], None],
    ) -> PullResult:
        """Admit the download against quota and disk, ingest what is missing, count the bytes."""
        digest = manifest.digest
        missing = [b for b in blobs if not self.store.has(b)]
        needed = sum(max(0, b.size - self.store.partial_bytes(b.digest)) for b in missing)
        # tar layers are extracted into the snapshot (not linked): count them once more
        formats = manifest_layer_formats(manifest)
        needed += sum(b.size for b, f in zip(manifest.layers, formats, strict=True) if f.is_tar)
        check_space(
            self.store.root,
            needed,
            max_cache_bytes=self.max_cache_bytes,
            reserve_bytes=self.reserve_bytes,
            usage=self.usage,
            ev=ev,
            digest=str(digest),
        )
        result = PullResult(ref_text, digest, "", "cold", start_id=sid, timings=timings)
        result.bytes_total = sum(b.size for b in blobs)
        t = time.monotonic()
        ev(
            "cache.download_start",
            digest=str(digest),
            stage="t3",
            state="cold",
            blobs=len(missing),
            bytes=needed,
        )
        with Progress(needed, f"pull {digest.hex[:12]}", self.progress) as bar:

            def on_bytes(n: int) -> None:
                heartbeat()
                bar.update(n)
                if self.watch is not None:
                    self.watch.landed(n)

            results = self.blobs.ingest_all(
                missing,
                target,
                jobs=jobs,
                manifest_digest=str(digest),
                ev=ev,
                on_bytes=on_bytes,
                watch=self.watch,
            )
        timings["download"] = to_ms(time.monotonic() - t)
        result.bytes_by_source = (
            dict(target.bytes_by_source()) if isinstance(target, SourceAccounting) else {}
        )
        # downloaded + reused == total: a blob is either fetched (minus a resumed prefix, which is
        # reused) or was already there (committed by someone else meanwhile counts as reused)
        for b, r in zip(missing, results, strict=True):
            result.bytes_downloaded += r.downloaded
            result.bytes_resumed += r.resumed_from
            if r.existed:
                result.bytes_reused += b.size
            else:
                result.bytes_reused += r.resumed_from
            if r.downloaded:
                result.blobs_downloaded += 1
            else:
                result.blobs_reused += 1
        for b in blobs:
            if b not in missing:
                result.blobs_reused += 1
                result.bytes_reused += b.size
        return result

    def _publish(
        self,
        ref: Reference,
        ref_text: str,
        manifest: Manifest,
        blobs: list[Descriptor],
        result: PullResult,
        t0: float,
        timings: dict[str, float],
        ev: Callable[..., None],
    ) -> None:
        """Store the manifest, build the snapshot and publish it behind its ready marker."""
        digest = manifest.digest
        # every blob this snapshot will use must be present now (a GC bug would show here)
        for b in blobs:
            if not self.store.has(b):
                raise CacheError(f"{self.store.root}: blob {b.digest} vanished before the snapshot was built")
        t = time.monotonic()
        self.store.add_manifest(manifest.raw, manifest.media_type, ref_text)
        config_raw = None
        if needs_config(manifest):
            config_raw = self.store.read_small(manifest.config.digest)
        room = expansion_room(
            manifest,
            self.store.root,
            reserve_bytes=self.reserve_bytes,
            max_cache_bytes=self.max_cache_bytes,
            usage=self.usage,
        )
        try:
            tmp = self.snapshots.build(
                manifest,
                config_raw,
                extra={"reference": ref_text, "repository": ref.repo_name},
                max_expanded=room[0] if room else None,
                expansion_limit=describe_room(room, self.store.root),
            )
        except ExpansionLimitError as exc:
            raise expansion_refused(exc, room, ev, str(digest), self.store.root) from exc
        info = self.snapshots.publish(tmp, digest)
        timings["snapshot"] = to_ms(time.monotonic() - t)
        timings["total"] = to_ms(time.monotonic() - t0)
        result.path = info.path
        result.files = len(info.files)
        ev(
            "cache.ready",
            digest=str(digest),
            stage="t4",
            state="cold",
            bytes=result.bytes_downloaded,
            bytes_total=result.bytes_total,
            bytes_resumed=result.bytes_resumed or None,
            files=result.files,
            duration_ms=timings["total"],
            path=info.path,
        )


def _with_events(options: TargetOptions | None, log: EventLog) -> TargetOptions:
    """The pull's options with its event log for the target's source events (which source served
    each manifest, referrer listing and blob), unless the caller gave one."""
    opts = options if options is not None else TargetOptions.from_environ()
    if opts.events is not None:
        return opts
    return dataclasses.replace(opts, events=log)


def _unique_blobs(manifest: Manifest) -> list[Descriptor]:
    out: list[Descriptor] = []
    seen: set[str] = set()
    for d in [manifest.config, *manifest.layers]:
        if d.digest not in seen:
            seen.add(d.digest)
            out.append(d)
    return out


def _full_disk(exc: BaseException, root: str) -> BaseException:
    """A bare full-disk ``OSError`` from anywhere in the pull (a lease, a record, a lock) as the
    typed one-line error naming the file, else the cache it happened in; anything else as is."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        path = os.fsdecode(exc.filename) if exc.filename else root
        where = "" if path == root else f"in the node cache {root}; "
        return write_error(path, exc, kept=f"{where}free space or run 'modelpack cache gc'")
    return exc
