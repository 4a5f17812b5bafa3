"""The node cache's content-addressed store: an OCI image layout of committed, verified blobs.

Layout (under the cache root, one filesystem so renames and hard links work)::

    oci-layout, index.json, blobs/sha256/<hex>     the store (``skopeo`` reads it as ``oci:DIR``)
    ingest/<hex>.partial                           a resumable download in progress
    locks/<hex>.lock                               per-digest file locks
    quarantine/<hex>.<ns>                          a blob ``cache verify`` found corrupt

A blob becomes visible at ``blobs/sha256/<hex>`` only after its size and sha256 match: it is
written to ``ingest/`` (same filesystem), fsynced, made read-only, renamed, and the directory
fsynced. A blob counts as present only if it is a regular, read-only file of the cache owner
that nobody else can write (``mount.modes``): a same-size file someone else put there is fetched
and verified again. Downloading and resuming live in ``mount.ingest`` (through the one blob
writer, ``modelpack.transfer.blob_writer``); this module owns the
paths, the commit step, ``index.json``, quarantine and deletion.

A blob found corrupt is moved out of ``blobs/`` into ``quarantine/`` with one rename before
anything else of a repair changes, so whatever interrupts the repair, the store never offers it
again (``has()`` is false, the next pull downloads it afresh), and a snapshot published before
the quarantine is known to hold it (``quarantined_since``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import stat
import time
from typing import Any

from modelpack.mediatypes import MEDIA_TYPE_OCI_INDEX
from modelpack.mount.clock import age_since
from modelpack.mount.locks import default_lock_timeout, exclusive_lock, is_locked
from modelpack.mount.modes import (
    DIR_MODE,
    FILE_MODE,
    PRIVATE_DIR_MODE,
    READ_ONLY_FILE_MODE,
    cache_owner,
    ensure_dir,
    ensure_root,
    open_private,
    read_trusted,
    trusted_file,
)
from modelpack.mount.removals import Removal

from modelpack.boundedjson import loads_object
from modelpack.errors import ModelpackError, NotFoundError, StoreError
from modelpack.files import TEMP_PREFIX, atomic_write_bytes, fsync_dir
from modelpack.oci.descriptor import Descriptor
from modelpack.oci.digest import Digest
from modelpack.transfer.blob_writer import Landing, Partial, PrivateTemp, open_writer

PARTIAL_SUFFIX = ".partial"
LAYOUT_FILE = b'{"imageLayoutVersion":"1.0.0"}'
MAX_INDEX_BYTES = 64 * 1024 * 1024
MAX_SMALL_BLOB_BYTES = 4 * 1024 * 1024
#: an unlocked temp file this old is a dead writer's; an unheld partial this old is not resumed
TEMP_TTL_S = 3600.0
PARTIAL_TTL_S = 86400.0
#: quarantined blobs are kept this long (evidence for a person), then swept
QUARANTINE_TTL_S = 7 * 86400.0
#: what a person does about a full disk under the cache
FULL_CACHE_HINT = "free space or run 'modelpack cache gc'"
#: published snapshots (``mount.snapshots``)
SNAPSHOTS_DIR = "snapshots"
#: the directories of the other parts of a node cache that its readers list (snapshots, refs and
#: pins, running pulls' leases, variant index records: ``mount.cache``), created with the store
#: before its ``oci-layout`` so that a cache a reader finds has every one of them
READER_DIRS = (
    (SNAPSHOTS_DIR, DIR_MODE),
    ("refs", DIR_MODE),
    ("pins", DIR_MODE),
    ("leases", PRIVATE_DIR_MODE),
    ("indexes", DIR_MODE),
)


class Store:
    """Content-addressed blobs + manifests, readable as an OCI layout by other tools.

    ``create=False`` opens an existing cache only (``NotFoundError`` otherwise) and creates
    nothing: maintenance commands must not turn a mistyped ``--cache`` into a new cache, and a
    reader of another uid (a serving container) cannot create anything anyway.
    """

    def __init__(self, root: str, *, create: bool = True, lock_timeout: float | None = None) -> None:
        self.root = os.path.abspath(root)
        self.blobs_dir = os.path.join(self.root, "blobs", "sha256")
        self.ingest_dir = os.path.join(self.root, "ingest")
        self.locks_dir = os.path.join(self.root, "locks")
        self.quarantine_dir = os.path.join(self.root, "quarantine")
        self.index_path = os.path.join(self.root, "index.json")
        self.index_lock_path = os.path.join(self.root, ".index.lock")
        self.lock_timeout = default_lock_timeout() if lock_timeout is None else lock_timeout
        self.writable = create
        if create:
            try:
                self.owner = ensure_root(self.root)
                self._create_layout()
            except OSError as exc:
                # a reader: another uid, or the cache mounted read-only into a serving container
                if exc.errno not in (errno.EROFS, errno.EACCES, errno.EPERM) or not self._exists():
                    raise
                self.writable = False
                self.owner = cache_owner(self.root)
        else:
            if not self._exists():
                raise NotFoundError(
                    f"{self.root}: no node cache here (no such directory, or no oci-layout file in it); "
                    "check --cache / $MODELPACK_CACHE, or pull a model into it first"
                )
            self.owner = cache_owner(self.root)

    def _exists(self) -> bool:
        return os.path.isfile(os.path.join(self.root, "oci-layout"))

    def _create_layout(self) -> None:
        """Create what is missing, ``oci-layout`` last: that file is what makes a directory a
        cache to its readers (``create=False``), so a process killed while it first creates
        one leaves either no cache yet or one with every part a reader lists (the directories
        below and ``READER_DIRS``), never a half-made cache that ``cache verify`` rejects."""
        ensure_dir(os.path.join(self.root, "blobs"), DIR_MODE, self.owner)
        for path, mode in (
            (self.blobs_dir, DIR_MODE),
            (self.ingest_dir, PRIVATE_DIR_MODE),
            (self.locks_dir, PRIVATE_DIR_MODE),
            *((os.path.join(self.root, name), dir_mode) for name, dir_mode in READER_DIRS),
        ):
            ensure_dir(path, mode, self.owner)
        if read_trusted(self.index_path, self.owner, MAX_INDEX_BYTES) is None:
            self._write_index(_empty_index())
        # OCILayoutTarget would create it 0644 (lockable by anyone who can read the cache)
        os.close(open_private(self.index_lock_path, os.O_RDWR, self.owner))
        layout = os.path.join(self.root, "oci-layout")
        if read_trusted(layout, self.owner, len(LAYOUT_FILE)) != LAYOUT_FILE:
            atomic_write_bytes(layout, LAYOUT_FILE, mode=FILE_MODE)

    # ------------------------------------------------------------------ paths
    def blob_path(self, digest: str) -> str:
        return os.path.join(self.blobs_dir, Digest(digest).hex)

    def partial_path(self, digest: str) -> str:
        return os.path.join(self.ingest_dir, Digest(digest).hex + PARTIAL_SUFFIX)

    def lock_path(self, digest: str) -> str:
        return os.path.join(self.locks_dir, Digest(digest).hex + ".lock")

    def trusted(self, st: os.stat_result, *, read_only: bool = False) -> bool:
        """A regular file the cache owner (or root) wrote and nobody else can write."""
        return trusted_file(st, self.owner, read_only=read_only)

    def has(self, desc: Descriptor) -> bool:
        """Committed with the expected size. Size and provenance only: committed blobs were hashed
        on the way in, and a blob the cache did not commit (another owner, writable) is absent."""
        try:
            st = os.lstat(self.blob_path(desc.digest))
        except FileNotFoundError:
            return False
        return st.st_size == desc.size and self.trusted(st, read_only=True)

    # ------------------------------------------------------------------ committing
    def put_bytes(self, desc: Descriptor, data: bytes) -> None:
        """Commit small content (manifests, configs) through the blob writer: checked against
        ``desc``, fsynced, read-only, renamed, directory fsynced. On any failure (a full disk
        included) the temp file is removed and the error names the blob's path."""
        if self.has(desc):
            return
        landing = Landing(
            self.blob_path(desc.digest), mode=READ_ONLY_FILE_MODE, full_disk_hint=FULL_CACHE_HINT
        )
        with open_writer(LockedTemp(self.ingest_dir, desc.digest), desc) as w:
            w.write(data, landing)
            w.commit(desc.size, desc.digest, landing)

    def read_small(self, digest: str, limit: int = MAX_SMALL_BLOB_BYTES) -> bytes:
        """A small committed blob (manifest, config); callers verify it against its digest."""
        path = self.blob_path(digest)
        data = read_trusted(path, self.owner, limit, read_only=True)
        if data is None:
            if os.path.lexists(path):
                raise StoreError(f"{path}: not committed by the node cache (wrong owner or writable)")
            raise FileNotFoundError(path)
        if len(data) > limit:
            raise StoreError(f"{path}: larger than {limit} bytes")
        return data

    # ------------------------------------------------------------------ index (manifests)
    def _read_index(self) -> dict[str, Any]:
        """index.json as the cache wrote it; an absent or foreign one reads as empty."""
        raw = read_trusted(self.index_path, self.owner, MAX_INDEX_BYTES)
        if raw is None:
            return _empty_index()
        doc = loads_object(raw, what=self.index_path, max_bytes=MAX_INDEX_BYTES)
        manifests = doc.get("manifests", [])
        if not isinstance(manifests, list) or not all(isinstance(e, dict) for e in manifests):
            raise StoreError(f"{self.index_path}: 'manifests' is not a list of descriptors")
        doc["manifests"] = manifests
        return doc

    def add_manifest(
        self,
        raw: bytes,
        media_type: str,
        reference: str | None = None,
        *,
        annotations: dict[str, str] | None = None,
        artifact_type: str | None = None,
    ) -> None:
        """Record a manifest in index.json (by digest; ``reference`` as an annotation; a kept
        signature referrer with its ``artifactType`` and annotations, ``mount.kept_referrers``)."""
        desc = Descriptor(media_type, Digest.from_bytes(raw), len(raw), artifact_type=artifact_type)
        self.put_bytes(desc, raw)
        with self._index_lock(self.lock_timeout):
            doc = self._read_index()
            entries: list[dict[str, Any]] = doc["manifests"]
            if not any(e.get("digest") == desc.digest for e in entries):
                entry = desc.to_dict()
                if reference or annotations:
                    entry["annotations"] = dict(annotations or {})
                if reference:
                    entry["annotations"]["io.modelpack.cache.reference"] = reference
                entries.append(entry)
                self._write_index(doc)

    def index_entries(self) -> list[dict[str, Any]]:
        """index.json's manifest entries as the cache wrote them (empty when foreign or absent)."""
        return list(self._read_index()["manifests"])

    def remove_manifest(self, digest: str, *, timeout: float | None = None) -> None:
        """Drop a manifest from index.json, and the signature referrers kept for it."""
        with self._index_lock(self.lock_timeout if timeout is None else timeout):
            doc = self._read_index()
            before = len(doc["manifests"])
            doc["manifests"] = [
                e
                for e in doc["manifests"]
                if e.get("digest") != digest
                and not (
                    isinstance(e.get("annotations"), dict)
                    and e["annotations"].get("io.modelpack.cache.subject") == digest
                )
            ]
            if len(doc["manifests"]) != before:
                self._write_index(doc)

    def manifest_digests(self) -> list[str]:
        return [str(e.get("digest")) for e in self._read_index()["manifests"] if e.get("digest")]

    def _index_lock(self, timeout: float) -> contextlib.AbstractContextManager[int]:
        # Same lock file as OCILayoutTarget so both writers serialise on index.json.
        return exclusive_lock(self.index_lock_path, timeout=timeout, what="node cache index.json")

    def _write_index(self, doc: dict[str, Any]) -> None:
        atomic_write_bytes(self.index_path, json.dumps(doc, separators=(",", ":")).encode(), mode=FILE_MODE)

    # ------------------------------------------------------------------ quarantine
    def quarantine_blob(self, digest: str) -> str | None:
        """Move a blob found corrupt out of ``blobs/`` (one rename, then both directories
        fsynced); the path it now has, or None when it was not there."""
        ensure_dir(self.quarantine_dir, PRIVATE_DIR_MODE, self.owner)
        dst = os.path.join(self.quarantine_dir, f"{Digest(digest).hex}.{time.time_ns()}")
        try:
            os.rename(self.blob_path(digest), dst)
        except FileNotFoundError:
            return None
        fsync_dir(self.blobs_dir)
        fsync_dir(self.quarantine_dir)
        return dst

    def quarantined_since(self, digests: set[str], since: float) -> set[str]:
        """Which of ``digests`` were quarantined at or after ``since`` (a snapshot's creation
        time: a snapshot published before its blob was found corrupt holds the corrupt bytes).
        One directory listing, none when nothing was ever quarantined."""
        try:
            names = os.listdir(self.quarantine_dir)
        except (FileNotFoundError, NotADirectoryError, PermissionError):
            return set()
        found = set()
        for name in names:
            hexd, _, ns = name.partition(".")
            digest = "sha256:" + hexd
            if digest in digests and ns.isdigit() and int(ns) / 1e9 >= since:
                found.add(digest)
        return found

    # ------------------------------------------------------------------ deletion & sweeping
    def remove_blob(self, digest: str) -> int:
        path = self.blob_path(digest)
        try:
            size = os.lstat(path).st_size
            os.unlink(path)
            return size
        except FileNotFoundError:
            return 0

    def blob_digests(self) -> list[str]:
        out = []
        for entry in os.scandir(self.blobs_dir):
            if len(entry.name) == 64 and not entry.name.startswith("."):
                out.append("sha256:" + entry.name)
        return out

    def partial_bytes(self, digest: str) -> int:
        """Bytes of a resumable partial download; a partial that is not the cache's counts as 0."""
        try:
            st = os.lstat(self.partial_path(digest))
        except FileNotFoundError:
            return 0
        return st.st_size if stat.S_ISREG(st.st_mode) and st.st_uid in (self.owner, 0) else 0

    def sweep(self, *, temp_ttl: float = TEMP_TTL_S, partial_ttl: float = PARTIAL_TTL_S) -> list[str]:
        """Remove what a crash left behind (``leftovers``); returns the removed paths."""
        return [
            r.what
            for r in self.leftovers(temp_ttl=temp_ttl, partial_ttl=partial_ttl)
            if self.remove_leftover(r)
        ]

    def leftovers(self, *, temp_ttl: float = TEMP_TTL_S, partial_ttl: float = PARTIAL_TTL_S) -> list[Removal]:
        """What a crash left behind, without removing anything (GC's plan and its dry run).

        A temp file (``.tmp-modelpack-*``) goes when no writer holds its lock (``LockedTemp``:
        its writer holds a flock on it while it writes, so liveness never rests on an mtime a
        clock step or a restored backup can move) and it is older than ``temp_ttl``; a
        ``.partial`` goes when nobody holds its digest lock and either its blob is committed or
        it is older than ``partial_ttl`` (a younger one is kept so the next pull can resume it);
        a quarantined blob goes after ``QUARANTINE_TTL_S``.
        """
        out: list[Removal] = []
        now = time.time()
        with contextlib.suppress(FileNotFoundError, PermissionError):
            for entry in list(os.scandir(self.quarantine_dir)):
                with contextlib.suppress(FileNotFoundError):
                    st = entry.stat(follow_symlinks=False)
                    if age_since(entry.path, st.st_ctime, now) >= QUARANTINE_TTL_S:
                        out.append(Removal("quarantined", entry.path, st.st_size, "past the quarantine TTL"))
        for directory in (self.blobs_dir, self.ingest_dir, self.root):
            for entry in list(os.scandir(directory)):
                if not entry.name.startswith(TEMP_PREFIX):
                    continue
                with contextlib.suppress(FileNotFoundError):
                    st = entry.stat(follow_symlinks=False)
                    if (
                        stat.S_ISREG(st.st_mode)
                        and age_since(entry.path, st.st_mtime, now) >= temp_ttl
                        and not is_locked(entry.path)
                    ):
                        out.append(
                            Removal("temp", entry.path, st.st_size, "no writer holds it, older than the TTL")
                        )
        for entry in list(os.scandir(self.ingest_dir)):
            if not entry.name.endswith(PARTIAL_SUFFIX):
                continue
            try:
                digest = Digest.from_hex(entry.name[: -len(PARTIAL_SUFFIX)])
            except ModelpackError:
                continue
            if is_locked(self.lock_path(digest)):
                continue
            with contextlib.suppress(FileNotFoundError):
                st = entry.stat(follow_symlinks=False)
                if os.path.exists(self.blob_path(digest)):
                    out.append(Removal("partial", entry.path, st.st_size, "its blob is committed"))
                elif age_since(entry.path, st.st_mtime, now) >= partial_ttl:
                    out.append(Removal("partial", entry.path, st.st_size, "nobody resumed it within the TTL"))
        return out

    def remove_leftover(self, leftover: Removal) -> bool:
        """Remove one of ``leftovers``, unless a writer took its lock since; True when gone."""
        if leftover.kind == "temp" and is_locked(leftover.what):
            return False
        if leftover.kind == "partial":
            hexd = os.path.basename(leftover.what)[: -len(PARTIAL_SUFFIX)]
            if is_locked(self.lock_path(Digest.from_hex(hexd))):
                return False
        try:
            os.unlink(leftover.what)
        except FileNotFoundError:
            return False
        return True

    def size_on_disk(self) -> int:
        total = 0
        for entry in os.scandir(self.blobs_dir):
            with contextlib.suppress(FileNotFoundError):
                total += entry.stat(follow_symlinks=False).st_size
        for directory in (self.ingest_dir, self.quarantine_dir):
            # a reader of another uid cannot list ingest/ or quarantine/
            with contextlib.suppress(PermissionError, FileNotFoundError):
                for entry in os.scandir(directory):
                    with contextlib.suppress(FileNotFoundError):
                        total += entry.stat(follow_symlinks=False).st_size
        return total


class LockedTemp:
    """A ``PrivateTemp`` whose writer holds an exclusive flock on it while it writes: the lock is
    how GC tells a live writer's temp file from a dead one's (``Store.leftovers``), whatever its
    mtime says. The lock goes with the file descriptor, so a writer that dies releases it."""

    def __init__(self, directory: str, digest: Digest, *, tag: str = "") -> None:
        self._temp = PrivateTemp(directory, digest, tag=tag)

    def open(self) -> Partial:
        partial = self._temp.open()
        fcntl.flock(partial.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a fresh O_EXCL file: nobody else has it
        return partial


def _empty_index() -> dict[str, Any]:
    return {"schemaVersion": 2, "mediaType": MEDIA_TYPE_OCI_INDEX, "manifests": []}
