"""Ingest blobs into the store: one verified, resumable download per digest on this node.

A blob is written to ``ingest/<hex>.partial`` (same filesystem as the store) under its digest
lock (``locks/<hex>.lock``), checked for size and sha256, fsynced and committed by the store
(read-only, renamed, directory fsynced). A partial download is resumed by re-hashing the bytes
already on disk (the hash state cannot be saved, and disk content after a crash is not to be
trusted blindly), then asking the source for the rest with a Range request. A resumed blob that
fails the final check is thrown away and fetched once more from zero. A lock taken over from a
stale holder writes to a private temp file, since that holder may still be writing the partial.

Before any download a pull is admitted against the cache quota and the free disk space.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
import time
import uuid
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from modelpack.mount.locks import HeldLock, SingleFlight, acquire
from modelpack.mount.reports import to_ms
from modelpack.mount.store import Store

from modelpack.errors import (
    DigestMismatchError,
    InsufficientSpaceError,
    QuotaExceededError,
    SizeMismatchError,
)
from modelpack.files import TEMP_PREFIX, write_error
from modelpack.oci.descriptor import Descriptor
from modelpack.oci.digest import HASH_CHUNK, Digest
from modelpack.targets.base import ReadableTarget

# Network reads block until this many bytes arrived: small enough that a partial file grows
# steadily (what a resume can reuse after a crash), large enough to keep per-call overhead low.
INGEST_CHUNK = 256 * 1024


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
    ) -> IngestResult:
        """Make ``desc`` present and verified; at most one fetch per digest on this node."""
        result, shared = self._flight.do(
            desc.digest, lambda: self._ingest_locked(desc, source, on_event, on_bytes)
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
            if self.store.has(desc):  # the holder we waited for committed it
                return IngestResult(desc.digest, desc.size, existed=True, waited_s=held.waited_s)
            if held.exclusive:
                partial = self.store.partial_path(desc.digest)
            else:
                # Stale holder may still be writing the shared partial: use a private file.
                partial = os.path.join(
                    self.store.ingest_dir,
                    f"{TEMP_PREFIX}{desc.digest.hex[:16]}-{os.getpid()}-{uuid.uuid4().hex[:8]}",
                )
            result = self._download(desc, source, partial, held, on_event, on_bytes)
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
        partial: str,
        held: HeldLock,
        on_event: Callable[..., Any] | None,
        on_bytes: Callable[[int], None] | None,
    ) -> IngestResult:
        result = IngestResult(desc.digest, desc.size)
        for attempt in (0, 1):
            h = hashlib.sha256()
            offset = _rehash_prefix(partial, desc, h) if attempt == 0 else 0
            if attempt == 1 or offset == 0:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(partial)
            if offset:
                result.resumed_from = offset
                if on_event:
                    on_event("cache.resume", blob=str(desc.digest), offset=offset, size=desc.size)
            fd = os.open(
                partial, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
            )
            try:
                n = offset
                extra = 0  # a complete partial (killed before its rename) needs no fetch at all
                if n < desc.size:
                    with source.fetch_blob(desc, n) as stream:
                        buf = bytearray(INGEST_CHUNK)
                        view = memoryview(buf)
                        while n < desc.size:
                            want = min(len(buf), desc.size - n)
                            got = _readinto(stream, view[:want])
                            if not got:
                                break
                            try:
                                _write_all(fd, view[:got])
                            except OSError as exc:  # a full disk: the partial stays for a resume
                                raise write_error(
                                    partial,
                                    exc,
                                    kept=f"the {n} bytes of {desc.digest} written so far stay there "
                                    "for the next pull to resume; free space or run 'modelpack cache gc'",
                                ) from exc
                            h.update(view[:got])
                            n += got
                            result.downloaded += got
                            if on_bytes:
                                on_bytes(got)
                            held.heartbeat()
                        # one byte past the declared size means the source lies about the size
                        extra = _readinto(stream, memoryview(bytearray(1))) if n == desc.size else 0
                if n != desc.size or extra:
                    os.close(fd)
                    fd = -1
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(partial)
                    actual = n + 1 if extra else n
                    raise SizeMismatchError(desc.digest, desc.size, actual, source=source.name)
                actual_digest = "sha256:" + h.hexdigest()
                if actual_digest != desc.digest:
                    os.close(fd)
                    fd = -1
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(partial)
                    if offset and attempt == 0:
                        # The reused prefix may be what is wrong (torn write, disk error): retry once clean.
                        if on_event:
                            on_event("cache.resume_discarded", blob=str(desc.digest), offset=offset)
                        result.resumed_from = 0
                        continue
                    raise DigestMismatchError(desc.digest, actual_digest, source=source.name)
                os.fsync(fd)
            finally:
                if fd >= 0:
                    os.close(fd)
            self.store.commit(partial, desc.digest)
            return result
        raise AssertionError("unreachable")  # pragma: no cover

    def ingest_all(
        self,
        missing: list[Descriptor],
        source: ReadableTarget,
        *,
        jobs: int,
        manifest_digest: str,
        ev: Callable[..., None],
        on_bytes: Callable[[int], None],
    ) -> list[IngestResult]:
        """Ingest a manifest's missing blobs with up to ``jobs`` threads; the first failure cancels
        the rest and is raised. ``on_bytes`` (bytes fetched) keeps the caller's manifest lock fresh
        and its progress bar moving."""

        def on_event(name: str, **fields: Any) -> None:
            ev(name, digest=manifest_digest, **fields)

        def one(b: Descriptor) -> IngestResult:
            tb = time.monotonic()
            try:
                r = self.ingest(b, source, on_event=on_event, on_bytes=on_bytes)
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


def _rehash_prefix(partial: str, desc: Descriptor, h: Any) -> int:
    """Feed an existing partial file into ``h``; returns its length (0 = start over).

    Only a regular file of this process's uid with a single link is resumed: anything else in
    ``ingest/`` (a symlink to a file we must never append to, another uid's file) is started over.
    """
    try:
        st = os.lstat(partial)
    except FileNotFoundError:
        return 0
    size = st.st_size
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_nlink != 1:
        return 0
    if size == 0 or size > desc.size:
        return 0
    fd = os.open(partial, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with open(fd, "rb", buffering=0) as f:
        buf = bytearray(HASH_CHUNK)
        view = memoryview(buf)
        n = 0
        while n < size:
            got = f.readinto(view[: min(len(buf), size - n)])
            if not got:
                break
            h.update(view[:got])
            n += got
    return n


def _readinto(stream: Any, view: memoryview) -> int:
    readinto = getattr(stream, "readinto", None)
    if readinto is not None:
        n = readinto(view)
        return int(n or 0)
    data = stream.read(len(view))
    view[: len(data)] = data
    return len(data)


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        n = os.write(fd, data)
        data = data[n:]
