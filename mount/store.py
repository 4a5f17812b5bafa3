"""The node cache's content-addressed store: an OCI image layout of committed, verified blobs.

Layout (under the cache root, one filesystem so renames and hard links work)::

    oci-layout, index.json, blobs/sha256/<hex>     the store (``skopeo`` reads it as ``oci:DIR``)
    ingest/<hex>.partial                           a resumable download in progress
    locks/<hex>.lock                               per-digest file locks

A blob becomes visible at ``blobs/sha256/<hex>`` only after its size and sha256 match: it is
written to ``ingest/`` (same filesystem), fsynced, made read-only, renamed, and the directory
fsynced. Downloading and resuming live in ``mount.ingest``; this module owns the paths, the
commit step, ``index.json`` and deletion.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import uuid
from typing import Any

from modelpack.mount.locks import exclusive_lock, is_locked

from modelpack.errors import ModelpackError, StoreError
from modelpack.files import TEMP_PREFIX, atomic_write_bytes, fsync_dir
from modelpack.oci.descriptor import Descriptor
from modelpack.oci.digest import Digest
from modelpack.targets.layout import OCILayoutTarget

PARTIAL_SUFFIX = ".partial"


class Store:
    """Content-addressed blobs + manifests, readable as an OCI layout by other tools."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        os.makedirs(self.root, exist_ok=True)
        self.layout = OCILayoutTarget(self.root, create=True, link="copy")
        self.blobs_dir = os.path.join(self.root, "blobs", "sha256")
        self.ingest_dir = os.path.join(self.root, "ingest")
        self.locks_dir = os.path.join(self.root, "locks")
        os.makedirs(self.ingest_dir, exist_ok=True)
        os.makedirs(self.locks_dir, exist_ok=True)

    # ------------------------------------------------------------------ paths
    def blob_path(self, digest: str) -> str:
        return os.path.join(self.blobs_dir, Digest(digest).hex)

    def partial_path(self, digest: str) -> str:
        return os.path.join(self.ingest_dir, Digest(digest).hex + PARTIAL_SUFFIX)

    def lock_path(self, digest: str) -> str:
        return os.path.join(self.locks_dir, Digest(digest).hex + ".lock")

    def has(self, desc: Descriptor) -> bool:
        """Committed with the expected size. Size only: committed blobs were hashed on the way in."""
        try:
            return os.stat(self.blob_path(desc.digest)).st_size == desc.size
        except FileNotFoundError:
            return False

    # ------------------------------------------------------------------ committing
    def commit(self, tmp: str, digest: str) -> None:
        """Publish verified content written to ``tmp`` (same filesystem) as blob ``digest``."""
        final = self.blob_path(digest)
        os.chmod(tmp, 0o444)
        os.replace(tmp, final)
        fsync_dir(self.blobs_dir)

    def put_bytes(self, desc: Descriptor, data: bytes) -> None:
        """Commit small already-verified content (manifests, configs)."""
        if self.has(desc):
            return
        tmp = os.path.join(self.ingest_dir, f"{TEMP_PREFIX}{desc.digest.hex[:16]}-{uuid.uuid4().hex[:8]}")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        self.commit(tmp, desc.digest)

    def read_small(self, digest: str, limit: int = 4 * 1024 * 1024) -> bytes:
        with open(self.blob_path(digest), "rb") as f:
            data = f.read(limit + 1)
        if len(data) > limit:
            raise StoreError(f"{self.blob_path(digest)}: larger than {limit} bytes")
        return data

    # ------------------------------------------------------------------ index (manifests)
    def add_manifest(self, raw: bytes, media_type: str, reference: str | None = None) -> None:
        """Record a manifest in index.json (by digest; ``reference`` as a ref.name annotation)."""
        desc = Descriptor(media_type, Digest.from_bytes(raw), len(raw))
        self.put_bytes(desc, raw)
        with self._index_lock():
            doc = self.layout._read_index()
            entries: list[dict[str, Any]] = doc["manifests"]
            if not any(e.get("digest") == desc.digest for e in entries):
                entry = desc.to_dict()
                if reference:
                    entry["annotations"] = {"io.modelpack.cache.reference": reference}
                entries.append(entry)
                self._write_index(doc)

    def remove_manifest(self, digest: str) -> None:
        with self._index_lock():
            doc = self.layout._read_index()
            before = len(doc["manifests"])
            doc["manifests"] = [e for e in doc["manifests"] if e.get("digest") != digest]
            if len(doc["manifests"]) != before:
                self._write_index(doc)

    def manifest_digests(self) -> list[str]:
        return [str(e.get("digest")) for e in self.layout._read_index()["manifests"] if e.get("digest")]

    def _index_lock(self) -> contextlib.AbstractContextManager[int]:
        # Same lock file as OCILayoutTarget so both writers serialise on index.json.
        return exclusive_lock(os.path.join(self.root, ".index.lock"))

    def _write_index(self, doc: dict[str, Any]) -> None:
        atomic_write_bytes(
            os.path.join(self.root, "index.json"), json.dumps(doc, separators=(",", ":")).encode()
        )

    # ------------------------------------------------------------------ deletion & sweeping
    def remove_blob(self, digest: str) -> int:
        path = self.blob_path(digest)
        try:
            size = os.stat(path).st_size
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
        try:
            return os.stat(self.partial_path(digest)).st_size
        except FileNotFoundError:
            return 0

    def sweep(self, *, temp_ttl: float = 3600.0, partial_ttl: float = 86400.0) -> list[str]:
        """Remove what a crash left behind; returns the removed paths.

        Temp files (``.tmp-modelpack-*``) older than ``temp_ttl`` go; a ``.partial`` goes when
        nobody holds its digest lock and either its blob is committed or it is older than
        ``partial_ttl`` (a younger one is kept so the next pull can resume it).
        """
        removed: list[str] = []
        now = time.time()
        for directory in (self.blobs_dir, self.ingest_dir, self.root):
            for entry in list(os.scandir(directory)):
                if not entry.name.startswith(TEMP_PREFIX):
                    continue
                try:
                    if entry.is_file(follow_symlinks=False) and now - entry.stat().st_mtime >= temp_ttl:
                        os.unlink(entry.path)
                        removed.append(entry.path)
                except FileNotFoundError:
                    pass
        for entry in list(os.scandir(self.ingest_dir)):
            if not entry.name.endswith(PARTIAL_SUFFIX):
                continue
            hexd = entry.name[: -len(PARTIAL_SUFFIX)]
            try:
                digest = Digest.from_hex(hexd)
            except ModelpackError:
                continue
            if is_locked(self.lock_path(digest)):
                continue
            try:
                committed = os.path.exists(self.blob_path(digest))
                if committed or now - entry.stat().st_mtime >= partial_ttl:
                    os.unlink(entry.path)
                    removed.append(entry.path)
            except FileNotFoundError:
                pass
        return removed

    def size_on_disk(self) -> int:
        total = 0
        for entry in os.scandir(self.blobs_dir):
            with contextlib.suppress(FileNotFoundError):
                total += entry.stat(follow_symlinks=False).st_size
        for entry in os.scandir(self.ingest_dir):
            with contextlib.suppress(FileNotFoundError):
                total += entry.stat(follow_symlinks=False).st_size
        return total
