"""An OCI image layout directory as a Target (the embedded default: no server needed).

Layout per the OCI image spec: ``oci-layout``, ``index.json`` and ``blobs/sha256/<hex>``; tags are
``org.opencontainers.image.ref.name`` annotations in ``index.json`` (what ``skopeo oci:DIR:TAG``
reads). Every write is crash-safe: blobs land under a temp name and are renamed only after size
and digest checks; ``index.json`` is replaced atomically under a file lock.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import itertools
import json
import os
import shutil
from collections.abc import Callable, Iterator, Sequence
from typing import Any, BinaryIO

from modelpack import boundedjson
from modelpack.errors import (
    DiskFullError,
    DocumentError,
    FileWriteError,
    LayoutError,
    ManifestError,
    NotFoundError,
    SizeMismatchError,
)
from modelpack.files import (
    TEMP_PREFIX,
    atomic_write_bytes,
    fsync_dir,
    link_or_copy,
    link_or_copy_fd,
    pread_exact,
)
from modelpack.mediatypes import MEDIA_TYPE_OCI_INDEX, MEDIA_TYPE_OCI_MANIFEST
from modelpack.oci.descriptor import Descriptor, Manifest, canonical_json, parse_manifest_or_index
from modelpack.oci.digest import HASH_CHUNK, Digest, VerifyingReader, verify_bytes
from modelpack.oci.reference import validate_tag
from modelpack.targets.base import BlobSource, file_blob_source
from modelpack.targets.ranges import plan_runs

REF_NAME = "org.opencontainers.image.ref.name"
LAYOUT_FILE = '{"imageLayoutVersion":"1.0.0"}'
MAX_INDEX_BYTES = 64 * 1024 * 1024
#: buffers one ``preadv`` takes at most (Linux's ``IOV_MAX``)
_IOV_MAX = 1024


def entry_tag(entry: dict[str, Any]) -> str | None:
    return (entry.get("annotations") or {}).get(REF_NAME)


def tags_in_index(entries: list[dict[str, Any]]) -> list[str]:
    """Tags in index order, each once."""
    return list(dict.fromkeys(t for t in map(entry_tag, entries) if t))


def descriptor_in_index(entries: list[dict[str, Any]], reference: str, where: str) -> Descriptor | None:
    """The entry a tag (the last one wins) or a ``sha256:`` digest names, or None."""
    if reference.startswith("sha256:"):
        found = [e for e in entries if e.get("digest") == reference][:1]
    else:
        found = [e for e in entries if entry_tag(e) == reference][-1:]
    return Descriptor.from_dict(found[0], where=f"{where} entry").reference_only() if found else None


def index_entries_without(entries: list[dict[str, Any]], tag: str) -> list[dict[str, Any]]:
    return [e for e in entries if entry_tag(e) != tag]


def index_entries_with(
    entries: list[dict[str, Any]], descriptor: Descriptor, tag: str | None
) -> list[dict[str, Any]]:
    """``index.json`` entries after pointing ``tag`` at ``descriptor`` (tags are unique), or after
    adding it untagged when absent (untagged entries keep referrers and digests reachable)."""
    new = descriptor.to_dict()
    if tag:
        new["annotations"] = {**new.get("annotations", {}), REF_NAME: tag}
        current = [e for e in entries if entry_tag(e) == tag]
        if current == [new]:
            return entries  # already so: no rewrite, no reordering (a second push writes nothing)
        return [*index_entries_without(entries, tag), new]
    if any(e.get("digest") == descriptor.digest for e in entries):
        return entries
    new.pop("annotations", None)
    return [*entries, new]


def referrers_from_index(
    entries: list[dict[str, Any]],
    read_manifest: Callable[[str, int | None], bytes],
    subject: Descriptor,
    artifact_type: str | None = None,
) -> list[Descriptor]:
    """Referrers in an OCI layout index: the image manifests listed there whose ``subject`` is
    ``subject`` (layouts have no referrers API, so every layout-shaped backing scans its index).

    ``read_manifest(digest, size)`` returns verified bytes; unreadable entries are skipped.
    """
    found: list[Descriptor] = []
    for entry in entries:
        if entry.get("mediaType") != MEDIA_TYPE_OCI_MANIFEST or entry.get("digest") == subject.digest:
            continue
        try:
            raw = read_manifest(entry["digest"], entry.get("size"))
            parsed = parse_manifest_or_index(raw)
        except (NotFoundError, ManifestError, KeyError, ValueError):
            continue
        if parsed.subject is None or parsed.subject.digest != subject.digest:
            continue
        at = parsed.artifact_type
        if at is None and isinstance(parsed, Manifest):
            at = parsed.config.media_type
        if artifact_type and at != artifact_type:
            continue
        found.append(
            Descriptor(
                parsed.media_type,
                Digest(entry["digest"]),
                len(raw),
                artifact_type=at,
                annotations=parsed.annotations,
            )
        )
    return found


class OCILayoutTarget:
    """Read/write target over an OCI image layout directory.

    ``link`` controls how ``push_blob`` materialises a blob whose source is a local file this
    process just hashed (``BlobSource.verified``): ``auto`` tries reflink, then hard link, then
    copy; ``reflink`` tries reflink then copy (never shares an inode with the checkpoint);
    ``copy`` always copies. Any other source is streamed through a digest check.
    """

    def __init__(self, path: str | os.PathLike[str], *, create: bool = False, link: str = "auto") -> None:
        self.path = os.path.abspath(os.fspath(path))
        self.name = f"oci:{self.path}"
        self.link = link
        # how local-file blobs were materialised (reflink / hardlink / copy), for reports and tests
        self.materialized: dict[str, int] = {}
        layout_file = os.path.join(self.path, "oci-layout")
        if not os.path.exists(layout_file):
            if not create:
                raise NotFoundError(f"{self.path} is not an OCI image layout (no oci-layout file)")
            os.makedirs(os.path.join(self.path, "blobs", "sha256"), exist_ok=True)
            atomic_write_bytes(layout_file, LAYOUT_FILE.encode())
            if not os.path.exists(self._index_path):
                atomic_write_bytes(self._index_path, canonical_json(self._empty_index()))
        else:
            try:
                with open(layout_file, "rb") as f:
                    layout_doc = boundedjson.loads_object(f.read(4097), what=layout_file, max_bytes=4096)
                version = layout_doc.get("imageLayoutVersion")
            except OSError as exc:
                raise LayoutError(f"{layout_file}: unreadable oci-layout file: {exc}") from exc
            except DocumentError as exc:
                raise LayoutError(f"{layout_file}: unreadable oci-layout file: {exc.reason}") from None
            if version != "1.0.0":
                raise LayoutError(f"{layout_file}: unsupported imageLayoutVersion {version!r}")
            os.makedirs(os.path.join(self.path, "blobs", "sha256"), exist_ok=True)

    # ----------------------------------------------------------------- paths & index
    @property
    def _index_path(self) -> str:
        return os.path.join(self.path, "index.json")

    def blob_path(self, digest: str) -> str:
        d = Digest(digest)
        return os.path.join(self.path, "blobs", "sha256", d.hex)

    @staticmethod
    def _empty_index() -> dict[str, Any]:
        return {"schemaVersion": 2, "mediaType": MEDIA_TYPE_OCI_INDEX, "manifests": []}

    def _read_index(self) -> dict[str, Any]:
        try:
            with open(self._index_path, "rb") as f:
                raw = f.read(MAX_INDEX_BYTES + 1)
        except FileNotFoundError:
            return self._empty_index()
        if len(raw) > MAX_INDEX_BYTES:
            raise LayoutError(f"{self._index_path} is larger than {MAX_INDEX_BYTES} bytes")
        try:
            doc = boundedjson.loads_object(raw, what=self._index_path, max_bytes=MAX_INDEX_BYTES)
        except DocumentError as exc:
            raise LayoutError(f"{self._index_path}: invalid index: {exc.reason}") from None
        if not isinstance(doc.get("manifests", []), list):
            raise LayoutError(f"{self._index_path}: invalid index")
        doc.setdefault("manifests", [])
        return doc

    @contextlib.contextmanager
    def _index_lock(self) -> Iterator[None]:
        lock_path = os.path.join(self.path, ".index.lock")
        fd = os.open(lock_path, os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def _update_index(self, descriptor: Descriptor, tag: str | None) -> None:
        with self._index_lock():
            doc = self._read_index()
            doc["manifests"] = index_entries_with(doc["manifests"], descriptor, tag)
            atomic_write_bytes(self._index_path, json.dumps(doc, separators=(",", ":")).encode())

    # ----------------------------------------------------------------- read side
    def _index_entries(self) -> list[dict[str, Any]]:
        return list(self._read_index()["manifests"])

    def resolve(self, reference: str) -> Descriptor:
        if not reference.startswith("sha256:"):
            validate_tag(reference)
        found = descriptor_in_index(self._index_entries(), reference, self._index_path)
        if found is not None:
            return found
        if not reference.startswith("sha256:"):
            raise NotFoundError(f"{self.name}: tag {reference!r} not found")
        digest = Digest(reference)
        if not os.path.exists(self.blob_path(digest)):
            raise NotFoundError(f"{self.name}: manifest {digest} not found")
        raw = self._read_blob_bytes(digest)
        parsed = parse_manifest_or_index(raw)
        return Descriptor(parsed.media_type, digest, len(raw), artifact_type=parsed.artifact_type)

    def _read_blob_bytes(self, digest: str, size: int | None = None, limit: int = 4 * 1024 * 1024) -> bytes:
        path = self.blob_path(digest)
        try:
            with open(path, "rb") as f:
                raw = f.read(limit + 1)
        except FileNotFoundError as exc:
            raise NotFoundError(f"{self.name}: blob {digest} not found") from exc
        if len(raw) > limit:
            raise ManifestError(f"{self.name}: {digest} is larger than {limit} bytes")
        verify_bytes(raw, digest, size, what="manifest", source=self.name)
        return raw

    def fetch_manifest(self, reference: str) -> tuple[bytes, str]:
        desc = self.resolve(reference)
        raw = self._read_blob_bytes(desc.digest, desc.size)
        return raw, desc.media_type

    def fetch_blob(self, descriptor: Descriptor, offset: int = 0) -> BinaryIO:
        try:
            f = open(self.blob_path(descriptor.digest), "rb")
        except FileNotFoundError as exc:
            raise NotFoundError(f"{self.name}: blob {descriptor.digest} not found") from exc
        if offset:
            f.seek(offset)
        return f

    def fetch_range(self, descriptor: Descriptor, offset: int, length: int) -> bytes:
        with self.fetch_blob(descriptor) as f:
            data = pread_exact(f.fileno(), length, offset)
        if len(data) != length:
            raise SizeMismatchError(descriptor.digest, offset + length, offset + len(data), source=self.name)
        return data

    @property
    def multi_range(self) -> bool:
        """``fetch_ranges_into`` reads the layout's own blob file (``MultiRangeFetcher``)."""
        return True

    def fetch_ranges_into(
        self, descriptor: Descriptor, ranges: Sequence[tuple[int, int]], views: Sequence[memoryview]
    ) -> int:
        """Fill ``views[i]`` with the ``ranges[i]`` bytes of the blob file, each by ``preadv``
        straight into its view(s) (unverified, like ``fetch_range``). A file shorter than a
        range is ``SizeMismatchError``. Returns the sum of the lengths."""
        runs = plan_runs(descriptor, ranges, views, source=self.name)
        fetched = 0
        with self.fetch_blob(descriptor) as f:
            fd = f.fileno()
            for run in runs:
                while not run.done:
                    n = os.preadv(fd, list(itertools.islice(run.pending_views(), _IOV_MAX)), run.pos)
                    if not n:
                        raise SizeMismatchError(
                            descriptor.digest, run.end, run.pos, source=f"{self.name} range {run.offset}"
                        )
                    run.have += n
                    fetched += n
        return fetched

    def blob_source(self, descriptor: Descriptor) -> BlobSource:
        """Offer the blob file's path (unverified: a linker must still stream-check it)."""
        return file_blob_source(descriptor, self.blob_path(descriptor.digest), verified=False)

    def exists(self, descriptor: Descriptor) -> bool:
        try:
            return os.stat(self.blob_path(descriptor.digest)).st_size == descriptor.size
        except FileNotFoundError:
            return False

    def list_tags(self) -> Iterator[str]:
        yield from tags_in_index(self._index_entries())

    def referrers(self, subject: Descriptor, artifact_type: str | None = None) -> list[Descriptor]:
        return referrers_from_index(self._index_entries(), self._read_blob_bytes, subject, artifact_type)

    # ----------------------------------------------------------------- write side
    def push_blob(self, source: BlobSource) -> None:
        desc = source.descriptor
        final = self.blob_path(desc.digest)
        if self.exists(desc):
            return
        directory = os.path.dirname(final)
        tmp = os.path.join(directory, f"{TEMP_PREFIX}{desc.digest.hex[:16]}-{os.getpid()}-{id(source)}")
        try:
            if source.local_path and source.verified:
                # The descriptor of a local-path source was computed from this very file by the
                # packer a moment ago; check the size and keep the hash pass single.
                if source.fileno is not None:
                    how = link_or_copy_fd(source.fileno, tmp, mode=self.link)
                else:
                    how = link_or_copy(source.local_path, tmp, mode=self.link)
                self.materialized[how] = self.materialized.get(how, 0) + 1
                size = os.stat(tmp).st_size
                if size != desc.size:
                    raise SizeMismatchError(desc.digest, desc.size, size, source=source.local_path)
                if source.recheck is not None:
                    source.recheck()  # a writer during the copy: the copy is not what was hashed
            else:
                with source.open(0) as raw, open(tmp, "wb") as out:
                    reader = VerifyingReader(raw, desc.digest, desc.size, source=self.name)
                    while True:
                        chunk = reader.read(HASH_CHUNK)
                        if not chunk:
                            break
                        out.write(chunk)
                    out.flush()
                    os.fsync(out.fileno())
            os.replace(tmp, final)
            fsync_dir(directory)
        except OSError as exc:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise DiskFullError(
                    final, f"{exc.strerror or 'no space left'} writing blob {desc.digest} (nothing kept)"
                ) from exc
            raise FileWriteError(final, f"{exc.strerror or exc}") from exc
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise

    def push_manifest(self, raw: bytes, media_type: str, tag: str | None = None) -> Descriptor:
        if tag:
            validate_tag(tag)
        parsed = parse_manifest_or_index(raw, media_type)
        digest = Digest.from_bytes(raw)
        path = self.blob_path(digest)
        if not os.path.exists(path):
            atomic_write_bytes(path, raw)
        desc = Descriptor(media_type, digest, len(raw), artifact_type=parsed.artifact_type)
        self._update_index(desc, tag)
        return desc

    def tag(self, descriptor: Descriptor, tag: str) -> None:
        validate_tag(tag)
        if not self.exists(descriptor):
            raise NotFoundError(f"{self.name}: cannot tag {descriptor.digest}: manifest not in the layout")
        self._update_index(descriptor.reference_only(), tag)

    def remove_blob(self, digest: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.blob_path(digest))

    def delete(self) -> None:
        shutil.rmtree(self.path)
