"""Reading the node cache's ingest while the cache's own pull fills it (``loader.stream_through``).

``CacheFill`` runs the pull on a thread of its own and hears, as the cache's ``IngestWatch``,
each write that lands in a partial and each blob whose bytes matched their digest (before the
fsync and rename). ``CacheFollowReader`` reads one blob's ranges as they land: from the committed
blob once it is there, else from the growing ``ingest/<hex>.partial`` (this process's or a
concurrent ``pull --cache``'s). It trusts nothing it reads by itself: the load either checks every
byte (chunks, layer digest) or calls ``settle`` before a tensor leaves (``loader.settled``), which
takes the cache's verdict for the very file the bytes came from.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from modelpack.loader.readers import _Counter

from modelpack.errors import (
    CacheFillStalledError,
    HeaderMismatchError,
    SourceError,
    TruncatedSourceError,
)
from modelpack.oci.descriptor import Descriptor
from modelpack.oci.digest import Digest

if TYPE_CHECKING:
    from modelpack.mount.cache import PullResult
    from modelpack.mount.store import Store

_T = TypeVar("_T")

#: a reader waits at most this long for a blob's bytes while nothing moves (no byte lands in its
#: partial, no blob is committed) before it gives up (``CacheFillStalledError``)
DEFAULT_STALL_S = 180.0
#: first and longest pause between two looks at a partial another process writes (this process's
#: own fill wakes its readers as its bytes land)
_POLL_S = (0.005, 0.05)


@dataclass
class StreamReport:
    """What the stream did to the node cache (``LoadStats``' neighbour; the CLI's ``--json``
    ``cache`` object)."""

    root: str
    state: str = ""  # hit | filled | share | failed | publishing (publish="background", not yet)
    published: bool = False
    path: str = ""  # the snapshot, once published
    left_to: str = ""  # a share: "fill" (left to a pull --cache / pre-warm) or "background"
    bytes_downloaded: int = 0  # blob bytes this process's fill fetched from the registry
    bytes_reused: int = 0  # blob bytes already in the cache (or fetched by a concurrent pull)
    error: str = ""
    wait_s: float = 0.0  # seconds the load waited for the fill to publish after its last tensor
    # bytes the load read from a partial the cache then threw away (a writer that started over),
    # read again from the verified blob before any tensor of it was handed out
    bytes_reread: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "root": self.root,
            "state": self.state,
            "published": self.published,
            "path": self.path or None,
            "leftTo": self.left_to or None,
            "bytesDownloaded": self.bytes_downloaded,
            "bytesReused": self.bytes_reused,
            "error": self.error or None,
            "publishWaitMs": round(self.wait_s * 1000, 3),
            "bytesReread": self.bytes_reread,
        }


class CacheFill:
    """A node cache's pull on a background thread (``pull(watch)``: ``NodeCache.pull`` with this
    fill as its ``IngestWatch``): its outcome, recorded into ``report``, and ways to wait for it."""

    def __init__(
        self, pull: Callable[[CacheFill], PullResult], report: StreamReport, *, writeback: bool
    ) -> None:
        self.result: PullResult | None = None
        self.error: BaseException | None = None
        self.done = threading.Event()
        # bumped whenever this process's pull lands bytes, verifies a blob (or ends): readers wait
        # on it instead of spinning; another process's writes are seen by the readers' bounded poll
        self.seq = 0
        # hex digest → (st_dev, st_ino) of the file whose bytes this pull verified (the committed
        # blob keeps that inode): the loader's reads of that file need no hash of their own
        self.verified_files: dict[str, tuple[int, int]] = {}
        # mount.ingest.IngestWatch: with the publish awaited, the disk writes start as the bytes
        # land; in the background, the landing is not held to the disk's pace
        self.writeback = writeback
        self._report = report
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, args=(pull,), name="mp-stream-fill", daemon=True)
        self._thread.start()

    def _run(self, pull: Callable[[CacheFill], PullResult]) -> None:
        try:
            self.result = pull(self)
        except BaseException as exc:  # handed to the readers and the report
            self.error = exc
        finally:
            with self._cond:
                self._record()
                self.done.set()
                self.seq += 1
                self._cond.notify_all()

    def _record(self) -> None:
        """The fill's outcome into the stream's report (before ``done``: a waiter sees it whole)."""
        report = self._report
        if self.result is not None:
            report.state = "filled"
            report.published = True
            report.path = self.result.path
            report.bytes_downloaded = self.result.bytes_downloaded
            report.bytes_reused = self.result.bytes_reused
            return
        report.state = "failed"
        report.error = (
            f"{type(self.error).__name__}: {self.error}" if self.error else "the fill did not finish"
        )

    def publishing(self) -> None:
        """The load returned before the fill ended (``publish="background"``): say so, unless the
        fill already recorded its outcome."""
        with self._cond:
            if not self.done.is_set():
                self._report.state = "publishing"

    # mount.ingest.IngestWatch
    def landed(self, n: int) -> None:
        with self._cond:
            self.seq += 1
            self._cond.notify_all()

    def verified(self, desc: Descriptor, st: os.stat_result) -> None:
        with self._cond:
            self.verified_files[Digest(desc.digest).hex] = (st.st_dev, st.st_ino)
            self.seq += 1
            self._cond.notify_all()

    def reread(self, n: int) -> None:
        if n:
            with self._cond:
                self._report.bytes_reread += n

    def wait_landed(self, seen: int, timeout: float) -> None:
        """Until something lands after ``seen`` (``self.seq`` then), the pull ends, or ``timeout``."""
        with self._cond:
            self._cond.wait_for(lambda: self.seq != seen, timeout)

    def raise_if_failed(self) -> None:
        if self.error is not None:
            raise self.error

    def wait(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)


class CacheFollowReader:
    """A blob read by ranges from the node cache's ingest while it is being filled: the committed
    blob once it is there, else the growing ``ingest/<hex>.partial``; a range not landed yet is
    waited for (the fill's failure is raised; no progress for ``stall_s`` is
    ``CacheFillStalledError``). Nothing read here is trusted by itself: either the loader checks
    every byte (chunks, layer digest), or the load calls ``settle`` before handing a tensor out.

    Every partial this reader read from stays open until ``close``, so its inode cannot be reused
    while ``settle`` compares it with the file the cache verified."""

    local = True

    def __init__(
        self,
        store: Store,
        desc: Descriptor,
        fill: CacheFill,
        *,
        name: str,
        stall_s: float,
        leftover: tuple[int, int] | None = None,
    ) -> None:
        self.store = store
        self.descriptor = desc
        self.size = desc.size
        self.name = name
        self._hex = Digest(desc.digest).hex
        self._fill = fill
        self._stall_s = stall_s
        # (inode, bytes) of the partial that was there before this fill started: a crash's
        # leftover, verified only when its blob is committed, so its first bytes are never read
        # from it (the bytes a live writer appends after them come from the source)
        self._leftover = leftover
        self._fd = -1
        self._lock = threading.Lock()
        self._count = _Counter()
        self._held: dict[tuple[int, int], int] = {}  # (st_dev, st_ino) → fd of a partial read from
        # with ``keep_reads``: (partial file, offset, views) of every read taken from a partial
        self._kept: list[tuple[tuple[int, int], int, Sequence[memoryview]]] | None = None

    @property
    def bytes_read(self) -> int:
        return self._count.value

    @property
    def reads(self) -> list[tuple[int, int, int]]:
        return self._count.reads

    def _committed(self) -> int:
        with self._lock:
            if self._fd >= 0:
                return self._fd
            if not self.store.has(self.descriptor):
                return -1
            try:
                fd = os.open(
                    self.store.blob_path(self.descriptor.digest), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
                )
            except OSError:
                return -1
            self._fd = fd
            return fd

    def _partial(self, offset: int, end: int) -> tuple[int, int, tuple[int, int]]:
        """A partial holding ``[offset, end)`` as its writer fetched it (a held fd, -1 otherwise),
        its size and its file. Of a leftover partial (there before the fill), the bytes it held then
        are not read until the writer started it over (it shrank): a resumed prefix is only
        re-hashed at the commit."""
        try:
            fd = os.open(
                self.store.partial_path(self.descriptor.digest), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
            )
        except OSError:
            return -1, -1, (0, 0)
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino)
        fresh_from = 0
        if self._leftover is not None and self._leftover[0] == st.st_ino:
            if st.st_size < self._leftover[1]:  # started over from zero: all it holds now is fetched
                self._leftover = None
            else:
                fresh_from = self._leftover[1]
        if offset >= fresh_from and st.st_size >= end and self.store.trusted(st):
            with self._lock:
                held = self._held.setdefault(key, fd)
            if held != fd:
                os.close(fd)
            return held, st.st_size, key
        os.close(fd)
        return -1, st.st_size, key

    def read_into(self, offset: int, buf: memoryview) -> None:
        self.read_scatter(offset, [buf])

    def read_scatter(self, offset: int, views: Sequence[memoryview]) -> None:
        want = sum(len(v) for v in views)
        if offset + want > self.size:
            raise TruncatedSourceError(self.name, offset, want, max(0, self.size - offset))
        end = offset + want

        def attempt() -> tuple[bool | None, int]:
            fd = self._committed()
            if fd >= 0 and _preadv_all(fd, views, offset):
                return True, 0
            pfd, have, key = self._partial(offset, end)
            if pfd >= 0 and _preadv_all(pfd, views, offset):
                with self._lock:
                    if self._kept is not None:
                        self._kept.append((key, offset, views))
                return True, 0
            return None, have  # not landed yet (or truncated under us): this blob's progress

        self._wait(attempt, "landed")
        self._count.add(want, offset)

    # ------------------------------------------------------------------ settling (no hash of our own)
    def keep_reads(self) -> None:
        """From now on remember where each read from a partial went, for ``settle``."""
        with self._lock:
            self._kept = []

    def settle(self, header: bytes) -> int:
        """Vouch for every byte this reader returned since ``keep_reads``, with the node cache's
        own whole-blob check instead of a hash here: wait until the cache verified the blob (size
        and sha256, told by the fill before its fsync, or a blob some writer committed), read
        again from the verified file whatever came from another partial (one the cache threw
        away: a failed resume, a writer that started over), and compare ``header`` (the bytes the
        plan was parsed from) with the verified file's. Returns the bytes read again."""
        verified = self._wait(lambda: (self._verified_file(), self._fill.seq), "verified")
        with self._lock:
            kept, self._kept = self._kept or [], None
            fd = self._held.get(verified, -1)
        stale = [(off, views) for key, off, views in kept if key != verified]
        if fd < 0 and (stale or header):  # nothing read from the verified partial: the blob then
            fd = self._wait(
                lambda: (fd if (fd := self._committed()) >= 0 else None, self._fill.seq), "committed"
            )
        n = 0
        for off, views in stale:
            if not _preadv_all(fd, views, off):
                raise TruncatedSourceError(self.name, off, sum(len(v) for v in views), 0)
            n += sum(len(v) for v in views)
        if header and os.pread(fd, len(header), 0) != header:
            raise HeaderMismatchError(self.name, str(self.descriptor.digest), source=self.store.root)
        self._fill.reread(n)
        return n

    def _verified_file(self) -> tuple[int, int] | None:
        """The file (st_dev, st_ino) whose bytes the cache verified: this process's fill says so
        before its fsync; another writer's blob counts once committed. None: not yet."""
        key = self._fill.verified_files.get(self._hex)
        if key is not None:
            return key
        fd = self._committed()
        if fd < 0:
            return None
        st = os.fstat(fd)
        return (st.st_dev, st.st_ino)

    def _wait(self, look: Callable[[], tuple[_T | None, int]], what: str) -> _T:
        """``look()`` until its first item is something; its second says how far the blob got
        (a partial's size, the fill's counter): the fill's failure is raised, and a fill that
        ended without it, or with no progress for ``stall_s``, refuses the load."""
        moved = time.monotonic()
        pause = _POLL_S[0]
        last = -1
        while True:
            seq = self._fill.seq
            got, progress = look()
            if got is not None:
                return got
            if self._fill.done.is_set():
                self._fill.raise_if_failed()
                got, _ = look()
                if got is not None:
                    return got
                raise SourceError(
                    f"{self.name}: the node cache fill of {self.store.root} ended without a "
                    f"{what} blob {self.descriptor.digest}; refusing the load"
                )
            now = time.monotonic()
            if progress != last:
                last, moved = progress, now
            elif now - moved > self._stall_s:
                raise CacheFillStalledError(
                    f"{self.name}: blob {self.descriptor.digest} was not {what} in the node cache "
                    f"{self.store.root} within {self._stall_s:.0f}s of its last progress (the fill "
                    "holding its lock made none); refusing the load"
                )
            self._fill.wait_landed(seq, pause)
            pause = min(pause * 2, _POLL_S[1])

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
            for fd in self._held.values():
                os.close(fd)
            self._held.clear()
            self._kept = None


def partials_now(store: Store) -> dict[str, tuple[int, int]]:
    """hex digest → (inode, size) of every resumable partial in the store's ``ingest/`` now."""
    from modelpack.mount.store import PARTIAL_SUFFIX

    out: dict[str, tuple[int, int]] = {}
    try:
        entries = list(os.scandir(store.ingest_dir))
    except OSError:
        return out
    for e in entries:
        if e.name.endswith(PARTIAL_SUFFIX):
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            out[e.name[: -len(PARTIAL_SUFFIX)]] = (st.st_ino, st.st_size)
    return out


def _preadv_all(fd: int, views: Sequence[memoryview], offset: int) -> bool:
    """Fill ``views`` from ``fd`` at ``offset``; False when the file ends first."""
    pos = offset
    for v in views:
        got = 0
        while got < len(v):
            n = os.preadv(fd, [v[got:]], pos + got)
            if n <= 0:
                return False
            got += n
        pos += len(v)
    return True


__all__ = ["DEFAULT_STALL_S", "CacheFill", "CacheFollowReader", "StreamReport", "partials_now"]
