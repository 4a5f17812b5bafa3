"""Ingest blobs into the store: one verified, resumable download per digest on this node.

The download itself is the one blob writer (``modelpack.transfer.blob_writer``: resume by
re-hash, Range request for the rest, size and sha256 checked, fsync, read-only, atomic rename,
directory fsync). What is the node cache's own lives here: the partial is ``ingest/<hex>.partial``
(same filesystem as the store) guarded by the digest lock (``locks/<hex>.lock``, ``IngestSlot``);
after taking that lock the store is checked again, so a waiter finds the blob its holder
committed instead of downloading it a second time; a lock taken over from a stale holder writes
to a private temp file, since that holder may still be writing the partial.

Before any download a pull is admitted against the cache quota and the free disk space.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Protocol

from modelpack.mount.locks import HeldLock, SingleFlight, acquire
from modelpack.mount.modes import READ_ONLY_FILE_MODE
from modelpack.mount.reports import to_ms
from modelpack.mount.store import FULL_CACHE_HINT, LockedTemp, Store

from modelpack.errors import (
    DigestMismatchError,
    InsufficientSpaceError,
    QuotaExceededError,
    SizeMismatchError,
)
from modelpack.files import write_error
from modelpack.oci.descriptor import Descriptor
from modelpack.oci.digest import Digest
from modelpack.targets.base import ReadableTarget
from modelpack.transfer.blob_writer import Landing, Partial, WriteHooks, fetch_verified
from modelpack.transfer.staging import private_file


class IngestWatch(Protocol):
    """A follower of the ingest as it lands: a streamed load reading the partials
    (``loader.stream_through``)."""

    #: start each partial's disk writes as it grows (``WriteHooks.writeback``); False when the
    #: follower should not wait for the disk (the snapshot is published after the load returns)
    writeback: bool

    def landed(self, n: int) -> None:
        """``n`` downloaded bytes were written into a partial."""

    def verified(self, desc: Descriptor, st: os.stat_result) -> None:
        """The bytes of ``desc`` in the file ``st`` describes matched its size and digest (told
        before the fsync and the rename; the committed blob keeps that inode)."""


@dataclass
class IngestResult:
    digest: Digest
    size: int
    downloaded: int = 0  # bytes fetched from the source by this call
    resumed_from: int = 0  # bytes of a partial file reused (re-hashed, not re-fetched)
    existed: bool = False  # already committed: nothing fetched
    shared: bool = False  # another thread of this process did the work
    waited_s: float = 0.0
    seconds: float = 0.0
    lock_stale: bool = False


class BlobIngest:
    """Fetches blobs into ``store``: at most one fetch per digest per node (threads and processes)."""

    def __init__(self, store: Store, *, stale_after: float = 60.0) -> None:
        self.store = store
        self.stale_after = stale_after
        self._flight: SingleFlight[IngestResult] = SingleFlight()

    def ingest(
        self,
        desc: Descriptor,
        source: ReadableTarget,
        *,
        on_event: Callable[..., Any] | None = None,
        on_bytes: Callable[[int], None] | None = None,
        watch: IngestWatch | None = None,
    ) -> IngestResult:
        """Make ``desc`` present and verified; at most one fetch per digest on this node."""
        result, shared = self._flight.do(
            desc.digest, lambda: self._ingest_locked(desc, source, on_event, on_bytes, watch)
        )
        if shared:
            return IngestResult(desc.digest, desc.size, existed=True, shared=True)
        return result

    def _ingest_locked(
        self,
        desc: Descriptor,
        source: ReadableTarget,
        on_event: Callable[..., Any] | None,
        on_bytes: Callable[[int], None] | None,
        watch: IngestWatch | None,
    ) -> IngestResult:
        start = time.monotonic()
        if self.store.has(desc):
            return IngestResult(desc.digest, desc.size, existed=True)

        def waiting(holder: str) -> None:
            if on_event:
                on_event("cache.lock_wait", blob=str(desc.digest), holder=holder)

        held = acquire(self.store.lock_path(desc.digest), stale_after=self.stale_after, on_wait=waiting)
        try:
            if held.stale and on_event:
                on_event("cache.lock_stale", blob=str(desc.digest), lock=held.path)
            if self.store.has(desc):  # the holder we waited for committed it: one download per node
                return IngestResult(desc.digest, desc.size, existed=True, waited_s=held.waited_s)
            result = self._download(desc, source, held, on_event, on_bytes, watch)
            result.waited_s = held.waited_s
            result.lock_stale = held.stale
            result.seconds = time.monotonic() - start
            return result
        finally:
            held.release()

    def _download(
        self,
        desc: Descriptor,
        source: ReadableTarget,
        held: HeldLock,
        on_event: Callable[..., Any] | None,
        on_bytes: Callable[[int], None] | None,
        watch: IngestWatch | None,
    ) -> IngestResult:
        def fetched(n: int) -> None:
            if on_bytes:
                on_bytes(n)
            held.heartbeat()

        def resumed(offset: int) -> None:
            if on_event:
                on_event("cache.resume", blob=str(desc.digest), offset=offset, size=desc.size)

        def discarded(offset: int) -> None:
            if on_event:
                on_event("cache.resume_discarded", blob=str(desc.digest), offset=offset)

        got = fetch_verified(
            source,
            desc,
            IngestSlot(self.store, desc.digest, held),
            Landing(
                self.store.blob_path(desc.digest),
                mode=READ_ONLY_FILE_MODE,
                full_disk_hint=FULL_CACHE_HINT,
                name_partial=True,
            ),
            WriteHooks(
                on_bytes=fetched,
                on_resume=resumed,
                on_discard=discarded,
                on_verified=(lambda st: watch.verified(desc, st)) if watch is not None else None,
                writeback=watch is None or watch.writeback,
            ),
        )
        return IngestResult(desc.digest, desc.size, downloaded=got.fetched, resumed_from=got.resumed)

    def ingest_all(
        self,
        missing: list[Descriptor],
        source: ReadableTarget,
        *,
        jobs: int,
        manifest_digest: str,
        ev: Callable[..., None],
        on_bytes: Callable[[int], None],
        watch: IngestWatch | None = None,
    ) -> list[IngestResult]:
        """Ingest a manifest's missing blobs with up to ``jobs`` threads; the first failure cancels
        the rest and is raised. ``on_bytes`` (bytes fetched) keeps the caller's manifest lock fresh
        and its progress bar moving."""

        def on_event(name: str, **fields: Any) -> None:
            ev(name, digest=manifest_digest, **fields)

        def one(b: Descriptor) -> IngestResult:
            tb = time.monotonic()
            try:
                r = self.ingest(b, source, on_event=on_event, on_bytes=on_bytes, watch=watch)
            except (DigestMismatchError, SizeMismatchError) as exc:
                ev(
                    "cache.verify_failed",
                    digest=manifest_digest,
                    blob=str(b.digest),
                    bytes=b.size,
                    reason=str(exc),
                    source=source.name,
                )
                raise
            if r.downloaded or r.resumed_from:
                ev(
                    "cache.download",
                    digest=manifest_digest,
                    blob=str(b.digest),
                    bytes=r.downloaded,
                    resumed_from=r.resumed_from or None,
                    size=b.size,
                    duration_ms=to_ms(time.monotonic() - tb),
                    waited_ms=to_ms(r.waited_s) if r.waited_s else None,
                )
            return r

        if not missing:
            return []
        with ThreadPoolExecutor(
            max_workers=max(1, min(jobs, len(missing))), thread_name_prefix="mp-cache"
        ) as pool:
            futures = [pool.submit(one, b) for b in missing]
            done, _ = wait(futures, return_when=FIRST_EXCEPTION)
            for f in futures:
                if f in done and f.exception() is not None:
                    for other in futures:
                        other.cancel()
                    raise f.exception()  # type: ignore[misc]
            return [f.result() for f in futures]


def check_space(
    cache_root: str,
    needed: int,
    *,
    max_cache_bytes: int | None,
    reserve_bytes: int,
    usage: Callable[[], int],
    ev: Callable[..., None],
    digest: str,
) -> None:
    """Refuse a pull before it downloads anything: over the cache quota, or into the disk reserve."""
    if max_cache_bytes is not None:
        used = usage()
        if used + needed > max_cache_bytes:
            ev(
                "cache.refused",
                digest=digest,
                reason="quota",
                bytes=needed,
                used=used,
                quota=max_cache_bytes,
            )
            raise QuotaExceededError(cache_root, needed, used, max_cache_bytes)
    st = os.statvfs(cache_root)
    available = st.f_bavail * st.f_frsize
    if needed + reserve_bytes > available:
        ev(
            "cache.refused",
            digest=digest,
            reason="disk_full",
            bytes=needed,
            available=available,
            reserve=reserve_bytes,
        )
        raise InsufficientSpaceError(cache_root, needed, available, reserve_bytes)


class IngestSlot:
    """The node cache's ``PartialSlot``: ``ingest/<hex>.partial``, guarded by the digest lock the
    caller holds. Something at that name that is not the cache's private file (a symlink, another
    uid's, a hard link) is never written into: it is replaced. A lock taken over from a stale
    holder (``held.exclusive`` false) writes to a private temp file, which is not resumable (its
    writer holds a lock on it, so GC keeps it while it is written)."""

    def __init__(self, store: Store, digest: Digest, held: HeldLock) -> None:
        self.store = store
        self.digest = digest
        self.held = held

    def open(self) -> Partial:
        if not self.held.exclusive:
            return LockedTemp(self.store.ingest_dir, self.digest).open()
        path = self.store.partial_path(self.digest)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                raise write_error(path, exc) from exc
            fd = -1
        if fd >= 0 and private_file(os.fstat(fd)):
            return Partial(fd, path, resumable=True)
        if fd >= 0:
            os.close(fd)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise write_error(path, exc) from exc
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise write_error(path, exc) from exc
        return Partial(fd, path, resumable=True)
