"""Crash-safe file publication: temp file on the same filesystem → fsync → rename → fsync dir.

Shared by the OCI layout, the node cache and pull, so "nothing half-written at a final path"
is implemented once. A writer of many files (pull) starts each file's write-back while it
writes (``Writeback``), so that the fsync before its rename waits for little, and fsyncs each
directory once after its renames (``DirSyncs``) instead of once per file.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from typing import IO, Any, BinaryIO

from modelpack.errors import DiskFullError, FileWriteError

TEMP_PREFIX = ".tmp-modelpack-"
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
_FICLONE = 0x40049409
_SYNC_FILE_RANGE_WRITE = 2
#: bytes written before their write-back is started (``Writeback``)
WRITEBACK_WINDOW = 8 * 1024 * 1024
_sync_file_range: Any = None  # libc's sync_file_range, looked up on first use; False: none here
_sfr_lock = threading.Lock()


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


def _libc_sync_file_range() -> Any:
    global _sync_file_range
    with _sfr_lock:
        if _sync_file_range is None:
            try:
                import ctypes

                fn = ctypes.CDLL(None, use_errno=True).sync_file_range
                fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
                fn.restype = ctypes.c_int
                _sync_file_range = fn
            except (OSError, AttributeError):
                _sync_file_range = False
    return _sync_file_range


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing ``length`` bytes at ``offset`` of ``fd`` to the disk now,
    without waiting (Linux ``sync_file_range(SYNC_FILE_RANGE_WRITE)``). Only a head start for
    the fsync that must still follow: a no-op where the call is missing or refused."""
    fn = _libc_sync_file_range()
    if fn:
        fn(fd, offset, length, _SYNC_FILE_RANGE_WRITE)  # errors ignored: the fsync reports them


class Writeback:
    """Starts the write-back of a file being written, one ``WRITEBACK_WINDOW`` at a time, so the
    disk writes while the network reads and the fsync before the rename has only the tail left."""

    def __init__(self, fd: int, offset: int = 0, window: int = WRITEBACK_WINDOW) -> None:
        self._fd = fd
        self._start = offset
        self._pending = 0
        self._window = window

    def wrote(self, n: int) -> None:
        self._pending += n
        if self._pending >= self._window:
            start_writeback(self._fd, self._start, self._pending)
            self._start += self._pending
            self._pending = 0


class DirSyncs:
    """Directories whose entries a writer changed (renames into place): each fsynced once, by
    ``sync``, instead of once per file. Until then a crash may forget a rename (the file is not
    at its path, or the old one is) but never exposes a file whose data was not fsynced first."""

    def __init__(self) -> None:
        self._dirs: dict[str, None] = {}
        self._lock = threading.Lock()

    def add(self, directory: str, *, root: str | None = None) -> None:
        """Note ``directory``; with ``root``, also each directory between it and ``root`` (one
        this writer may have created: its entry in its parent must be persisted too)."""
        with self._lock:
            self._dirs[directory] = None
            if root is not None:
                d = directory
                while d != root and len(d) > len(root) and d.startswith(root):
                    d = os.path.dirname(d)
                    self._dirs[d] = None

    def __len__(self) -> int:
        return len(self._dirs)

    def sync(self) -> None:
        """fsync every directory added since the last call; the first failure is a typed error."""
        with self._lock:
            dirs, self._dirs = list(self._dirs), {}
        for directory in dirs:
            try:
                fsync_dir(directory)
            except FileNotFoundError:
                continue  # removed since (a --delete of an emptied tree): nothing left to persist
            except OSError as exc:
                raise write_error(directory, exc) from exc


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


def link_or_copy_fd(fd: int, dst_tmp: str, *, mode: str = "auto") -> str:
    """``link_or_copy`` from an open descriptor, never from a name: reflink (``FICLONE`` takes the
    descriptor), hard link through ``/proc/self/fd`` (the inode the descriptor holds; checked to
    be that inode afterwards), else a copy of the descriptor's bytes."""
    if mode != "copy":
        try:
            with open(dst_tmp, "xb") as d:
                fcntl.ioctl(d.fileno(), _FICLONE, fd)
            return "reflink"
        except OSError:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(dst_tmp)
    if mode == "auto":
        try:
            proc = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:  # linkat(…, AT_SYMLINK_FOLLOW): plain link() would link the /proc entry itself
                os.link(str(fd), dst_tmp, src_dir_fd=proc, follow_symlinks=True)
            finally:
                os.close(proc)
            held, made = os.fstat(fd), os.lstat(dst_tmp)
            if (held.st_dev, held.st_ino) == (made.st_dev, made.st_ino):
                return "hardlink"
            os.unlink(dst_tmp)
        except OSError as exc:
            if exc.errno not in (
                errno.EXDEV,
                errno.EPERM,
                errno.EMLINK,
                errno.ENOTSUP,
                errno.EACCES,
                errno.ENOENT,
            ):
                raise
    with open(dst_tmp, "xb") as d:
        offset = 0
        while True:
            chunk = os.pread(fd, 8 * 1024 * 1024, offset)
            if not chunk:
                break
            d.write(chunk)
            offset += len(chunk)
    return "copy"


def pread_exact(fd: int, n: int, offset: int) -> bytes:
    """Up to ``n`` bytes at ``offset``, fewer only at end of file: one ``pread`` returns at most
    about 2 GiB on Linux (``MAX_RW_COUNT``), which is not the end of the file."""
    chunks = []
    got = 0
    while got < n:
        data = os.pread(fd, n - got, offset + got)
        if not data:
            break
        chunks.append(data)
        got += len(data)
    return b"".join(chunks) if len(chunks) != 1 else chunks[0]


def read_exact(stream: BinaryIO, n: int) -> bytes:
    """Up to ``n`` bytes, fewer only at end of stream (a body or a decompressor may return short
    reads)."""
    chunks = []
    got = 0
    while got < n:
        data = stream.read(n - got)
        if not data:
            break
        chunks.append(data)
        got += len(data)
    return b"".join(chunks)
