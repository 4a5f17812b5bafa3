"""Crash-safe file publication: temp file on the same filesystem → fsync → rename → fsync dir.

Shared by the OCI layout, the node cache and pull, so "nothing half-written at a final path"
is implemented once.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import IO

from modelpack.errors import DiskFullError, FileWriteError

TEMP_PREFIX = ".tmp-modelpack-"
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
_FICLONE = 0x40049409


def is_disk_full(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in _NO_SPACE


def write_error(path: str, exc: OSError, *, kept: str = "") -> FileWriteError:
    """The typed error for an OS error while writing ``path``: the path a person has to look at,
    what is in the way, and (``kept``) what was kept for a resume."""
    if exc.errno in _NO_SPACE:
        what = "no space left on the device" if exc.errno == errno.ENOSPC else "disk quota exceeded"
        return DiskFullError(path, f"{what}; {kept or 'nothing was written at the final path'}")
    if exc.errno == errno.EISDIR or (exc.errno == errno.EEXIST and os.path.isdir(path)):
        return FileWriteError(path, "a directory is where a file goes; move it away (it is never removed)")
    if exc.errno in (errno.ENOTDIR, errno.EEXIST):
        return FileWriteError(path, "a file is where a directory goes; move it away (it is never removed)")
    return FileWriteError(path, exc.strerror or str(exc))


def free_bytes(path: str) -> int:
    """Bytes an unprivileged writer may still use on the filesystem holding ``path``."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def fsync_dir(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_writer(final_path: str | os.PathLike[str], mode: int = 0o644) -> Iterator[IO[bytes]]:
    """Yield a temp file next to ``final_path``; on clean exit it is fsynced and renamed into place.

    On any exception the temp file is removed and ``final_path`` is untouched.
    """
    final = os.fspath(final_path)
    directory = os.path.dirname(final) or "."
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=TEMP_PREFIX, dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, final)
        fsync_dir(directory)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_bytes(final_path: str | os.PathLike[str], data: bytes, mode: int = 0o644) -> None:
    with atomic_writer(final_path, mode) as f:
        f.write(data)


def try_reflink(src: str, dst: str) -> bool:
    """Copy-on-write clone (btrfs, XFS, …). Safe against later edits of ``src``, unlike a hard link."""
    try:
        with open(src, "rb") as s, open(dst, "wb") as d:
            fcntl.ioctl(d.fileno(), _FICLONE, s.fileno())
        return True
    except OSError:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(dst)
        return False


def link_or_copy(src: str, dst_tmp: str, *, mode: str = "auto") -> str:
    """Materialize ``src`` at ``dst_tmp`` (which must not exist); returns ``reflink|hardlink|copy``.

    ``auto`` tries reflink, hard link, then a kernel-side copy; ``reflink`` never hard-links (the
    result never shares an inode with ``src``); ``copy`` always copies.
    """
    if mode != "copy" and try_reflink(src, dst_tmp):
        return "reflink"
    if mode == "auto":
        try:
            os.link(src, dst_tmp)
            return "hardlink"
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EACCES):
                raise
    shutil.copyfile(src, dst_tmp)
    return "copy"


def same_filesystem(a: str, b: str) -> bool:
    try:
        return os.stat(a).st_dev == os.stat(b).st_dev
    except OSError:
        return False


def sweep_temp_files(directory: str, *, older_than_s: float = 0.0) -> int:
    """Remove our stale temp files in ``directory`` (not recursive); returns how many."""
    import time

    removed = 0
    now = time.time()
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return 0
    for entry in entries:
        if entry.name.startswith(TEMP_PREFIX):
            try:
                if now - entry.stat(follow_symlinks=False).st_mtime >= older_than_s:
                    os.unlink(entry.path)
                    removed += 1
            except FileNotFoundError:
                pass
    return removed
