"""What is already in a pull's destination directory, and how the artifact's files may land there.

A destination is often not empty: an earlier version of the model, a file a person edited, a
directory someone made. Pull loses nothing there: a file that differs from the artifact's is a
conflict (replaced only with ``--force``), a directory where a file goes is always refused (never
removed), a path whose directories leave the destination through a symlink is refused, and files
the artifact does not contain are reported (removed only with ``--delete``, like ``rsync``).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from modelpack.errors import FileWriteError, UnsafePathError
from modelpack.files import TEMP_PREFIX, DirSyncs, fsync_dir, write_error
from modelpack.oci.digest import sha256_file

ABSENT = "absent"
SAME = "same"
DIFFERS = "differs"


@dataclass(frozen=True)
class Placement:
    """Where one of the artifact's files goes and what is there now (``absent|same|differs``)."""

    relpath: str
    final: str
    state: str
    why: str = ""  # for ``differs`` when the bytes are not the reason

    @property
    def conflict(self) -> str:
        return f"{self.relpath} ({self.why})" if self.why else self.relpath


def check_parents(dest: str, relpath: str) -> None:
    """Refuse a path whose directories are files or leave ``dest`` (through a symlink)."""
    real_dest = os.path.realpath(dest)
    parts = relpath.split("/")[:-1]
    path = dest
    for part in parts:
        path = os.path.join(path, part)
        try:
            st = os.stat(path)  # follows links: a link to a directory inside dest is fine
        except FileNotFoundError:
            return
        except NotADirectoryError as exc:
            raise write_error(path, exc) from exc
        if not stat.S_ISDIR(st.st_mode):
            raise write_error(path, OSError(errno.ENOTDIR, "not a directory"))
        real = os.path.realpath(path)
        if os.path.commonpath([real, real_dest]) != real_dest:
            raise UnsafePathError(f"{relpath}: its directory {path} leads outside {dest} (symlink?)")


def placement(dest: str, relpath: str, digest: str | Callable[[], str], size: int) -> Placement:
    """Compare what is at ``relpath`` with the artifact's file (size first, then sha256). A file
    of another user (not root) never counts as the same: they could change it afterwards.
    ``digest`` may be a function computing it, called only when a same-sized file is there (a
    staged tar member's bytes are hashed only when there is something to compare them with)."""
    check_parents(dest, relpath)
    final = os.path.join(dest, *relpath.split("/"))
    try:
        st = os.lstat(final)
    except FileNotFoundError:
        return Placement(relpath, final, ABSENT)
    if stat.S_ISDIR(st.st_mode):
        raise write_error(final, OSError(errno.EISDIR, "is a directory"))
    if not stat.S_ISREG(st.st_mode) or st.st_size != size:
        return Placement(relpath, final, DIFFERS)  # a symlink is replaced, never written through
    if st.st_uid not in (os.geteuid(), 0):
        # right bytes today, but another user can change them after this pull vouched for them
        return Placement(relpath, final, DIFFERS, f"owned by uid {st.st_uid}")
    got, _ = sha256_file(final)
    want = digest if isinstance(digest, str) else digest()
    return Placement(relpath, final, SAME if got == want else DIFFERS)


def set_mode(path: str, mode: int) -> None:
    """Give a file this pull vouched for (``SAME``: ours or root's) the mode it should have."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise write_error(path, exc) from exc
    try:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) != mode:
            os.fchmod(fd, mode)
    except OSError as exc:
        raise write_error(path, exc) from exc
    finally:
        os.close(fd)


def make_parents(dest: str, relpath: str) -> str:
    """Create the directories of ``relpath`` (checked again: the tree may have changed); returns
    the file's directory."""
    check_parents(dest, relpath)
    directory = os.path.dirname(os.path.join(dest, *relpath.split("/")))
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as exc:
        raise write_error(directory, exc) from exc
    check_parents(dest, relpath)
    return directory


def publish(staged: str, dest: str, relpath: str, dirs: DirSyncs | None = None) -> None:
    """Rename a verified, fsynced file into place (replacing a file or symlink, never a
    directory); its directory is fsynced now, or once for all by ``dirs``."""
    directory = make_parents(dest, relpath)
    final = os.path.join(dest, *relpath.split("/"))
    if os.path.isdir(final) and not os.path.islink(final):
        raise write_error(final, OSError(errno.EISDIR, "is a directory"))
    try:
        os.chmod(staged, 0o644)
        os.replace(staged, final)
        if dirs is None:
            fsync_dir(directory)
        else:
            dirs.add(directory, root=dest)
    except OSError as exc:
        raise write_error(final, exc) from exc


def extra_files(dest: str, artifact_files: Iterable[str]) -> list[str]:
    """Files (and links) under ``dest`` that the artifact does not contain, as sorted relpaths.
    Temp entries of pulls are not counted (they are swept or resumed)."""
    wanted = set(artifact_files)
    out: list[str] = []
    for root, dirs, files in os.walk(dest):
        dirs[:] = sorted(d for d in dirs if not d.startswith(TEMP_PREFIX))
        rel_root = os.path.relpath(root, dest)
        for name in files:
            if name.startswith(TEMP_PREFIX):
                continue
            rel = name if rel_root == "." else f"{rel_root}/{name}".replace(os.sep, "/")
            if rel not in wanted:
                out.append(rel)
        for name in list(dirs):
            if os.path.islink(os.path.join(root, name)):  # a link to a directory: an entry, not a tree
                dirs.remove(name)
                rel = name if rel_root == "." else f"{rel_root}/{name}"
                if rel not in wanted:
                    out.append(rel)
    return sorted(out)


def delete_extra(dest: str, extra: list[str], artifact_files: Iterable[str]) -> list[str]:
    """Remove ``extra`` files, then directories left empty that hold none of the artifact's files;
    returns what was removed (directories with a trailing ``/``)."""
    removed: list[str] = []
    for rel in extra:
        path = os.path.join(dest, *rel.split("/"))
        try:
            os.unlink(path)
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise FileWriteError(path, f"cannot delete it for --delete: {exc.strerror or exc}") from exc
        removed.append(rel)
    needed = {"/".join(f.split("/")[:i]) for f in artifact_files for i in range(1, f.count("/") + 1)}
    parents = sorted({os.path.dirname(r) for r in extra if "/" in r}, key=lambda p: -p.count("/"))
    for rel_dir in parents:
        while rel_dir and rel_dir not in needed:
            with contextlib.suppress(OSError):
                os.rmdir(os.path.join(dest, *rel_dir.split("/")))
                removed.append(rel_dir + "/")
            rel_dir = os.path.dirname(rel_dir)
    return removed


__all__ = [
    "ABSENT",
    "DIFFERS",
    "SAME",
    "Placement",
    "check_parents",
    "delete_extra",
    "extra_files",
    "make_parents",
    "placement",
    "publish",
]
