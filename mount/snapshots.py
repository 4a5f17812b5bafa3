"""Snapshots: a model's files at their paths, hard-linked from the store, read-only.

Per manifest digest ``<hex>`` under ``<cache>/snapshots/``::

    <hex>/          the files (hard links to blobs/sha256/…; extracted files for tar layers)
    <hex>.ready     the ready marker (JSON: digest, files); the ONLY thing a reader trusts
    <hex>.lease     readers hold a shared flock on it while they use the files; GC needs an
                    exclusive one to delete; its mtime is the last use (LRU)

A snapshot is built in a temp directory and renamed into place in one step; the marker is then
written atomically. A directory without a marker (a crash between the two) is never used: the
next pull replaces it. Deletion goes the other way: marker first, then the directory. A marker,
or a snapshot directory, that is not the cache owner's or that others can write vouches for
nothing (``mount.modes``). Waiting for a lease is bounded (``LockTimeoutError`` names the lease
file and its holder).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import stat
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from modelpack.mount.clock import age_since
from modelpack.mount.locks import flock_bounded, lock_holder_uids, pid_alive, try_exclusive
from modelpack.mount.modes import (
    DIR_MODE,
    LEASE_FILE_MODE,
    PRIVATE_DIR_MODE,
    READ_ONLY_DIR_MODE,
    READ_ONLY_FILE_MODE,
    ensure_dir,
    read_trusted,
    untrusted_reason,
)
from modelpack.mount.removals import Removal
from modelpack.mount.snapshot_files import SnapshotFile, materialise
from modelpack.mount.store import SNAPSHOTS_DIR, Store
from modelpack.mount.treewalk import make_read_only
from modelpack.mount.treewalk import remove_tree as _remove_tree

from modelpack.boundedjson import loads_object
from modelpack.errors import (
    DocumentError,
    ModelpackError,
    NotFoundError,
    SnapshotError,
    SnapshotInUseError,
)
from modelpack.files import TEMP_PREFIX, atomic_write_bytes, fsync_dir
from modelpack.oci.descriptor import Manifest
from modelpack.oci.digest import Digest

if TYPE_CHECKING:
    pass

MARKER_SUFFIX = ".ready"
LEASE_SUFFIX = ".lease"
MARKER_VERSION = 1
MAX_MARKER_BYTES = 16 * 1024 * 1024
# a temp file another process is writing (a marker, a record) is left alone for this long
TEMP_FILE_TTL_S = 3600.0


@dataclass
class SnapshotInfo:
    digest: Digest
    path: str
    files: list[SnapshotFile]
    created: float
    last_used: float = 0.0
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)

    def blob_digests(self) -> set[str]:
        return set(self.meta.get("blobs", []))


class Snapshots:
    def __init__(self, store: Store) -> None:
        self.store = store
        self.dir = os.path.join(store.root, SNAPSHOTS_DIR)
        if store.writable:
            ensure_dir(self.dir, DIR_MODE, store.owner)

    def path(self, digest: str) -> str:
        return os.path.join(self.dir, Digest(digest).hex)

    def marker_path(self, digest: str) -> str:
        return self.path(digest) + MARKER_SUFFIX

    def lease_path(self, digest: str) -> str:
        return self.path(digest) + LEASE_SUFFIX

    def trust_path(self, digest: str) -> str:
        """Which trusted keys verified this digest (written by the cache after verification)."""
        return self.path(digest) + ".trust.json"

    # ------------------------------------------------------------------ read side
    def ready(self, digest: str) -> SnapshotInfo | None:
        """The snapshot if its marker says it is ready for ``digest``; None otherwise. No hashing.

        Only a marker and a directory the cache owner wrote, and nobody else can write, count."""
        marker = self.marker_path(digest)
        raw = read_trusted(marker, self.store.owner, MAX_MARKER_BYTES)
        if raw is None:
            return None
        if len(raw) > MAX_MARKER_BYTES:
            raise SnapshotError(f"{marker}: larger than {MAX_MARKER_BYTES} bytes")
        try:
            doc = loads_object(raw, what=f"ready marker {marker}", max_bytes=MAX_MARKER_BYTES)
            if doc.get("digest") != digest or doc.get("version") != MARKER_VERSION:
                raise ValueError("marker names another digest or version")
            files = [
                SnapshotFile(str(f["path"]), str(f["digest"]), int(f["size"]), bool(f["linked"]))
                for f in doc["files"]
            ]
        except (DocumentError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise SnapshotError(f"{marker}: invalid ready marker ({exc}); run 'modelpack cache rm'") from exc
        path = self.path(digest)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return None
        if not stat.S_ISDIR(st.st_mode) or untrusted_reason(st, self.store.owner) is not None:
            return None
        try:
            last_used = os.stat(self.lease_path(digest)).st_mtime
        except FileNotFoundError:
            last_used = float(doc.get("created", 0))
        return SnapshotInfo(Digest(digest), path, files, float(doc.get("created", 0)), last_used, doc)

    def list_ready(self) -> list[SnapshotInfo]:
        out = []
        for entry in os.scandir(self.dir):
            if entry.name.endswith(MARKER_SUFFIX) and not entry.name.startswith("."):
                hexd = entry.name[: -len(MARKER_SUFFIX)]
                with contextlib.suppress(ModelpackError):
                    info = self.ready("sha256:" + hexd)
                    if info is not None:
                        out.append(info)
        return out

    def touch(self, digest: str) -> None:
        """Record a use (LRU) on the lease file's mtime: one utime, no content write. Best effort:
        a read-only cache, or a reader of another uid, cannot record it, and a read never fails
        for that (the owner's next use records it)."""
        lease = self.lease_path(digest)
        try:
            os.utime(lease, follow_symlinks=False)
        except FileNotFoundError:
            with contextlib.suppress(OSError):
                os.close(self._open_lease(lease))
        except OSError as exc:
            if exc.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
                raise

    def _open_lease(self, lease: str) -> int:
        """The lease file, created ``0644`` (readers of other uids take shared locks on it)."""
        try:
            fd = os.open(lease, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, LEASE_FILE_MODE)
        except OSError as exc:
            # A serving container may see the cache read-only, or be another uid: a shared flock
            # needs no write access.
            if exc.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
                raise
            return os.open(lease, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with contextlib.suppress(OSError):
            st = os.fstat(fd)
            if st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) != LEASE_FILE_MODE:
                os.fchmod(fd, LEASE_FILE_MODE)
        return fd

    @contextlib.contextmanager
    def lease(self, digest: str, *, timeout: float | None = None) -> Iterator[SnapshotInfo]:
        """Hold a reader lease (shared flock) while the snapshot's files are in use.

        GC holds the lease exclusively only for the moment it deletes, so a wait longer than
        ``timeout`` (default: the store's ``lock_timeout``) means someone else is holding it:
        ``LockTimeoutError`` names the lease file and the holder."""
        lease = self.lease_path(digest)
        limit = self.store.lock_timeout if timeout is None else timeout
        while True:
            fd = self._open_lease(lease)
            try:
                flock_bounded(fd, fcntl.LOCK_SH, lease, limit, f"reader lease of snapshot {digest}")
                try:
                    same = os.fstat(fd).st_ino == os.stat(lease).st_ino
                except FileNotFoundError:
                    same = False
            except BaseException:
                os.close(fd)
                raise
            if same:
                break
            os.close(fd)  # GC replaced the lease file while we waited; lock the current one
        try:
            info = self.ready(digest)
            if info is None:
                raise NotFoundError(f"snapshot {digest} is not ready in {self.store.root}")
            with contextlib.suppress(OSError):
                os.utime(fd)
            yield info
        finally:
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def lease_holders(self, digest: str) -> list[int | None] | None:
        """None when no reader holds the lease; else the uid of each holder (None where it cannot
        be told, e.g. a holder in another pid namespace)."""
        lease = self.lease_path(digest)
        fd = try_exclusive(lease)
        if fd is not None:
            os.close(fd)
            return None
        if not os.path.lexists(lease):
            return None
        return lock_holder_uids(lease) or [None]

    def in_use(self, digest: str) -> bool:
        fd = try_exclusive(self.lease_path(digest))
        if fd is None:
            return os.path.exists(self.lease_path(digest))
        os.close(fd)
        return False

    # ------------------------------------------------------------------ build & publish
    def build(
        self,
        manifest: Manifest,
        config_raw: bytes | None,
        *,
        extra: dict[str, Any] | None = None,
        max_expanded: int | None = None,
        expansion_limit: str = "the limit",
    ) -> str:
        """Materialise ``manifest`` from committed blobs into a fresh temp directory; returns it.

        ``max_expanded`` caps the bytes all tar layers together may write (what is left of the
        quota and the free space, described by ``expansion_limit``): a layer that would cross it
        raises ``ExpansionLimitError`` before the member is written, and the temp directory is
        removed."""
        tmp = os.path.join(
            self.dir, f"{TEMP_PREFIX}{manifest.digest.hex[:16]}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        )
        os.mkdir(tmp, PRIVATE_DIR_MODE)  # private until published read-only
        try:
            files = materialise(self.store, manifest, config_raw, tmp, max_expanded, expansion_limit)
            meta = {
                **(extra or {}),
                "version": MARKER_VERSION,
                "digest": str(manifest.digest),
                "files": [f.__dict__ for f in files],
                "bytes_total": manifest.config.size
                + sum({str(x.digest): x.size for x in manifest.layers}.values()),
                "blobs": sorted(
                    {str(manifest.config.digest), *(str(layer.digest) for layer in manifest.layers)}
                ),
            }
            atomic_write_bytes(os.path.join(tmp, TEMP_PREFIX + "meta.json"), json.dumps(meta).encode())
            return tmp
        except BaseException:
            remove_tree(tmp)
            raise

    def publish(self, tmp: str, digest: str) -> SnapshotInfo:
        """Rename ``tmp`` into place, then write the marker.

        Normally the caller holds the manifest lock; without it (a stale lock) several
        publishers may race. Snapshots are content-addressed, so any complete one is as good as
        another: whoever finds a ready snapshot discards its own, and a directory without a
        marker is moved aside (an atomic rename only one racer wins) before retrying.
        """
        final = self.path(digest)
        meta_tmp = os.path.join(tmp, TEMP_PREFIX + "meta.json")
        with open(meta_tmp, "rb") as f:
            meta = loads_object(f.read(MAX_MARKER_BYTES + 1), what=meta_tmp, max_bytes=MAX_MARKER_BYTES)
        os.unlink(meta_tmp)
        meta["created"] = time.time()
        _make_read_only(tmp)
        # the directory's own mode is set through this fd after the rename: never through a path
        tmp_fd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            for _ in range(50):
                info = self.ready(digest)
                if info is not None:
                    return info  # someone else published the same content
                try:
                    os.rename(tmp, final)
                except OSError as exc:
                    if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
                        raise
                    # A directory without a marker: a crash between rename and marker, or a racer
                    # about to write its marker. Never trusted; move it aside and try again.
                    aside = os.path.join(
                        self.dir,
                        f"{TEMP_PREFIX}old-{Digest(digest).hex[:16]}-{os.getpid()}-{uuid.uuid4().hex[:6]}",
                    )
                    with contextlib.suppress(FileNotFoundError):
                        os.rename(final, aside)
                        remove_tree(aside)
                    continue
                os.fchmod(tmp_fd, READ_ONLY_DIR_MODE)
                fsync_dir(self.dir)
                self.touch(digest)
                atomic_write_bytes(
                    self.marker_path(digest),
                    json.dumps(meta, sort_keys=True).encode(),
                    mode=READ_ONLY_FILE_MODE,
                )
                info = self.ready(digest)
                if info is not None:
                    return info
                time.sleep(0.01)  # a racer moved our directory aside; its own publish follows
            raise SnapshotError(f"{final}: could not publish (persistent concurrent replacement)")
        finally:
            os.close(tmp_fd)
            if os.path.lexists(tmp):
                remove_tree(tmp)

    # ------------------------------------------------------------------ removal
    def remove(self, digest: str, *, force: bool = False) -> bool:
        """Unpublish (marker first) and delete; refuses while a reader holds the lease."""
        lease = self.lease_path(digest)
        fd = try_exclusive(lease)
        if fd is None and os.path.exists(lease) and not force:
            raise SnapshotInUseError(f"snapshot {digest} is in use (a reader holds {lease})")
        try:
            existed = False
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.marker_path(digest))
                existed = True
            fsync_dir(self.dir)
            final = self.path(digest)
            if os.path.lexists(final):
                existed = True
                aside = os.path.join(
                    self.dir,
                    f"{TEMP_PREFIX}rm-{Digest(digest).hex[:16]}-{os.getpid()}-{uuid.uuid4().hex[:6]}",
                )
                os.rename(final, aside)
                remove_tree(aside)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.trust_path(digest))
            with contextlib.suppress(FileNotFoundError):
                os.unlink(lease)
            return existed
        finally:
            if fd is not None:
                os.close(fd)

    def sweep(self, *, temp_ttl: float = TEMP_FILE_TTL_S) -> list[str]:
        """Remove what crashed builders and writers left in ``snapshots/`` (``leftovers``);
        returns what is really gone."""
        return [r.what for r in self.leftovers(temp_ttl=temp_ttl) if self.remove_leftover(r)]

    def leftovers(self, *, temp_ttl: float = TEMP_FILE_TTL_S) -> list[Removal]:
        """What crashed builders and writers left in ``snapshots/``, removing nothing.

        ``.tmp-modelpack-*`` directories are snapshot builds (names end in ``-<pid>-<random>``):
        a live builder's is left alone. ``.tmp-modelpack-*`` files are markers and records being
        written atomically (``mkstemp`` names, no pid): only when older than ``temp_ttl``, as the
        store does. Lease and trust files of snapshots that no longer exist, unless held."""
        out: list[Removal] = []
        now = time.time()
        for entry in list(os.scandir(self.dir)):
            if not entry.name.startswith(TEMP_PREFIX):
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            age = age_since(entry.path, st.st_mtime, now)
            if not stat.S_ISDIR(st.st_mode):
                if age >= temp_ttl:  # a younger one may be another process's marker, being written
                    out.append(
                        Removal("build", entry.path, st.st_size, "a record's temp file, older than the TTL")
                    )
                continue
            parts = entry.name[len(TEMP_PREFIX) :].split("-")
            pid = int(parts[-2]) if len(parts) >= 3 and parts[-2].isdigit() else None
            if pid is not None and (pid == os.getpid() or pid_alive(pid)):
                continue
            if pid is None and age < temp_ttl:
                continue  # not one of our build names: only when clearly abandoned
            out.append(Removal("build", entry.path, tree_bytes(entry.path), "its builder is gone"))
        # lease/trust files of snapshots that no longer exist (a reader asked for a missing one)
        for entry in list(os.scandir(self.dir)):
            for suffix in (LEASE_SUFFIX, ".trust.json"):
                if not entry.name.endswith(suffix) or entry.name.startswith("."):
                    continue
                base = os.path.join(self.dir, entry.name[: -len(suffix)])
                if os.path.lexists(base) or os.path.exists(base + MARKER_SUFFIX):
                    continue
                if suffix == LEASE_SUFFIX and self._held(entry.path):
                    continue  # someone holds it right now
                with contextlib.suppress(FileNotFoundError):
                    size = entry.stat(follow_symlinks=False).st_size
                    out.append(Removal("record", entry.path, size, "its snapshot no longer exists"))
        return out

    @staticmethod
    def _held(path: str) -> bool:
        fd = try_exclusive(path)
        if fd is None:
            return os.path.lexists(path)
        os.close(fd)
        return False

    def remove_leftover(self, leftover: Removal) -> bool:
        """Remove one of ``leftovers`` (a lease someone took since stays); True when gone."""
        path = leftover.what
        if leftover.kind == "record" and path.endswith(LEASE_SUFFIX) and self._held(path):
            return False
        if os.path.isdir(path) and not os.path.islink(path):
            remove_tree(path)
            return not os.path.lexists(path)
        try:
            os.unlink(path)
        except FileNotFoundError:
            return False
        return True


def tree_bytes(path: str) -> int:
    """Bytes a tree's removal frees: its files that are not also linked elsewhere (a snapshot's
    hard links to blobs free nothing while the blob stays). Symlinks are never followed."""
    total = 0
    for top, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(top, name))
                if stat.S_ISREG(st.st_mode) and st.st_nlink == 1:
                    total += st.st_size
    return total


def _make_read_only(root: str) -> None:
    """Exactly 0444 files and 0555 directories below ``root``, whatever the umask made them,
    never through a symlink (``mount.treewalk``)."""
    make_read_only(root, file_mode=READ_ONLY_FILE_MODE, dir_mode=READ_ONLY_DIR_MODE)


def remove_tree(path: str) -> None:
    """Delete a tree of the cache (snapshots are read-only) without ever following a symlink out
    of it: a planted ``d -> /some/dir`` is unlinked, ``/some/dir`` untouched (``mount.treewalk``)."""
    _remove_tree(path)
