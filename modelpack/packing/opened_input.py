"""Pack inputs opened once, beneath a directory descriptor, and read only through that descriptor.

Whoever can write a checkpoint directory, a Modelfile's context or the Hugging Face cache can
rename a symlink over a file between the moment a pack checks it and the moment it reads it; a
pack run by root would then hash, copy, push and sign a file the writer could not read (a key,
``/etc/shadow``). So every input is opened here exactly once:

- from a descriptor of the root directory, one path component at a time, each with
  ``O_NOFOLLOW`` (directories with ``O_DIRECTORY``), so no component is a link the kernel follows;
- a symlink met on the way is followed only where the caller's policy allows it, resolved here
  (textually, against the real path of the directory it sits in) and opened again from the
  descriptor of an allowed root, never from a name outside one; at most ``MAX_LINK_HOPS`` links;
- the result must be a regular file (``fstat``; a FIFO is opened non-blocking so it cannot hang
  the pack), and its identity is the ``fstat`` of that descriptor.

Header, hash, tar and the copy into a layout all read that descriptor (``InputFile.open`` gives an
independent ``pread`` stream; ``files.link_or_copy_fd`` links or copies it), never the name again.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import stat
from collections.abc import Sequence
from typing import BinaryIO

from modelpack.errors import PackError
from modelpack.packing.file_metadata import file_identity

MAX_LINK_HOPS = 40
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC
_DIR_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_DIRECTORY | _CLOEXEC


class _PreadStream(io.RawIOBase):
    """A read-only stream over a shared descriptor with its own position (``pread``), so several
    readers (hash threads, an upload, a tar) never move each other's offset."""

    def __init__(self, fd: int, offset: int = 0) -> None:
        self._fd = fd
        self._pos = offset

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_SET:
            self._pos = offset
        elif whence == io.SEEK_CUR:
            self._pos += offset
        else:
            self._pos = os.fstat(self._fd).st_size + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        n = os.preadv(self._fd, [buffer], self._pos)
        self._pos += n
        return n

    def fileno(self) -> int:
        return self._fd

    def close(self) -> None:  # the descriptor belongs to the InputFile
        super().close()


class InputFile:
    """One pack input, open for reading; ``shown`` names it in messages (never reopened)."""

    def __init__(self, fd: int, shown: str, resolved: str, st: os.stat_result) -> None:
        self.fd = fd
        self.shown = shown
        #: the path the descriptor was reached by, links resolved (where its bytes live)
        self.resolved = resolved
        self.stat = st

    @property
    def size(self) -> int:
        return self.stat.st_size

    @property
    def identity(self) -> tuple[int, ...]:
        """``file_identity`` of the file when it was opened (checked: device and inode)."""
        return file_identity(self.stat)

    def now(self) -> tuple[int, ...]:
        """``file_identity`` of the open file now (size, mtime and mode may have changed)."""
        return file_identity(os.fstat(self.fd))

    def open(self, offset: int = 0) -> BinaryIO:
        """A fresh buffered stream of the file's bytes from ``offset``."""
        return io.BufferedReader(self.raw(offset), 1024 * 1024)

    def raw(self, offset: int = 0) -> io.RawIOBase:
        """A fresh unbuffered stream (for ``readinto`` into a reused buffer, as hashing does)."""
        return _PreadStream(self.fd, offset)

    def read_all(self, limit: int) -> bytes:
        """Up to ``limit`` bytes from the start."""
        with self.open() as f:
            return f.read(limit)

    def close(self) -> None:
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1

    def __del__(self) -> None:
        self.close()


def _refuse(shown: str, why: str) -> PackError:
    return PackError(f"{shown}: {why}; refusing to pack it")


def open_beneath(
    root: str, relpath: str, *, link_roots: Sequence[str] = (), shown: str | None = None
) -> InputFile:
    """Open ``root/relpath`` for reading as described in the module docstring.

    ``root`` and every entry of ``link_roots`` are real paths (no symlink in them). A symlink on
    the way (file or directory) is followed only when its target, resolved, lies inside one of
    ``link_roots``; an empty ``link_roots`` follows no link at all.
    """
    shown = shown or os.path.join(root, relpath)
    roots = [os.path.normpath(r) for r in link_roots]
    base, parts = os.path.normpath(root), [p for p in relpath.split("/") if p]
    for _ in range(MAX_LINK_HOPS + 1):
        outcome = _walk(base, parts, shown)
        if isinstance(outcome, InputFile):
            return outcome
        where, target = outcome  # a link at ``where`` (a real directory path + name) → ``target``
        resolved = os.path.normpath(os.path.join(os.path.dirname(where), target))
        home = next((r for r in roots if resolved == r or resolved.startswith(r + os.sep)), None)
        if home is None:
            raise _refuse(
                shown, f"{where} is a symlink to {target!r}, outside the directories a pack may read"
            )
        base, parts = home, [p for p in os.path.relpath(resolved, home).split(os.sep) if p not in ("", ".")]
    raise _refuse(shown, f"more than {MAX_LINK_HOPS} symlinks to follow")


def _walk(base: str, parts: list[str], shown: str) -> InputFile | tuple[str, str]:
    """Open ``parts`` beneath ``base``: the file, or (path of the first link met, its target)."""
    if not parts or any(p == ".." for p in parts):
        raise _refuse(shown, "not a file path inside the directory")
    try:
        dir_fd = os.open(base, _DIR_FLAGS)
    except OSError as exc:
        raise _refuse(shown, f"cannot open {base}: {exc.strerror or exc}") from None
    current = base
    try:
        for i, name in enumerate(parts):
            last = i == len(parts) - 1
            try:
                fd = _open_at(name, _FILE_FLAGS if last else _DIR_FLAGS, dir_fd, shown)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
                    try:
                        target = os.readlink(name, dir_fd=dir_fd)
                    except OSError:
                        raise _refuse(shown, f"{os.path.join(current, name)} is not a directory") from None
                    rest = parts[i + 1 :]
                    return os.path.join(current, name), os.path.join(target, *rest) if rest else target
                if exc.errno == errno.ENXIO:  # a FIFO or socket opened non-blocking
                    raise _refuse(shown, "not a regular file (device, FIFO or socket)") from None
                raise _refuse(shown, f"cannot open: {exc.strerror or exc}") from None
            if last:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    os.close(fd)
                    raise _refuse(shown, "not a regular file (device, FIFO or socket)")
                return InputFile(fd, shown, os.path.join(current, name), st)
            os.close(dir_fd)
            dir_fd, current = fd, os.path.join(current, name)
    finally:
        with contextlib.suppress(OSError):
            os.close(dir_fd)
    raise AssertionError("unreachable")


def _open_at(name: str, flags: int, dir_fd: int, shown: str) -> int:
    """``openat``; every pack input stays open until the pack is stored, so on ``EMFILE`` the soft
    descriptor limit is raised to the hard one once, and a pack that still does not fit is
    refused naming the limit."""
    try:
        return os.open(name, flags, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno != errno.EMFILE:
            raise
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    try:
        return os.open(name, flags, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno != errno.EMFILE:
            raise
        raise PackError(
            f"{shown}: too many open files (limit {resource.getrlimit(resource.RLIMIT_NOFILE)[0]}): "
            "a pack holds every input open until it is stored; raise `ulimit -n` or pack fewer files"
        ) from None


def close_all(inputs: Sequence[InputFile] | dict[str, InputFile]) -> None:
    for f in inputs.values() if isinstance(inputs, dict) else inputs:
        f.close()


__all__ = ["MAX_LINK_HOPS", "InputFile", "close_all", "open_beneath"]
