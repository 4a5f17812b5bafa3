"""Strided reads of a local file (dim-1 shards) that cannot die of SIGBUS when the file shrinks.

A column-split shard is ``rows`` runs of ``length`` bytes every ``stride`` bytes. Copying them
out of a mapping with the CPU is the fast way (the page cache is mapped, only the rank's bytes
are copied), but a file truncated between the mapping and the copy kills the process with
SIGBUS — no message, no event, nothing to catch. So the CPU never touches the mapping here:

- ``process_vm_readv`` on this very process copies the rows out of the mapping inside the
  kernel, which answers a page past the end of the file with a short count (``EFAULT``) instead of
  a signal: the shrink becomes ``TruncatedSourceError``. One call moves up to ``IOV_MAX`` rows.
- Where that system call is refused (a seccomp profile without it, no ptrace access to oneself)
  each row is one ``preadv`` straight into its destination: slower on a hot page cache, equally
  safe (a short read is the truncation).

The mapping is created only after the file's current size was checked to cover the range.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading

import numpy as np

from modelpack.errors import TruncatedSourceError

_IOV_MAX = 1024
#: bytes one process_vm_readv call is asked for: the kernel moves at most ~2 GiB a call
#: (MAX_RW_COUNT), and its short count must keep meaning "past the end of the file"
_MAX_CALL_BYTES = 1 << 30
_lock = threading.Lock()
_vm_readv: object | None = None  # ctypes function, False once refused, None before the first try


def _process_vm_readv() -> object:
    global _vm_readv
    with _lock:
        if _vm_readv is None:
            try:
                fn = ctypes.CDLL(None, use_errno=True).process_vm_readv
                fn.restype = ctypes.c_ssize_t
                fn.argtypes = [
                    ctypes.c_int,
                    ctypes.c_void_p,
                    ctypes.c_ulong,
                    ctypes.c_void_p,
                    ctypes.c_ulong,
                    ctypes.c_ulong,
                ]
                _vm_readv = fn
            except (OSError, AttributeError):
                _vm_readv = False
        return _vm_readv


def gather_rows(
    fd: int, path: str, offset: int, length: int, stride: int, rows: int, dest: np.ndarray
) -> None:
    """Copy ``rows`` runs of ``length`` bytes, ``stride`` apart from ``offset``, into ``dest``
    (a C-contiguous ``rows × length`` uint8 array), or raise ``TruncatedSourceError``."""
    if rows == 0 or length == 0:
        return
    end = offset + (rows - 1) * stride + length
    size = os.fstat(fd).st_size
    if end > size:
        raise TruncatedSourceError(path, offset, end - offset, max(0, size - offset))
    fn = _process_vm_readv()
    if fn is not False and _gather_in_kernel(fn, fd, path, offset, length, stride, rows, dest, end):
        return
    _gather_preadv(fd, path, offset, length, stride, rows, dest)


def _gather_in_kernel(
    fn: object,
    fd: int,
    path: str,
    offset: int,
    length: int,
    stride: int,
    rows: int,
    dest: np.ndarray,
    end: int,
) -> bool:
    """The kernel copies the rows out of a mapping; False when the system call is refused (or a
    row is longer than one call may move: positional reads loop on short counts)."""
    global _vm_readv
    if length > _MAX_CALL_BYTES:
        return False
    per_call = max(1, min(_IOV_MAX, _MAX_CALL_BYTES // length))
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    try:
        m = mmap.mmap(fd, end - start, access=mmap.ACCESS_READ, offset=start)
    except ValueError as exc:  # the file shrank since the size check: mmap refuses past its end
        raise TruncatedSourceError(path, offset, end - offset, 0) from exc
    src: np.ndarray | None = None
    try:
        src = np.frombuffer(m, dtype=np.uint8)
        base = src.ctypes.data + (offset - start)
        dbase = dest.ctypes.data
        pid = os.getpid()
        for r0 in range(0, rows, per_call):
            r1 = min(rows, r0 + per_call)
            remote = np.empty((r1 - r0, 2), dtype=np.uint64)
            remote[:, 0] = base + np.arange(r0, r1, dtype=np.uint64) * stride
            remote[:, 1] = length
            want = (r1 - r0) * length
            local = np.array([[dbase + r0 * length, want]], dtype=np.uint64)
            n = fn(pid, local.ctypes.data, 1, remote.ctypes.data, r1 - r0, 0)  # type: ignore[operator]
            if n == want:
                continue
            err = ctypes.get_errno() if n < 0 else 0
            if n < 0 and err in (errno.EPERM, errno.ENOSYS, errno.EACCES) and r0 == 0:
                with _lock:
                    _vm_readv = False  # refused here (seccomp, ptrace policy): positional reads
                return False
            got = r0 * length + max(0, n)
            raise TruncatedSourceError(path, offset, rows * length, got)
    finally:
        src = None  # the mapping's only export: close() must find none
        try:
            m.close()
        except BufferError:  # pragma: no cover - a view escaped; the GC unmaps it
            pass
    return True


def _gather_preadv(
    fd: int, path: str, offset: int, length: int, stride: int, rows: int, dest: np.ndarray
) -> None:
    out = memoryview(dest.reshape(-1).data).cast("B")
    for k in range(rows):
        row = out[k * length : (k + 1) * length]
        got = 0
        while got < length:
            n = os.preadv(fd, [row[got:]], offset + k * stride + got)
            if n <= 0:
                raise TruncatedSourceError(path, offset, rows * length, k * length + got)
            got += n
