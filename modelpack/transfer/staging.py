"""Temp files and directories a pull owns in its destination: locked while alive, swept once dead.

A pull writes each raw file to a ``.partial`` next to its final path (named by digest, so that a
later pull can resume it) and extracts each tar layer into a staging directory in the
destination. Each holds an ``flock`` for as long as its writer lives: the kernel drops the lock
when the process dies, even on SIGKILL, so a later pull can tell a dead writer's leftovers
(unlocked: resumed or swept) from a concurrent pull's (locked: left alone) without guessing from
timestamps or process ids, across containers sharing the directory as well.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import shutil
import stat
import tempfile
import time
from collections.abc import Iterable

from modelpack.errors import PullError
from modelpack.files import TEMP_PREFIX, write_error
from modelpack.oci.digest import Digest
from modelpack.transfer.blob_writer import Partial

PULL_PREFIX = TEMP_PREFIX + "pull-"
PARTIAL_SUFFIX = ".partial"
#: an unlocked ``.tmp-modelpack-*`` entry not named by a pull (an older version's temp file, or
#: another writer that does not lock) is swept only once it has not changed for this long
FOREIGN_TEMP_AGE_S = 3600.0
_LOCK_WAIT_S = 1.0


def partial_path(final_path: str, digest: Digest) -> str:
    """Where the download of ``final_path`` (content ``digest``) is kept until it is verified."""
    tag = hashlib.sha256(os.path.basename(final_path).encode()).hexdigest()[:8]
    return os.path.join(os.path.dirname(final_path), f"{PULL_PREFIX}{digest.hex[:32]}-{tag}{PARTIAL_SUFFIX}")


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _lock_within(fd: int, seconds: float) -> bool:
    """A sweeper holds an entry's lock for microseconds: wait briefly before calling it busy."""
    deadline = time.monotonic() + seconds
    while not _try_lock(fd):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True


def _still_at(fd: int, path: str) -> bool:
    """Whether ``fd`` is still the entry at ``path`` (a sweeper may have removed it before we locked)."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def private_file(st: os.stat_result) -> bool:
    """This user's regular file, one link, not writable by anyone else: safe to write into and
    to rename to a final path (no one else can change it after it was verified)."""
    return (
        stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and st.st_nlink == 1 and not st.st_mode & 0o022
    )


def _locked_temp(directory: str) -> tuple[int, str]:
    try:
        fd, path = tempfile.mkstemp(prefix=PULL_PREFIX, suffix=".tmp", dir=directory)
    except OSError as exc:
        raise write_error(directory, exc) from exc
    _try_lock(fd)  # a fresh random name: no one else can hold it
    return fd, path


def open_partial(path: str) -> tuple[int, str]:
    """Open (creating) the partial download at ``path`` and lock it; returns the descriptor and
    the path it is at.

    Something at that name that is not this user's private file (another user's, a hard link, a
    symlink, writable by others) is never written into: it is removed when the directory allows,
    else this run downloads to a fresh private temp file (not resumable). Raises ``PullError``
    when another live pull holds the partial: two pulls would otherwise write one file at once.
    """
    for _ in range(3):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.EACCES, errno.EPERM):
                raise write_error(path, exc) from exc
            fd = -1
        if fd < 0 or not private_file(os.fstat(fd)):
            if fd >= 0:
                os.close(fd)
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            except OSError:
                return _locked_temp(os.path.dirname(path))
            continue
        if not _lock_within(fd, _LOCK_WAIT_S):
            os.close(fd)
            raise PullError(f"{path}: another pull is writing this file now; wait for it to finish")
        if _still_at(fd, path):
            return fd, path
        os.close(fd)  # swept between open and lock: open the new one
    raise PullError(f"{path}: the partial download keeps disappearing (is something else sweeping it?)")


class BesideFinal:
    """The directory pull's ``PartialSlot``: the partial is ``path`` (``partial_path``, next to
    the final file), locked with its own ``flock``; a private temp file when the name is not safe
    to write (``open_partial``), which is not resumable."""

    def __init__(self, path: str) -> None:
        self.path = path

    def open(self) -> Partial:
        fd, path = open_partial(self.path)
        return Partial(fd, path, resumable=path.endswith(PARTIAL_SUFFIX))


class StagingDir:
    """A locked, empty directory inside the destination for one tar layer's files."""

    def __init__(self, parent: str) -> None:
        for _ in range(3):
            try:
                path = tempfile.mkdtemp(prefix=PULL_PREFIX, dir=parent)
                fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            except OSError as exc:
                raise write_error(parent, exc) from exc
            if _try_lock(fd) and _still_at(fd, path):
                self.path = path
                self._fd = fd
                return
            os.close(fd)
        raise PullError(f"{parent}: cannot keep a staging directory (is something else sweeping it?)")

    def remove(self) -> None:
        """Delete the directory and whatever is still in it, then drop the lock."""
        if self._fd < 0:
            return
        shutil.rmtree(self.path, ignore_errors=True)
        os.close(self._fd)
        self._fd = -1

    def __enter__(self) -> StagingDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def _remove_if_unlocked(path: str, is_dir: bool) -> bool:
    """Remove a temp entry of this user that no live process holds; never another user's."""
    try:
        flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | (os.O_DIRECTORY if is_dir else 0)
        fd = os.open(path, flags)
    except OSError:
        return False
    try:
        if os.fstat(fd).st_uid != os.geteuid() or not _try_lock(fd) or not _still_at(fd, path):
            return False
        if is_dir:
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.unlink(path)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def sweep(dest: str, *, keep: Iterable[str] = ()) -> list[str]:
    """Remove what dead pulls left in ``dest`` (recursively); returns the removed paths.

    Entries named by a pull are removed when they are this user's and no live process holds
    their lock, except the partial downloads in ``keep`` (this pull resumes them). Other ``.tmp-modelpack-*`` entries
    (an older version's, another tool's) go only when unlocked and unchanged for an hour.
    """
    kept = {os.path.abspath(p) for p in keep}
    removed: list[str] = []
    now = time.time()
    for root, dirs, files in os.walk(dest):
        for name in [*dirs, *files]:
            if not name.startswith(TEMP_PREFIX):
                continue
            path = os.path.join(root, name)
            if path in kept:
                continue
            is_dir = name in dirs and not os.path.islink(path)
            if not name.startswith(PULL_PREFIX):
                with contextlib.suppress(FileNotFoundError):
                    if now - os.lstat(path).st_mtime < FOREIGN_TEMP_AGE_S:
                        continue
            if _remove_if_unlocked(path, is_dir):
                removed.append(path)
        dirs[:] = [d for d in dirs if not d.startswith(TEMP_PREFIX)]
    return removed


__all__ = [
    "PARTIAL_SUFFIX",
    "PULL_PREFIX",
    "BesideFinal",
    "StagingDir",
    "open_partial",
    "partial_path",
    "private_file",
    "sweep",
]
