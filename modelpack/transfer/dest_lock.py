"""One pull at a time into a directory: an exclusive ``flock`` on the destination directory itself.

Two pulls of different artifacts into one directory used to interleave their renames, and both
could exit 0 while the directory held the other model or a mix of both. The lock is taken on
the directory's own file descriptor (nothing is created in it, nothing to sweep), held from
before the destination is inspected until the last rename is persisted, and released by the
kernel when its holder dies (``kill -9`` included). A second pull waits for it, at most
``lock_timeout()`` seconds (``$MODELPACK_LOCK_TIMEOUT``, default 600), then fails with a
``LockTimeoutError`` naming the directory. So exit 0 means the directory held exactly that
artifact's files when the pull released it; a later pull may of course change them after.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import time
from collections.abc import Iterator

from modelpack import settings
from modelpack.errors import LockTimeoutError
from modelpack.files import write_error

#: another pull of a large model into the same directory may take minutes
DEFAULT_DEST_LOCK_TIMEOUT_S = 600.0
_POLL_S = 0.05


def lock_timeout() -> float:
    """``$MODELPACK_LOCK_TIMEOUT`` seconds when it is a positive number, else 600."""
    return settings.LOCK_TIMEOUT.get() or DEFAULT_DEST_LOCK_TIMEOUT_S


@contextlib.contextmanager
def destination_locked(dest: str, timeout: float | None = None) -> Iterator[None]:
    """Hold ``dest`` (an existing directory) for this pull; wait at most ``timeout`` seconds."""
    try:
        fd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise write_error(dest, exc) from exc
    try:
        wait = lock_timeout() if timeout is None else timeout
        deadline = time.monotonic() + wait
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES):
                    raise write_error(dest, exc) from exc
            if time.monotonic() >= deadline:
                raise LockTimeoutError(
                    f"{dest}: another pull into this directory held it for {wait:.0f} s; "
                    f"wait for it to finish (or set {settings.LOCK_TIMEOUT.name} to wait longer)"
                )
            time.sleep(_POLL_S)
        yield
    finally:
        os.close(fd)  # releases the lock


__all__ = ["DEFAULT_DEST_LOCK_TIMEOUT_S", "destination_locked", "lock_timeout"]
