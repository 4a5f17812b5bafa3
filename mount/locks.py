"""Locks for the node cache: in-process single-flight, fcntl file locks, and bounded waits for both.

Why both: threads of one process share one download through ``SingleFlight`` without polling,
and processes on the node serialise on ``flock`` so a blob is fetched once. ``flock`` locks die
with their holder (a ``kill -9`` releases them), but a holder that hangs (stopped, stuck on a
dead NFS server) would block everyone; the holder therefore refreshes the lock file's mtime as a
heartbeat, and a waiter that sees no heartbeat for ``stale_after`` seconds stops waiting and
proceeds without the lock. That is safe because correctness never rests on the lock: every
writer ingests into its own temp file, verifies, and publishes with an atomic rename of
identical content.

No wait is unbounded. Download locks (blobs, manifests) wait only while their holder's heartbeat
changes: a waiter watches the lock file's mtime on its own monotonic clock, so a holder that
stops beating is skipped after ``stale_after`` seconds even when its last heartbeat lies in the
future (the wall clock stepped back) — a wall-clock jump either way cannot stretch a wait. The GC
gate, ``index.json``'s lock and reader leases wait at most ``lock_timeout`` seconds
(``$MODELPACK_LOCK_TIMEOUT``, default 120) and then fail with ``LockTimeoutError`` naming the
lock file and whoever holds it (from ``/proc/locks``: pid, uid and command, which works even for
a holder that wrote nothing into the file). Lock files are ``0600`` in a ``0700`` directory, so
another uid cannot open them, let alone hold them.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Generic, TypeVar

from modelpack.mount.modes import open_private

from modelpack import settings
from modelpack.boundedjson import loads_object
from modelpack.errors import DocumentError, LockTimeoutError

T = TypeVar("T")

DEFAULT_STALE_AFTER_S = 60.0
DEFAULT_LOCK_TIMEOUT_S = 120.0
HEARTBEAT_EVERY_S = 1.0
_POLL_S = 0.02
_MAX_POLL_S = 0.2


def default_lock_timeout() -> float:
    """``$MODELPACK_LOCK_TIMEOUT`` seconds when it is a positive number, else 120."""
    return settings.LOCK_TIMEOUT.get() or DEFAULT_LOCK_TIMEOUT_S


class SingleFlight(Generic[T]):
    """Run ``fn`` once per key at a time; concurrent callers in this process share its outcome."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._inflight: dict[str, Future[T]] = {}

    def do(self, key: str, fn: Callable[[], T]) -> tuple[T, bool]:
        """Returns (result, shared): ``shared`` is True when another thread did the work."""
        with self._lock:
            fut = self._inflight.get(key)
            owner = fut is None
            if fut is None:
                fut = Future()
                self._inflight[key] = fut
        if not owner:
            return fut.result(), True
        try:
            result = fn()
        except BaseException as exc:
            fut.set_exception(exc)
            raise
        else:
            fut.set_result(result)
            return result, False
        finally:
            with self._lock:
                self._inflight.pop(key, None)


