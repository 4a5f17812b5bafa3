"""The directory an asset pull materialises: what counts as already there, what may be replaced.

A compile cache is code the runtime loads (``dlopen``, imports, unpickling), so the destination is
trusted only as far as nobody else can have written it. A destination counts — as "this asset is
already here", or as "an earlier pull's directory this pull may replace" — only when:

- it is a real directory (not a symlink), and it and every entry in it, walked without following
  links, belong to the caller or root, are not writable by group or others, and are directories
  or regular files with one link (a hard link planted into it by another uid is refused);
- every directory above it is the caller's or root's and not writable by group or others
  unless sticky (else someone else could swap it after this check);
- for "already here": the marker the earlier pull wrote names this asset, and every file the
  marker lists hashes to the sha256 recorded when the file was extracted from the digest-checked
  layer (or copied from the node cache's verified snapshot). Files the runtime added since (new
  compiled graphs, written by the caller) may sit beside them.

Anything else raises ``AssetError`` naming the entry and why; nothing is used or replaced.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass

from modelpack.assets.format import MAX_ASSET_FILES
from modelpack.assets.kinds import MARKER_FILE
from modelpack.boundedjson import loads
from modelpack.errors import AssetError, DocumentError
from modelpack.oci.digest import sha256_file

MARKER_VERSION = 2
#: a marker lists every file with its digest; ~200 bytes an entry at the asset file bound
MAX_MARKER_BYTES = 256 * MAX_ASSET_FILES
#: entries walked in a destination (the asset's files plus what the runtime added)
MAX_WALKED_ENTRIES = 4 * MAX_ASSET_FILES


@dataclass(frozen=True)
class MarkedFile:
    path: str  # "/"-separated, relative to the destination
    size: int
    sha256: str  # "sha256:<hex>"


@dataclass(frozen=True)
class AssetMarker:
    """What an earlier pull wrote into the directory it materialised."""

    asset: str
    model: str
    kind: str
    fingerprint_digest: str
    files: tuple[MarkedFile, ...]

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def to_bytes(self) -> bytes:
        doc = {
            "version": MARKER_VERSION,
            "asset": self.asset,
            "model": self.model,
            "kind": self.kind,
            "fingerprintDigest": self.fingerprint_digest,
            "files": [[f.path, f.size, f.sha256] for f in self.files],
        }
        return json.dumps(doc, sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, raw: bytes, *, where: str) -> AssetMarker | None:
        """The marker, or None when it is not one this version of modelpack wrote."""
        try:
            doc = loads(raw, what=where, max_bytes=MAX_MARKER_BYTES)
        except DocumentError:
            return None
        if not isinstance(doc, dict) or doc.get("version") != MARKER_VERSION:
            return None
        names = ("asset", "model", "kind", "fingerprintDigest")
        if not all(isinstance(doc.get(k), str) for k in names) or not isinstance(doc.get("files"), list):
            return None
        files = []
        for item in doc["files"]:
            if not (
                isinstance(item, list)
                and len(item) == 3
                and isinstance(item[0], str)
                and isinstance(item[1], int)
                and isinstance(item[2], str)
            ):
                return None
            files.append(MarkedFile(item[0], item[1], item[2]))
        return cls(doc["asset"], doc["model"], doc["kind"], doc["fingerprintDigest"], tuple(files))


def write_marker(directory: str, marker: AssetMarker) -> None:
    """Write the marker into the (new, private) directory a pull is filling; 0644, fsynced."""
    path = os.path.join(directory, MARKER_FILE)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    with os.fdopen(fd, "wb") as f:
        os.fchmod(f.fileno(), 0o644)
        f.write(marker.to_bytes())
        f.flush()
        os.fsync(f.fileno())


def _caller_may_trust(path: str, st: os.stat_result) -> str:
    """Why ``path`` cannot have been written by the caller alone ("" when it can)."""
    if stat.S_ISLNK(st.st_mode):
        return "is a symlink"
    if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
        return "is not a regular file or directory"
    if st.st_uid not in (os.geteuid(), 0):
        return f"belongs to uid {st.st_uid}, not to this user ({os.geteuid()}) or root"
    if st.st_mode & 0o022:
        return f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})"
    if stat.S_ISREG(st.st_mode) and st.st_nlink != 1:
        return f"has {st.st_nlink} hard links (it may be someone else's file linked in)"
    return ""


def _refuse(path: str, why: str) -> AssetError:
    return AssetError(
        f"{path}: {why}; an asset is code the runtime loads, so this destination is neither used "
        "nor replaced (remove it, or pull into a directory only you can write)"
    )


def _check_parent(dest: str) -> None:
    """Every directory above ``dest`` (links resolved) is the caller's or root's and not writable
    by group or others unless sticky: else someone else could move ``dest`` after the check."""
    parent = os.path.realpath(os.path.dirname(os.path.abspath(dest)))
    while True:
        try:
            st = os.stat(parent)
        except FileNotFoundError:
            st = None  # created by this pull
        if st is not None:
            if st.st_uid not in (os.geteuid(), 0):
                raise _refuse(
                    parent,
                    f"holds the destination and belongs to uid {st.st_uid}: that user could swap the "
                    "directory after it was checked",
                )
            if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
                raise _refuse(
                    parent,
                    f"holds the destination and is writable by group or others without the sticky "
                    f"bit (mode {stat.S_IMODE(st.st_mode):04o}): anyone could swap the directory "
                    "after it was checked",
                )
        up = os.path.dirname(parent)
        if up == parent:
            return
        parent = up


def _walk_owned(dest: str) -> int:
    """Check ``dest`` and everything under it (no link followed); returns the entries below it."""
    count = 0
    stack = [dest]
    while stack:
        directory = stack.pop()
        try:
            with os.scandir(directory) as it:
                entries = list(it)
        except OSError as exc:
            raise AssetError(f"{directory}: cannot be read: {exc.strerror or exc}") from exc
        for entry in entries:
            count += 1
            if count > MAX_WALKED_ENTRIES:
                raise _refuse(dest, f"holds more than {MAX_WALKED_ENTRIES} entries")
            st = entry.stat(follow_symlinks=False)
            why = _caller_may_trust(entry.path, st)
            if why:
                raise _refuse(entry.path, why)
            if stat.S_ISDIR(st.st_mode):
                stack.append(entry.path)
    return count


def read_marker(dest: str) -> AssetMarker | None:
    """The marker in ``dest`` (not followed if a link), or None. Trust comes from ``inspect``."""
    path = os.path.join(dest, MARKER_FILE)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        raw = f.read(MAX_MARKER_BYTES + 1)
    if len(raw) > MAX_MARKER_BYTES:
        return None
    return AssetMarker.from_bytes(raw, where=f"asset marker {path}")


@dataclass(frozen=True)
class Destination:
    """What is at a destination: ``exists``; ``empty``; the earlier pull's ``marker`` (or None:
    a directory of the caller's own, e.g. a cache the runtime filled itself)."""

    path: str
    exists: bool
    empty: bool
    marker: AssetMarker | None


def inspect(dest: str) -> Destination:
    """Check ``dest`` as described in the module docstring; raises ``AssetError`` when another
    user could have written it."""
    _check_parent(dest)
    try:
        st = os.lstat(dest)
    except FileNotFoundError:
        return Destination(dest, False, True, None)
    if not stat.S_ISDIR(st.st_mode):
        raise AssetError(f"{dest}: exists and is not a directory; refusing to replace it")
    why = _caller_may_trust(dest, st)
    if why:
        raise _refuse(dest, why)
    entries = _walk_owned(dest)
    return Destination(dest, True, entries == 0, read_marker(dest) if entries else None)


def holds(dest: str, marker: AssetMarker) -> bool:
    """Whether every file the marker lists is in ``dest`` with its recorded size and sha256."""
    for f in marker.files:
        parts = f.path.split("/")
        if f.path.startswith("/") or any(p in ("", ".", "..") for p in parts):
            return False
        path = os.path.join(dest, *parts)
        try:
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode) or st.st_size != f.size:
                return False
            digest, _ = sha256_file(path)
        except OSError:
            return False
        if str(digest) != f.sha256:
            return False
    return True
