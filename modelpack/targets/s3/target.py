"""An OCI image layout in an S3 bucket as a Target: layout files, tags in ``index.json``, blobs.

Objects under ``s3://BUCKET/PREFIX``: ``oci-layout``, ``index.json`` and ``blobs/sha256/<hex>``,
the same layout ``modelpack.targets.layout`` writes to a directory (tags are
``org.opencontainers.image.ref.name`` annotations in ``index.json``).

``index.json`` is replaced with a conditional write (``If-Match`` its ETag, or ``If-None-Match: *``
when creating it) and retried on conflict, so concurrent taggers never lose each other's tags.
Where the endpoint does not support conditions the rule is last writer wins (docs/s3.md). An
unchanged index is not rewritten. Reads stream (``fetch_blob``) and take ranges
(``fetch_range``); sizes are checked, digests are the caller's job as for every target, except
manifests, which are verified here. Small blobs are hashed before their one PutObject; large ones
go through ``modelpack.targets.s3.multipart``.
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, BinaryIO, cast

from modelpack import boundedjson
from modelpack.errors import (
    DocumentError,
    ManifestError,
    NotFoundError,
    S3Error,
    S3LayoutError,
    SizeMismatchError,
)
from modelpack.files import read_exact
from modelpack.mediatypes import MEDIA_TYPE_OCI_INDEX
from modelpack.oci.descriptor import Descriptor, parse_manifest_or_index
from modelpack.oci.digest import Digest, VerifyingReader, verify_bytes
from modelpack.oci.reference import validate_tag
from modelpack.targets.base import BlobSource
from modelpack.targets.layout import (
    descriptor_in_index,
    index_entries_with,
    referrers_from_index,
    tags_in_index,
)
from modelpack.targets.options import TargetOptions
from modelpack.targets.s3.client import (
    client_errors,
    is_conflict,
    is_unsupported,
    make_client,
    wrap_client_error,
)
from modelpack.targets.s3.multipart import MultipartUploader
from modelpack.targets.s3.objects import S3Objects
from modelpack.targets.s3.settings import S3Settings
from modelpack.targets.s3.stream import S3ReadStream, object_size

if TYPE_CHECKING:
    from modelpack.oci.reference import Reference

log = logging.getLogger("modelpack.targets.s3")

LAYOUT_FILE = b'{"imageLayoutVersion":"1.0.0"}'
MAX_INDEX_BYTES = 64 * 1024 * 1024
MAX_MANIFEST_BYTES = 4 * 1024 * 1024
INDEX_RETRIES = 12


class S3Target:
    """Read/write Target over an OCI image layout under ``s3://bucket/prefix``.

    ``client`` is any boto3 S3 client (made from the standard chain when omitted). The bucket
    must exist; the layout (``oci-layout``, ``index.json``) is created on the first write.
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        client: Any = None,
        endpoint: str | None = None,
        region: str | None = None,
        settings: S3Settings | None = None,
    ) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.settings = settings or S3Settings()
        self.client = client or make_client(endpoint, region, max_pool=self.settings.concurrency + 16)
        self.name = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        self._objects = S3Objects(self.client, bucket, self.settings, self.name)
        self._multipart = MultipartUploader(self._objects)
        self.stats = self._objects.stats  # one dict: the uploader's counters show up here
        self._layout_ok = False
        self._manifest_cache: dict[str, bytes] = {}

    @classmethod
    def from_reference(cls, ref: Reference, options: TargetOptions | None = None) -> S3Target:
        options = options or TargetOptions.from_environ()
        return cls(
            ref.bucket,
            ref.prefix,
            endpoint=options.s3_endpoint,
            region=options.s3_region,
            settings=S3Settings.from_options(options.s3),
        )

    # ----------------------------------------------------------------- keys & helpers
    def key(self, relpath: str) -> str:
        return f"{self.prefix}/{relpath}" if self.prefix else relpath

    def blob_key(self, digest: str) -> str:
        return self.key(f"blobs/sha256/{Digest(digest).hex}")

    def _where(self, key: str) -> str:
        return self._objects.where(key)

    # ----------------------------------------------------------------- layout & index
    @property
    def _index_key(self) -> str:
        return self.key("index.json")

    @staticmethod
    def _empty_index() -> dict[str, Any]:
        return {"schemaVersion": 2, "mediaType": MEDIA_TYPE_OCI_INDEX, "manifests": []}

    def _check_layout_bytes(self, raw: bytes) -> None:
        where = self._where(self.key("oci-layout"))
        try:
            version = boundedjson.loads_object(raw, what=where, max_bytes=4096).get("imageLayoutVersion")
        except DocumentError as exc:
            raise S3LayoutError(f"{where}: unreadable oci-layout: {exc.reason}") from None
        if version != "1.0.0":
            raise S3LayoutError(
                f"{self._where(self.key('oci-layout'))}: unsupported imageLayoutVersion {version!r}"
            )

    def _ensure_layout(self) -> None:
        """Create ``oci-layout`` (if absent) before the first write; check it if present."""
        if self._layout_ok:
            return
        key = self.key("oci-layout")
        got = self._objects.get_small(key, 4096, what="oci-layout")
        if got is None:
            if not self._objects.put_if_absent(key, LAYOUT_FILE, "application/json"):
                got = self._objects.get_small(key, 4096, what="oci-layout")
        if got is not None:
            self._check_layout_bytes(got[0])
        self._layout_ok = True

    def _read_index(self, *, must_exist: bool = True) -> tuple[dict[str, Any], str | None]:
        got = self._objects.get_small(self._index_key, MAX_INDEX_BYTES, what="index.json")
        if got is None:
            if must_exist:
                raise NotFoundError(f"{self.name} is not an OCI layout (no index.json)")
            return self._empty_index(), None
        raw, etag = got
        try:
            doc = boundedjson.loads_object(raw, what=self._where(self._index_key), max_bytes=MAX_INDEX_BYTES)
        except DocumentError as exc:
            raise S3LayoutError(f"{self._where(self._index_key)}: invalid index: {exc.reason}") from None
        if not isinstance(doc.get("manifests", []), list):
            raise S3LayoutError(f"{self._where(self._index_key)}: invalid index")
        doc.setdefault("manifests", [])
        return doc, etag

    def _index_entries(self) -> list[dict[str, Any]]:
        doc, _ = self._read_index()
        return [e for e in doc["manifests"] if isinstance(e, dict)]

    def _update_index(self, mutate: Callable[[list[dict[str, Any]]], list[dict[str, Any]]]) -> None:
        """Read-modify-write ``index.json`` with an ETag condition, retrying on conflict."""
        self._ensure_layout()
        key = self._index_key
        for attempt in range(INDEX_RETRIES):
            doc, etag = self._read_index(must_exist=False)
            before = json.dumps(doc["manifests"], separators=(",", ":"))
            doc["manifests"] = mutate(list(doc["manifests"]))
            if etag is not None and json.dumps(doc["manifests"], separators=(",", ":")) == before:
                return  # nothing changes: write nothing
            body = json.dumps(doc, separators=(",", ":")).encode()
            kwargs: dict[str, Any] = {"Body": body, "ContentType": "application/json"}
            if self._objects.conditional:
                kwargs.update({"IfMatch": etag} if etag else {"IfNoneMatch": "*"})
            try:
                self.client.put_object(Bucket=self.bucket, Key=key, **kwargs)
                return
            except client_errors() as exc:
                if self._objects.conditional and is_conflict(exc):
                    delay = min(1.0, 0.01 * (2**attempt)) * (0.5 + random.random())
                    log.debug(
                        "%s: index.json changed concurrently; retry %d in %.2fs",
                        self.name,
                        attempt + 1,
                        delay,
                    )
                    time.sleep(delay)
                    continue
                if (
                    self._objects.conditional
                    and is_unsupported(exc)
                    and self.settings.conditional_writes == "auto"
                ):
                    log.warning(
                        "%s: endpoint rejects conditional writes; index.json is last-writer-wins", self.name
                    )
                    self._objects.conditional = False
                    continue
                raise wrap_client_error(exc, "PutObject", self._where(key)) from exc
        raise S3Error(
            f"{self._where(key)}: gave up after {INDEX_RETRIES} conflicting concurrent updates",
            operation="PutObject",
            key=self._where(key),
        )

    # ----------------------------------------------------------------- read side
    def resolve(self, reference: str) -> Descriptor:
        if not reference.startswith("sha256:"):
            validate_tag(reference)
        found = descriptor_in_index(self._index_entries(), reference, self._where(self._index_key))
        if found is not None:
            return found
        if not reference.startswith("sha256:"):
            raise NotFoundError(f"{self.name}: tag {reference!r} not found")
        digest = Digest(reference)
        raw = self._read_manifest_bytes(digest, None)
        parsed = parse_manifest_or_index(raw)
        return Descriptor(parsed.media_type, digest, len(raw), artifact_type=parsed.artifact_type)

    def _read_manifest_bytes(self, digest: str, size: int | None) -> bytes:
        cached = self._manifest_cache.get(digest)
        if cached is not None:
            return cached
        key = self.blob_key(digest)
        got = self._objects.get_small(key, MAX_MANIFEST_BYTES, what="manifest")
        if got is None:
            raise NotFoundError(f"{self.name}: manifest {digest} not found")
        raw = got[0]
        verify_bytes(raw, digest, size, what="manifest", source=self._where(key))
        self._manifest_cache[digest] = raw
        return raw

    def fetch_manifest(self, reference: str) -> tuple[bytes, str]:
        desc = self.resolve(reference)
        return self._read_manifest_bytes(desc.digest, desc.size), desc.media_type

    def fetch_blob(self, descriptor: Descriptor, offset: int = 0) -> BinaryIO:
        if offset < 0 or offset > descriptor.size:
            raise S3Error(
                f"{self.name}: offset {offset} outside blob {descriptor.digest} ({descriptor.size} bytes)"
            )
        key = self.blob_key(descriptor.digest)
        stream = S3ReadStream(self.client, self.bucket, key, offset, descriptor.size, self._where(key))
        if offset == descriptor.size and self._objects.head_size(key) is None:
            raise NotFoundError(f"{self.name}: blob {descriptor.digest} not found")
        return cast(BinaryIO, stream)

    def fetch_range(self, descriptor: Descriptor, offset: int, length: int) -> bytes:
        if offset < 0 or length < 0 or offset + length > descriptor.size:
            raise S3Error(
                f"{self.name}: range {offset}+{length} outside blob {descriptor.digest} ({descriptor.size} bytes)"
            )
        if length == 0:
            return b""
        key = self.blob_key(descriptor.digest)
        where = self._where(key)
        resp = self._objects.call(
            "GetObject", key, self.client.get_object, Range=f"bytes={offset}-{offset + length - 1}"
        )
        body = resp["Body"]
        try:
            total = object_size(resp)
            if total is not None and total != descriptor.size:
                raise SizeMismatchError(descriptor.digest, descriptor.size, total, source=where)
            data = read_exact(body, length)
        finally:
            body.close()
        if len(data) != length:
            raise SizeMismatchError(descriptor.digest, offset + length, offset + len(data), source=where)
        return data

    def exists(self, descriptor: Descriptor) -> bool:
        return self._objects.head_size(self.blob_key(descriptor.digest)) == descriptor.size

    def list_tags(self) -> Iterator[str]:
        yield from tags_in_index(self._index_entries())

    def referrers(self, subject: Descriptor, artifact_type: str | None = None) -> list[Descriptor]:
        return referrers_from_index(
            self._index_entries(),
            lambda digest, size: self._read_manifest_bytes(Digest(digest), size),
            subject,
            artifact_type,
        )

    # ----------------------------------------------------------------- write side
    def close(self) -> None:
        self._multipart.close()

    def incomplete_uploads(self, key: str) -> list[dict[str, Any]]:
        """In-progress multipart uploads for exactly ``key``, newest first."""
        return self._multipart.incomplete_uploads(key)

    def push_blob(self, source: BlobSource) -> None:
        desc = source.descriptor
        key = self.blob_key(desc.digest)
        self._ensure_layout()
        present = self._objects.head_size(key)
        if present == desc.size:
            return
        if present is not None:
            raise S3Error(
                f"{self._where(key)}: holds {present} bytes but blob {desc.digest} has {desc.size}; "
                "the stored object is corrupt and blobs are never overwritten: delete it and push again",
                key=self._where(key),
            )
        if desc.size <= self.settings.threshold:
            self._put_small(source, key)
        else:
            self._multipart.upload(source, key)
        stored = self._objects.head_size(key)
        if stored != desc.size:
            raise SizeMismatchError(desc.digest, desc.size, stored or 0, source=self._where(key))

    def _put_small(self, source: BlobSource, key: str) -> None:
        desc = source.descriptor
        with source.open(0) as raw:
            reader = VerifyingReader(raw, desc.digest, desc.size, source=f"upload to {self._where(key)}")
            chunks = []
            while True:
                chunk = reader.read(1 << 20)
                if not chunk:
                    break
                chunks.append(chunk)
        data = b"".join(chunks)  # digest and size checked at EOF by the reader
        self._objects.put_if_absent(key, data, "application/octet-stream")

    # manifests & tags ----------------------------------------------------------
    def push_manifest(self, raw: bytes, media_type: str, tag: str | None = None) -> Descriptor:
        if tag:
            validate_tag(tag)
        if len(raw) > MAX_MANIFEST_BYTES:
            raise ManifestError(f"manifest is {len(raw)} bytes; the limit is {MAX_MANIFEST_BYTES}")
        parsed = parse_manifest_or_index(raw, media_type)
        digest = Digest.from_bytes(raw)
        self._ensure_layout()
        key = self.blob_key(digest)
        if self._objects.head_size(key) != len(raw):
            self._objects.put_if_absent(key, raw, media_type)
        self._manifest_cache[digest] = raw
        desc = Descriptor(media_type, digest, len(raw), artifact_type=parsed.artifact_type)
        self._set_entry(desc, tag)
        return desc

    def _set_entry(self, descriptor: Descriptor, tag: str | None) -> None:
        # an unchanged entry list is not rewritten (_update_index compares before writing)
        self._update_index(lambda entries: index_entries_with(entries, descriptor, tag))

    def tag(self, descriptor: Descriptor, tag: str) -> None:
        validate_tag(tag)
        if not self.exists(descriptor):
            raise NotFoundError(f"{self.name}: cannot tag {descriptor.digest}: manifest not in the bucket")
        self._set_entry(descriptor.reference_only(), tag)


__all__ = ["S3Target"]
