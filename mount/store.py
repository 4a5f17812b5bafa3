"""The node cache's content-addressed store: an OCI image layout with verified, resumable ingest.

Layout (under the cache root, one filesystem so renames and hard links work)::

    oci-layout, index.json, blobs/sha256/<hex>     the store (``skopeo`` reads it as ``oci:DIR``)
    ingest/<hex>.partial                           a resumable download in progress
    locks/<hex>.lock                               per-digest file locks

A blob becomes visible at ``blobs/sha256/<hex>`` only after its size and sha256 match: it is
written to ``ingest/`` (same filesystem), fsynced, made read-only, renamed, and the directory
fsynced. A partial download is resumed by re-hashing the bytes already on disk (the hash state
cannot be saved, and disk content after a crash is not to be trusted blindly), then asking the
source for the rest with a Range request. A resumed blob that fails the final check is thrown
away and fetched once more from zero.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from modelpack.mount.locks import HeldLock, SingleFlight, acquire, exclusive_lock, is_locked

from modelpack.errors import DigestMismatchError, ModelpackError, SizeMismatchError, StoreError
from modelpack.files import TEMP_PREFIX, atomic_write_bytes, fsync_dir
from modelpack.oci.descriptor import Descriptor
from modelpack.oci.digest import HASH_CHUNK, Digest
from modelpack.targets.base import ReadableTarget
from modelpack.targets.layout import OCILayoutTarget

PARTIAL_SUFFIX = ".partial"
# Network reads block until this many bytes arrived: small enough that a partial file grows
# steadily (what a resume can reuse after a crash), large enough to keep per-call overhead low.
INGEST_CHUNK = 256 * 1024


@dataclass
class IngestResult:
    digest: Digest
    size: int
    downloaded: int = 0  # bytes fetched from the source by this call
    resumed_from: int = 0  # bytes of a partial file reused (re-hashed, not re-fetched)
    existed: bool = False  # already committed: nothing fetched
    shared: bool = False  # another thread of this process did the work
    waited_s: float = 0.0
    seconds: float = 0.0
    lock_stale: bool = False


class Store:
    """Content-addressed blobs + manifests, readable as an OCI layout by other tools."""

    def __init__(self, root: str, *, stale_after: float = 60.0) -> None:
        self.root = os.path.abspath(root)
        os.makedirs(self.root, exist_ok=True)
        self.layout = OCILayoutTarget(self.root, create=True, link="copy")
        self.blobs_dir = os.path.join(self.root, "blobs", "sha256")
        self.ingest_dir = os.path.join(self.root, "ingest")
        self.locks_dir = os.path.join(self.root, "locks")
        os.makedirs(self.ingest_dir, exist_ok=True)
        os.makedirs(self.locks_dir, exist_ok=True)
        self.stale_after = stale_after
        self._flight: SingleFlight[IngestResult] = SingleFlight()

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

    # ------------------------------------------------------------------ ingest
    def ingest(
        self,
        desc: Descriptor,
        source: ReadableTarget,
        *,
        on_event: Callable[..., Any] | None = None,
        on_bytes: Callable[[int], None] | None = None,
    ) -> IngestResult:
        """Make ``desc`` present and verified; at most one fetch per digest on this node."""
        result, shared = self._flight.do(
            desc.digest, lambda: self._ingest_locked(desc, source, on_event, on_bytes)
        )
        if shared:
            return IngestResult(desc.digest, desc.size, existed=True, shared=True)
        return result

    def _ingest_locked(
        self,
        desc: Descriptor,
        source: ReadableTarget,
        on_event: Callable[..., Any] | None,
        on_bytes: Callable[[int], None] | None,
    ) -> IngestResult:
        start = time.monotonic()
        if self.has(desc):
            return IngestResult(desc.digest, desc.size, existed=True)

        def waiting(holder: str) -> None:
            if on_event:
                on_event("cache.lock_wait", blob=str(desc.digest), holder=holder)

        held = acquire(self.lock_path(desc.digest), stale_after=self.stale_after, on_wait=waiting)
        try:
            if held.stale and on_event:
                on_event("cache.lock_stale", blob=str(desc.digest), lock=held.path)
            if self.has(desc):  # the holder we waited for committed it
                return IngestResult(desc.digest, desc.size, existed=True, waited_s=held.waited_s)
            if held.exclusive:
                partial = self.partial_path(desc.digest)
            else:
                # Stale holder may still be writing the shared partial: use a private file.
                partial = os.path.join(
                    self.ingest_dir,
                    f"{TEMP_PREFIX}{desc.digest.hex[:16]}-{os.getpid()}-{uuid.uuid4().hex[:8]}",
                )
            result = self._download(desc, source, partial, held, on_event, on_bytes)
            result.waited_s = held.waited_s
            result.lock_stale = held.stale
            result.seconds = time.monotonic() - start
            return result
        finally:
            held.release()

    def _download(
        self,
        desc: Descriptor,
        source: ReadableTarget,
        partial: str,
        held: HeldLock,
        on_event: Callable[..., Any] | None,
        on_bytes: Callable[[int], None] | None,
    ) -> IngestResult:
        result = IngestResult(desc.digest, desc.size)
        for attempt in (0, 1):
            h = hashlib.sha256()
            offset = self._rehash_prefix(partial, desc, h) if attempt == 0 else 0
            if attempt == 1 or offset == 0:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(partial)
            if offset:
                result.resumed_from = offset
                if on_event:
                    on_event("cache.resume", blob=str(desc.digest), offset=offset, size=desc.size)
            fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
            try:
                n = offset
                extra = 0  # a complete partial (killed before its rename) needs no fetch at all
                if n < desc.size:
                    with source.fetch_blob(desc, n) as stream:
                        buf = bytearray(INGEST_CHUNK)
                        view = memoryview(buf)
                        while n < desc.size:
                            want = min(len(buf), desc.size - n)
                            got = _readinto(stream, view[:want])
                            if not got:
                                break
                            _write_all(fd, view[:got])
                            h.update(view[:got])
                            n += got
                            result.downloaded += got
                            if on_bytes:
                                on_bytes(got)
                            held.heartbeat()
                        # one byte past the declared size means the source lies about the size
                        extra = _readinto(stream, memoryview(bytearray(1))) if n == desc.size else 0
                if n != desc.size or extra:
                    os.close(fd)
                    fd = -1
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(partial)
                    actual = n + 1 if extra else n
                    raise SizeMismatchError(desc.digest, desc.size, actual, source=source.name)
                actual_digest = "sha256:" + h.hexdigest()
                if actual_digest != desc.digest:
                    os.close(fd)
                    fd = -1
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(partial)
                    if offset and attempt == 0:
                        # The reused prefix may be what is wrong (torn write, disk error): retry once clean.
                        if on_event:
                            on_event("cache.resume_discarded", blob=str(desc.digest), offset=offset)
                        result.resumed_from = 0
                        continue
                    raise DigestMismatchError(desc.digest, actual_digest, source=source.name)
                os.fsync(fd)
            finally:
                if fd >= 0:
                    os.close(fd)
            self._commit(partial, desc.digest)
            return result
        raise AssertionError("unreachable")  # pragma: no cover

    def _rehash_prefix(self, partial: str, desc: Descriptor, h: Any) -> int:
        """Feed an existing partial file into ``h``; returns its length (0 = start over)."""
        try:
            size = os.stat(partial).st_size
        except FileNotFoundError:
            return 0
        if size == 0 or size > desc.size:
            return 0
        with open(partial, "rb", buffering=0) as f:
            buf = bytearray(HASH_CHUNK)
            view = memoryview(buf)
            n = 0
            while n < size:
                got = f.readinto(view[: min(len(buf), size - n)])
                if not got:
                    break
                h.update(view[:got])
                n += got
        return n

    def _commit(self, tmp: str, digest: str) -> None:
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
        self._commit(tmp, desc.digest)

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


def _readinto(stream: Any, view: memoryview) -> int:
    readinto = getattr(stream, "readinto", None)
    if readinto is not None:
        n = readinto(view)
        return int(n or 0)
    data = stream.read(len(view))
    view[: len(data)] = data
    return len(data)


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        n = os.write(fd, data)
        data = data[n:]
