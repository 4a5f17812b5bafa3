"""A node-cache snapshot's files at a destination directory (KServe's ``DEST``), verified.

Each file is reflinked, else hard-linked, else copied from the snapshot (``files.link_or_copy``)
to a temp name in its directory and renamed into place; a copy (the only way across
filesystems and mounts, which ``link(2)`` refuses with ``EXDEV``) is hashed against the
snapshot's recorded sha256 before the rename. A file already at its path counts as present
when it is the snapshot's own inode, or a regular file with the recorded size and sha256; any
other file there is replaced. Nothing else in the destination is touched.

One writer at a time per destination, as for every pull into a directory
(``transfer.dest_lock.destination_locked``): two initializers placing into one ``DEST`` (two
containers of a pod, a restarted init container beside a slow one) take turns, so one temp
name per file is safe, and what a killed run left there is replaced by the next.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
from collections import Counter
from dataclasses import dataclass, field

from modelpack.errors import DigestMismatchError, UnsafePathError
from modelpack.files import TEMP_PREFIX, DirSyncs, link_or_copy
from modelpack.mount.snapshot_files import SnapshotFile
from modelpack.mount.snapshots import SnapshotInfo
from modelpack.oci.digest import HASH_CHUNK
from modelpack.transfer.dest_lock import destination_locked

FILE_MODE = 0o444  # what the snapshot's files are; a copy gets the same
DIR_MODE = 0o755


@dataclass
class Placement:
    files: int = 0
    present: int = 0
    how: Counter[str] = field(default_factory=Counter)  # reflink | hardlink | copy → files

    def to_json(self) -> dict[str, object]:
        return {"files": self.files, "present": self.present, "placed": dict(self.how)}


def _sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def _target_path(dest: str, relpath: str) -> str:
    parts = relpath.split("/")
    if relpath.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise UnsafePathError(f"snapshot file path {relpath!r} is not a safe relative path")
    return os.path.join(dest, *parts)


def _make_parents(dest: str, path: str) -> None:
    """Create the directories between ``dest`` and ``path``, refusing a symlink on the way (a
    link planted in ``DEST`` must not send a file outside it)."""
    current = dest
    for part in os.path.relpath(os.path.dirname(path), dest).split(os.sep):
        if part in ("", "."):
            continue
        current = os.path.join(current, part)
        try:
            st = os.lstat(current)
        except FileNotFoundError:
            os.mkdir(current, DIR_MODE)
            os.chmod(current, DIR_MODE)
            continue
        if not stat.S_ISDIR(st.st_mode):
            raise UnsafePathError(
                f"{current} is in the way of a model file (not a directory; never followed)"
            )


def _present(path: str, src: str, f: SnapshotFile) -> bool:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if not stat.S_ISREG(st.st_mode):
        if stat.S_ISDIR(st.st_mode):
            raise UnsafePathError(f"{path}: a directory is where a model file goes (never removed)")
        return False  # a symlink or a device: replaced by the verified file
    src_st = os.stat(src)
    if (st.st_dev, st.st_ino) == (src_st.st_dev, src_st.st_ino):
        return True
    return st.st_size == f.size and _sha256_file(path) == f.digest


def place_snapshot(snapshot: SnapshotInfo, dest: str, *, link: str = "auto") -> Placement:
    """Every file of ``snapshot`` at its path under ``dest`` (which is created when missing).

    ``link`` is ``auto`` (reflink, hard link, copy), ``reflink`` (reflink or copy: DEST never
    shares an inode with the cache) or ``copy``."""
    os.makedirs(dest, exist_ok=True)
    dest = os.path.realpath(dest)
    with destination_locked(dest):
        return _place_locked(snapshot, dest, link)


def _place_locked(snapshot: SnapshotInfo, dest: str, link: str) -> Placement:
    result = Placement()
    syncs = DirSyncs()
    for f in snapshot.files:
        result.files += 1
        src = os.path.join(snapshot.path, *f.path.split("/"))
        path = _target_path(dest, f.path)
        _make_parents(dest, path)
        # one temp name per file (DEST is held): what a killed run left there is replaced by the next
        tmp = os.path.join(os.path.dirname(path), f"{TEMP_PREFIX}kserve-{os.path.basename(path)}")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if _present(path, src, f):
            result.present += 1
            continue
        try:
            how = link_or_copy(src, tmp, mode=link)
            if how == "copy":
                os.chmod(tmp, FILE_MODE)
                got = _sha256_file(tmp)
                if got != f.digest:
                    raise DigestMismatchError(f.digest, got, what=f"{f.path} copied from the node cache")
                with open(tmp, "rb") as fh:
                    os.fsync(fh.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        syncs.add(os.path.dirname(path))
        result.how[how] += 1
    syncs.sync()
    return result