@dataclass
class HeldLock:
    """A taken file lock. ``exclusive`` is False when the lock was judged stale and skipped."""

    path: str
    fd: int | None
    waited_s: float
    stale: bool = False
    _last_beat: float = 0.0

    @property
    def exclusive(self) -> bool:
        return self.fd is not None

    def heartbeat(self, force: bool = False) -> None:
        """Refresh the lock file mtime so waiters can tell a live holder from a hung one."""
        if self.fd is None:
            return
        now = time.monotonic()
        if force or now - self._last_beat >= HEARTBEAT_EVERY_S:
            self._last_beat = now
            with contextlib.suppress(OSError):
                os.utime(self.fd)

    def release(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


def _flock_entries(path: str) -> list[tuple[str, str]]:
    """``(pid, READ|WRITE)`` of every flock on ``path`` in ``/proc/locks``; a pid is ``0`` when the
    holder lives in a pid namespace this process cannot see."""
    try:
        st = os.stat(path)
        with open("/proc/locks", encoding="ascii", errors="replace") as f:
            lines = f.read(4 * 1024 * 1024).splitlines()
    except OSError:
        return []
    want = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    out = []
    for line in lines:
        parts = line.split()
        if "->" in parts or len(parts) < 6 or parts[1] != "FLOCK" or parts[5] != want:
            continue
        out.append((parts[4], parts[3]))
    return out


def lock_holders(path: str) -> list[str]:
    """Who holds a flock on ``path`` now, from ``/proc/locks``: ``pid N (uid U, comm) [kind]``.

    Empty when unknown (no procfs, the file is gone, or the holder lives in another pid namespace).
    """
    out = []
    for pid, kind in _flock_entries(path):
        who = f"pid {pid}"
        with contextlib.suppress(OSError, ValueError):
            uid = os.stat(f"/proc/{pid}").st_uid
            with open(f"/proc/{pid}/comm", encoding="utf-8", errors="replace") as c:
                comm = c.read(64).strip()
            who += f" (uid {uid}, {comm})"
        out.append(f"{who} [{'exclusive' if kind == 'WRITE' else 'shared'}]")
    return out


def lock_holder_uids(path: str) -> list[int | None]:
    """The user behind each process holding a flock on ``path`` (None where it cannot be told: a
    holder in another pid namespace, or one that exited and left the lock to a child).

    Read from ``/proc/<pid>/status`` (not the owner of ``/proc/<pid>``): the real uid unless it is
    root, then the effective one — so a setuid-root program another user started while holding
    the lock (an inherited fd) still counts as that user, and so does a root process running as
    someone else."""
    uids: list[int | None] = []
    for pid, _kind in _flock_entries(path):
        uids.append(_process_user(pid))
    return uids


def _process_user(pid: str) -> int | None:
    try:
        if int(pid) <= 0:
            return None
        with open(f"/proc/{int(pid)}/status", encoding="ascii", errors="replace") as f:
            for line in f.read(64 * 1024).splitlines():
                if line.startswith("Uid:"):
                    real, effective = (int(x) for x in line.split()[1:3])
                    return real if real != 0 else effective
    except (OSError, ValueError):
        return None
    return None


def _holder_info(path: str) -> str:
    """The holder as ``/proc/locks`` knows it, else as it described itself in the lock file."""
    holders = lock_holders(path)
    if holders:
        return ", ".join(holders)
    try:
        with open(path, "rb") as f:
            doc = loads_object(f.read(4096) or b"{}", what=path, max_bytes=4096)
        return f"pid {doc.get('pid')} on {doc.get('host')}"
    except (OSError, DocumentError):
        return "an unknown holder"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _HeartbeatWatch:
    """Tells a hung lock holder from a live one by watching its heartbeat (the lock file's mtime)
    on this process's monotonic clock, so no wall-clock step can stretch a wait.

    Stale when the mtime is more than ``stale_after`` seconds in the past (a holder that hung
    before we came), or when it has not changed for ``stale_after`` monotonic seconds while we
    watched — which also covers an mtime in the future (the clock stepped back after the last
    heartbeat), where the wall-clock age is negative and would otherwise never grow."""

    def __init__(self) -> None:
        self.mtime: float | None = None
        self.changed_at = time.monotonic()

    def stale(self, fd: int, stale_after: float) -> bool:
        try:
            mtime = os.fstat(fd).st_mtime
        except OSError:
            return False
        now = time.monotonic()
        if mtime != self.mtime:
            self.mtime, self.changed_at = mtime, now
        age = time.time() - mtime
        return age > stale_after or now - self.changed_at > stale_after


def acquire(
    path: str,
    *,
    stale_after: float = DEFAULT_STALE_AFTER_S,
    timeout: float | None = None,
    on_wait: Callable[[str], None] | None = None,
) -> HeldLock:
    """Take an exclusive ``flock`` on ``path`` (created if missing).

    Waits while the holder's heartbeat is fresh (``_HeartbeatWatch``: older than ``stale_after``,
    or unchanged for ``stale_after`` seconds of our monotonic clock, is stale — a future mtime
    included), so even without ``timeout`` the wait ends once the holder stops making progress.
    Returns a non-exclusive ``HeldLock`` (``stale`` set) then: the caller must work without
    sharing state with the holder. Raises ``LockTimeoutError`` after ``timeout`` seconds.
    """
    os.makedirs(os.path.dirname(path), exist_ok=True)
    start = time.monotonic()
    owner = os.stat(os.path.dirname(path)).st_uid
    fd = open_private(path, os.O_RDWR, owner)
    announced = False
    heartbeat = _HeartbeatWatch()
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise
            else:
                # The file may have been unlinked and recreated by someone else between our
                # open() and flock(): a lock on an orphaned inode protects nothing. Retry.
                try:
                    same = os.fstat(fd).st_ino == os.stat(path).st_ino
                except FileNotFoundError:
                    same = False
                if not same:
                    os.close(fd)
                    fd = open_private(path, os.O_RDWR, owner)
                    continue
                info = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()})
                os.ftruncate(fd, 0)
                try:
                    os.pwrite(fd, info.encode(), 0)
                except OSError as exc:
                    # who holds it is for a waiter's message; the flock is the lock. On a full
                    # disk the work itself reports the typed error, naming its own file.
                    if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                        raise
                held = HeldLock(path, fd, time.monotonic() - start)
                held.heartbeat(force=True)
                return held
            if not announced and on_wait is not None:
                announced = True
                on_wait(_holder_info(path))
            if heartbeat.stale(fd, stale_after):
                os.close(fd)
                fd = -1
                return HeldLock(path, None, time.monotonic() - start, stale=True)
            if timeout is not None and time.monotonic() - start > timeout:
                raise LockTimeoutError(f"{path}: still held by {_holder_info(path)} after {timeout:g}s")
            time.sleep(_POLL_S)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        raise


