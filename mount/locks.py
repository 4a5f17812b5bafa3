"""Locks for the node cache: in-process single-flight plus an fcntl file lock per digest.

Why both: threads of one process share one download through ``SingleFlight`` without polling,
and processes on the node serialise on ``flock`` so a blob is fetched once. ``flock`` locks die
with their holder (a ``kill -9`` releases them), but a holder that hangs (stopped, stuck on a
dead NFS server) would block everyone; the holder therefore refreshes the lock file's mtime as a
heartbeat, and a waiter that sees no heartbeat for ``stale_after`` seconds stops waiting and
proceeds without the lock. That is safe because correctness never rests on the lock: every
writer ingests into its own temp file, verifies, and publishes with an atomic rename of
identical content.
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

from modelpack.errors import LockTimeoutError

T = TypeVar("T")

DEFAULT_STALE_AFTER_S = 60.0
HEARTBEAT_EVERY_S = 1.0
_POLL_S = 0.02


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


def _holder_info(path: str) -> str:
    try:
        with open(path, "rb") as f:
            doc = json.loads(f.read(4096) or b"{}")
        return f"pid {doc.get('pid')} on {doc.get('host')}"
    except (OSError, ValueError):
        return "an unknown holder"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def acquire(
    path: str,
    *,
    stale_after: float = DEFAULT_STALE_AFTER_S,
    timeout: float | None = None,
    on_wait: Callable[[str], None] | None = None,
) -> HeldLock:
    """Take an exclusive ``flock`` on ``path`` (created if missing).

    Waits while the holder's heartbeat is fresh. Returns a non-exclusive ``HeldLock`` (``stale``
    set) once the heartbeat is older than ``stale_after``: the caller must then work without
    sharing state with the holder. Raises ``LockTimeoutError`` after ``timeout`` seconds.
    """
    os.makedirs(os.path.dirname(path), exist_ok=True)
    start = time.monotonic()
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    announced = False
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
                    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
                    continue
                info = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()})
                os.ftruncate(fd, 0)
                os.pwrite(fd, info.encode(), 0)
                held = HeldLock(path, fd, time.monotonic() - start)
                held.heartbeat(force=True)
                return held
            if not announced and on_wait is not None:
                announced = True
                on_wait(_holder_info(path))
            try:
                age = time.time() - os.fstat(fd).st_mtime
            except OSError:
                age = 0.0
            if age > stale_after:
                os.close(fd)
                fd = -1
                return HeldLock(path, None, time.monotonic() - start, stale=True)
            if timeout is not None and time.monotonic() - start > timeout:
                raise LockTimeoutError(f"{path}: still held by {_holder_info(path)} after {timeout:.0f}s")
            time.sleep(_POLL_S)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        raise


@contextlib.contextmanager
def file_lock(
    path: str,
    *,
    stale_after: float = DEFAULT_STALE_AFTER_S,
    timeout: float | None = None,
    on_wait: Callable[[str], None] | None = None,
) -> Iterator[HeldLock]:
    held = acquire(path, stale_after=stale_after, timeout=timeout, on_wait=on_wait)
    try:
        yield held
    finally:
        held.release()


def is_locked(path: str) -> bool:
    """Whether some open file description holds any flock on ``path`` right now."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
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


@contextlib.contextmanager
def _blocking_flock(path: str, operation: int) -> Iterator[int]:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, operation)
        yield fd
    finally:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def shared_lock(path: str) -> contextlib.AbstractContextManager[int]:
    """A blocking shared flock (the GC gate and snapshot leases); yields the fd."""
    return _blocking_flock(path, fcntl.LOCK_SH)


def exclusive_lock(path: str) -> contextlib.AbstractContextManager[int]:
    """A blocking exclusive flock without heartbeat (short critical sections only)."""
    return _blocking_flock(path, fcntl.LOCK_EX)


def try_exclusive(path: str) -> int | None:
    """Non-blocking exclusive flock; returns the fd (caller closes) or None if held elsewhere."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
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
