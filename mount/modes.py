"""Who the node cache trusts on disk: explicit modes, never the umask, and the cache owner's files only.

The cache is shared by every process on a node, and other local users may be able to read it
(a serving container of another uid, a monitoring agent). They must not be able to change what a
pull publishes, so nothing here depends on the process umask (under ``umask 000`` every
directory would otherwise be world-writable), and anything the cache reads back as a fact — a
committed blob, a ready marker, a trust or ref record, ``index.json`` — counts only when the
cache owner or root wrote it and nobody else can write it now.

The cache owner is whoever owns the cache root, and that must be the uid running the command or
root: a root owned by anyone else is refused (``check_cache_path``), because its owner can rename
anything inside it and put its own files there — which would then be "the owner's". For the same
reason every directory above the root must belong to root or to the caller and be unwritable by
others (or sticky, like ``/tmp``): whoever can rename the root can replace the whole cache.

Modes::

    cache root (created)                            0750  readers: the owner and the root's group
    blobs/, snapshots/, refs/, pins/                0755  whoever may enter the root may read models
    ingest/, locks/, leases/                        0700  the owner's business only
    committed blobs, snapshot files, ready markers  0444  (snapshot directories 0555)
    records (refs, pins, trust, index.json)         0644
    lock files, partial downloads, pull leases      0600  (another uid cannot open, so cannot flock)
    snapshot reader leases                          0644  readers take a shared flock on them

Who may read the cache at all is decided by the cache root's own mode, which the cache never
widens: a root it creates is ``0750``; ``chgrp SERVING_GROUP ROOT`` lets a serving group read
(and lease) models, ``chmod 0755 ROOT`` every local user, ``0700`` nobody else.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat

from modelpack.errors import StoreError

DIR_MODE = 0o755
ROOT_MODE = 0o750
PRIVATE_DIR_MODE = 0o700
READ_ONLY_DIR_MODE = 0o555
FILE_MODE = 0o644
READ_ONLY_FILE_MODE = 0o444
PRIVATE_FILE_MODE = 0o600
LEASE_FILE_MODE = 0o644

_WRITABLE_BY_OTHERS = stat.S_IWGRP | stat.S_IWOTH


def cache_owner(root: str) -> int:
    """The uid the cache trusts besides root: the owner of the cache root, which must be the
    caller or root (``StoreError`` otherwise, naming the fix)."""
    return check_cache_path(root).st_uid


def check_cache_path(root: str) -> os.stat_result:
    """The cache root's stat, after checking that nobody but root and the caller controls it:
    the root itself belongs to one of them, and so does every directory above it (lexically and
    after resolving symlinks) and every symlink on the way, no directory writable by others
    unless sticky."""
    euid = os.geteuid()
    st = os.stat(root)  # the root may be a symlink an administrator made (to an NVMe mount)
    if not stat.S_ISDIR(st.st_mode):
        raise StoreError(f"{root}: not a directory; use another --cache")
    if st.st_uid not in (euid, 0):
        raise StoreError(
            f"{root}: the node cache root is owned by uid {st.st_uid}, not by you (uid {euid}) or root; "
            "its owner could swap in its own files and the cache would trust them. "
            f"Fix: 'chown -R {euid} {root}' (as root), run as uid {st.st_uid}, or use another --cache"
        )
    link = os.lstat(root)
    if stat.S_ISLNK(link.st_mode) and link.st_uid not in (euid, 0):
        raise StoreError(
            f"{root}: a symlink owned by uid {link.st_uid}; its owner can point it elsewhere at any "
            "time. Use the directory it points to, or a symlink of yours or root's, as --cache"
        )
    for parent in _parents(root):
        pst = os.lstat(parent)
        if stat.S_ISLNK(pst.st_mode):
            if pst.st_uid not in (euid, 0):  # its target is checked on the resolved path
                raise StoreError(
                    f"{root}: {parent} on its path is a symlink owned by uid {pst.st_uid}, who can "
                    "point it elsewhere at any time; use a path only root or you control"
                )
            continue
        mode = stat.S_IMODE(pst.st_mode)
        loose = mode & _WRITABLE_BY_OTHERS and not mode & stat.S_ISVTX
        if pst.st_uid not in (euid, 0) or loose:
            why = f"owned by uid {pst.st_uid}" if pst.st_uid not in (euid, 0) else f"mode {mode:04o}"
            raise StoreError(
                f"{root}: the directory above it, {parent}, is {why}; whoever controls it can replace "
                "the whole node cache. Put the cache under directories only root or you control "
                f"(e.g. /var/cache/modelpack), or 'chown root {parent} && chmod go-w {parent}'"
            )
    if not os.access(root, os.R_OK | os.X_OK, effective_ids=os.access in os.supports_effective_ids):
        raise StoreError(
            f"{root}: the node cache root is mode {stat.S_IMODE(st.st_mode):04o} (uid {st.st_uid}, "
            f"gid {st.st_gid}) and you (uid {euid}) may not read it; its owner can let a serving group "
            f"read it with 'chgrp GROUP {root}' (docs/node.md, 'Sharing the cache with a serving group')"
        )
    return st


def _parents(root: str) -> list[str]:
    """Every directory above ``root``: on the path as given and on the path symlinks lead to."""
    out: list[str] = []
    for path in (os.path.abspath(root), os.path.realpath(root)):
        parent = os.path.dirname(path)
        while True:
            if parent not in out:
                out.append(parent)
            up = os.path.dirname(parent)
            if up == parent:
                break
            parent = up
    return out


def untrusted_reason(st: os.stat_result, owner: int, *, read_only: bool = False) -> str | None:
    """Why a file or directory with stat ``st`` cannot be trusted, or None when it can.

    ``read_only``: committed content (blobs, markers) is never writable, not even by its owner;
    a writable one was not committed by the cache.
    """
    if st.st_uid not in (owner, 0):
        return f"owned by uid {st.st_uid}, not by the cache owner (uid {owner})"
    mode = stat.S_IMODE(st.st_mode)
    if mode & _WRITABLE_BY_OTHERS:
        return f"writable by group or others (mode {mode:04o})"
    if read_only and mode & stat.S_IWUSR:
        return f"writable (mode {mode:04o}); committed content is read-only"
    return None


def trusted_file(st: os.stat_result, owner: int, *, read_only: bool = False) -> bool:
    return stat.S_ISREG(st.st_mode) and untrusted_reason(st, owner, read_only=read_only) is None


def _may_chmod(st: os.stat_result) -> bool:
    euid = os.geteuid()
    return euid == 0 or st.st_uid == euid


def make_dirs(path: str, mode: int = DIR_MODE, *, leaf_mode: int | None = None) -> None:
    """``os.makedirs`` whose missing components get exactly ``mode`` (not ``0777 & ~umask``), the
    last one ``leaf_mode`` when given.

    Existing components are left alone: the parents of the cache root are not the cache's.
    """
    path = os.path.abspath(path)
    leaf = path
    missing = []
    while not os.path.lexists(path):
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    for p in reversed(missing):
        want = leaf_mode if leaf_mode is not None and p == leaf else mode
        try:
            os.mkdir(p, want)
        except FileExistsError:
            continue
        os.chmod(p, want)


def ensure_dir(path: str, mode: int, owner: int | None) -> None:
    """Make sure the cache directory ``path`` exists with exactly ``mode``.

    A directory the process may chmod is repaired (a cache created by an older version under a
    permissive umask); one it may not must already be trustworthy, or the cache is refused: a
    directory another uid can write into is a directory where it can plant what we read back.
    ``owner`` is None while the cache root itself is being created.
    """
    try:
        os.mkdir(path, mode)
    except FileExistsError:
        pass
    else:
        os.chmod(path, mode)
        return
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise StoreError(
            f"{path}: not a directory (a symlink or file where the node cache keeps a directory); "
            "remove it or use another --cache"
        )
    if stat.S_IMODE(st.st_mode) != mode and _may_chmod(st):
        try:
            os.chmod(path, mode)
            return
        except OSError as exc:
            if exc.errno not in (errno.EROFS, errno.EPERM, errno.EACCES):
                raise
    reason = untrusted_reason(st, st.st_uid if owner is None else owner)
    if reason is not None:
        raise StoreError(
            f"{path}: {reason}; another user could plant files the node cache would trust. "
            f"Fix it with 'chmod go-w {path}' (as its owner) or use another --cache"
        )


def ensure_root(root: str) -> int:
    """Create the cache root (``0750``; missing parents ``0755``) or check an existing one;
    returns the cache owner's uid. The root must be the caller's or root's, and so must every
    directory above it (``check_cache_path``). An existing root keeps its mode, except that write
    access for group and others is removed when the process may change it (and refused when it
    may not)."""
    make_dirs(root, DIR_MODE, leaf_mode=ROOT_MODE)
    st = check_cache_path(root)
    mode = stat.S_IMODE(st.st_mode)
    if mode & stat.S_ISVTX and mode & _WRITABLE_BY_OTHERS:
        raise StoreError(
            f"{root}: a shared sticky directory (mode {mode:04o}, like /tmp), not a node cache; other "
            f"users keep files there. Use a directory of its own, e.g. --cache {os.path.join(root, 'modelpack')}"
        )
    if mode & _WRITABLE_BY_OTHERS:
        if _may_chmod(st):
            with contextlib.suppress(OSError):
                os.chmod(root, mode & ~_WRITABLE_BY_OTHERS)
        if stat.S_IMODE(os.stat(root).st_mode) & _WRITABLE_BY_OTHERS:
            raise StoreError(
                f"{root}: the node cache root is writable by group or others (mode {mode:04o}); "
                f"another user could replace its contents. Run 'chmod go-w {root}' or use another --cache"
            )
    return st.st_uid


def open_private(path: str, flags: int, owner: int, mode: int = PRIVATE_FILE_MODE) -> int:
    """Open (creating) a file only the cache uses, refusing to follow a symlink; a file another
    uid planted there is replaced, and our own file's mode is set to ``mode`` whatever the umask.
    Returns the fd."""
    for _ in range(3):
        fd = os.open(path, flags | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and st.st_uid in (owner, 0, os.geteuid()):
            if stat.S_IMODE(st.st_mode) != mode and _may_chmod(st):
                with contextlib.suppress(OSError):
                    os.fchmod(fd, mode)
            return fd
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # planted by another uid while the directory was writable
    raise StoreError(f"{path}: replaced by another user as fast as the cache removes it; refusing to use it")


def read_trusted(path: str, owner: int, limit: int, *, read_only: bool = False) -> bytes | None:
    """The bytes of a small record the cache wrote (at most ``limit`` + 1, so the caller can tell
    an oversized one); None when it is missing, a symlink, or not the cache owner's."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return None
        raise
    try:
        if not trusted_file(os.fstat(fd), owner, read_only=read_only):
            return None
        chunks = []
        left = limit + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)