def is_locked(path: str) -> bool:
    """Whether some open file description holds any flock on ``path`` right now."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return True
        raise
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def flock_bounded(fd: int, operation: int, path: str, timeout: float, what: str) -> None:
    """``flock(fd, operation)``, polling for at most ``timeout`` seconds (``0``: one try); then
    ``LockTimeoutError`` naming ``path``, ``what`` it guards and who holds it."""
    deadline = time.monotonic() + timeout
    pause = _POLL_S
    while True:
        try:
            fcntl.flock(fd, operation | fcntl.LOCK_NB)
            return
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
        now = time.monotonic()
        if now >= deadline:
            raise LockTimeoutError(
                f"{path} ({what}): held by {_holder_info(path)}; gave up after {timeout:g}s "
                f"(set ${settings.LOCK_TIMEOUT.name} to wait longer for a holder that is legitimately busy)"
            )
        time.sleep(min(pause, deadline - now))
        pause = min(pause * 2, _MAX_POLL_S)


@contextlib.contextmanager
def _bounded_flock(path: str, operation: int, timeout: float | None, what: str) -> Iterator[int]:
    fd = open_private(path, os.O_RDWR, os.stat(os.path.dirname(path)).st_uid)
    try:
        flock_bounded(fd, operation, path, default_lock_timeout() if timeout is None else timeout, what)
        yield fd
    finally:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def shared_lock(
    path: str, *, timeout: float | None = None, what: str = "lock"
) -> contextlib.AbstractContextManager[int]:
    """A shared flock (a pull registering at the GC gate), waiting at most ``timeout`` seconds
    (default ``$MODELPACK_LOCK_TIMEOUT``); yields the fd."""
    return _bounded_flock(path, fcntl.LOCK_SH, timeout, what)


def exclusive_lock(
    path: str, *, timeout: float | None = None, what: str = "lock"
) -> contextlib.AbstractContextManager[int]:
    """An exclusive flock without heartbeat (short critical sections), waiting at most ``timeout``
    seconds; ``timeout=0`` tries once (GC skips what it cannot lock)."""
    return _bounded_flock(path, fcntl.LOCK_EX, timeout, what)


def try_exclusive(path: str) -> int | None:
    """Non-blocking exclusive flock; returns the fd (caller closes) or None if held elsewhere.

    Opens read-only: a flock needs no write access, and a reader lease of another uid stays usable.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return None
        raise
    return fd
