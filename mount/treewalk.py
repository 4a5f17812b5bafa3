"""Tree walks inside the node cache that never leave it: directory fds, ``O_NOFOLLOW``, ``dir_fd``.

GC, ``rm``, sweeps and publishing delete or chmod whole trees, often as root. A path-based walk
(``os.walk`` + ``os.chmod(path)``) follows a symlink planted where a directory was (or swapped in
while the walk runs) and then changes or deletes whatever it points at. Here every directory is
opened with ``O_DIRECTORY | O_NOFOLLOW`` relative to the fd of its parent, every entry is looked
at with ``lstat`` through that fd, modes are changed with ``fchmod`` on an fd we opened, and a
symlink — at the top or anywhere below — is removed as a link, never entered. Root never needs
to chmod anything to delete, so as root nothing is chmodded at all.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
# deeper than any snapshot: a tree this deep is not the cache's, and is left for a person to remove
MAX_DEPTH = 256


def _open_parent(path: str) -> tuple[int, str]:
    """An fd of ``path``'s parent directory and ``path``'s last component."""
    path = os.path.abspath(path)
    return os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC), os.path.basename(path)


def remove_tree(path: str) -> None:
    """Delete ``path`` and everything below it without following a symlink; best effort (what
    cannot be removed stays; callers that care check ``os.path.lexists`` afterwards)."""
    try:
        parent_fd, name = _open_parent(path)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):
            _remove_entry(parent_fd, name, 0)
    finally:
        os.close(parent_fd)


def _remove_entry(dir_fd: int, name: str, depth: int) -> None:
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=dir_fd)
        return
    if depth >= MAX_DEPTH:
        return
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):  # replaced by a symlink or file meanwhile
            os.unlink(name, dir_fd=dir_fd)
        return
    try:
        _make_deletable(fd)
        with os.scandir(fd) as entries:
            names = [e.name for e in entries]
        for child in names:
            with contextlib.suppress(OSError):
                _remove_entry(fd, child, depth + 1)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=dir_fd)


def _make_deletable(fd: int) -> None:
    """Give a read-only directory of ours back the write bit its entries' removal needs (root
    needs none; another uid's directory is left as it is)."""
    euid = os.geteuid()
    if euid == 0:
        return
    st = os.fstat(fd)
    if st.st_uid == euid and stat.S_IMODE(st.st_mode) & 0o700 != 0o700:
        os.fchmod(fd, 0o700)


def make_read_only(root: str, *, file_mode: int, dir_mode: int) -> None:
    """Exactly ``file_mode`` on regular files and ``dir_mode`` on directories below ``root``
    (``root`` itself is left to the caller), never through a symlink."""
    fd = os.open(root, _DIR_FLAGS)
    try:
        _make_read_only(fd, file_mode, dir_mode, 0)
    finally:
        os.close(fd)


def _make_read_only(dir_fd: int, file_mode: int, dir_mode: int, depth: int) -> None:
    if depth >= MAX_DEPTH:
        raise OSError(errno.ELOOP, "directory tree too deep")
    with os.scandir(dir_fd) as entries:
        names = [e.name for e in entries]
    for name in names:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if stat.S_ISDIR(st.st_mode):
            sub = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
            try:
                _make_read_only(sub, file_mode, dir_mode, depth + 1)
                os.fchmod(sub, dir_mode)  # children first: a read-only parent is still entered
            finally:
                os.close(sub)
        elif stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) != file_mode:
            ffd = os.open(name, _FILE_FLAGS, dir_fd=dir_fd)
            try:
                if stat.S_ISREG(os.fstat(ffd).st_mode):
                    os.fchmod(ffd, file_mode)
            finally:
                os.close(ffd)
