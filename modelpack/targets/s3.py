"""An OCI image layout stored in an S3 bucket, as a Target: object storage as the authoritative copy.

Objects under ``s3://BUCKET/PREFIX``: ``oci-layout``, ``index.json`` and ``blobs/sha256/<hex>``,
the same layout ``modelpack.targets.layout`` writes to a directory (tags are
``org.opencontainers.image.ref.name`` annotations in ``index.json``).

Rules, and why:

- Blobs are immutable. A blob is written only if absent: ``If-None-Match: *`` on PutObject and on
  CompleteMultipartUpload (AWS since 2024-08, MinIO, moto 5.2), so two writers racing on one
  digest cannot overwrite each other. An endpoint that answers ``NotImplemented`` to the condition
  is remembered and served HEAD-then-write instead (a race then writes identical bytes twice,
  because the key is the content's digest).
- Blobs are checked while they upload. Bytes are hashed as they are read from the source; a small
  blob is sent with one PutObject only after its digest matched, a large one as a multipart upload
  (parts in flight concurrently, memory bounded by ``concurrency`` parts per target) that is
  completed only after the whole stream matched the digest and size, and aborted otherwise. An
  object under a blob key is therefore always complete and correct when written.
- An interrupted multipart upload (process killed, network lost) stays invisible: S3 shows no
  object until completion. On the next push of that blob the upload is found with
  ListMultipartUploads and resumed: the source is re-hashed from the start, parts already stored
  whose MD5 ETag matches the source bytes are kept, others are re-sent; if the digest does not
  match, the upload is aborted. Uploads for the key that cannot be resumed (other part layout)
  are aborted. Buckets should also carry an ``AbortIncompleteMultipartUpload`` lifecycle rule.
- ``index.json`` is replaced with a conditional write (``If-Match`` its ETag, or
  ``If-None-Match: *`` when creating it) and retried on conflict, so concurrent taggers never lose
  each other's tags. Where the endpoint does not support conditions the rule is last writer wins
  (documented in docs/s3.md). An unchanged index is not rewritten.
- Reads stream (``fetch_blob``) and take ranges (``fetch_range``); sizes are checked, digests are
  the caller's job as for every target (the copy engine verifies every blob it moves), except
  manifests, which are verified here.
- Endpoint, region and credentials come from boto3's standard chain (environment, shared
  profile, web identity / IRSA, instance metadata) plus ``TargetOptions.s3_endpoint`` /
  ``s3_region``. Names in errors and logs are ``s3://bucket/prefix`` keys, never credentials.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, BinaryIO, cast

from modelpack.errors import (
    DigestMismatchError,
    ManifestError,
    ModelpackError,
    NotFoundError,
    S3Error,
    S3LayoutError,
    SizeMismatchError,
)
from modelpack.mediatypes import MEDIA_TYPE_OCI_INDEX
from modelpack.oci.descriptor import Descriptor, parse_manifest_or_index
from modelpack.oci.digest import Digest, VerifyingReader, verify_bytes
from modelpack.oci.reference import validate_tag
from modelpack.targets.base import BlobSource
from modelpack.targets.layout import (
    descriptor_in_index,
    index_entries_with,
    index_entries_without,
    referrers_from_index,
    tags_in_index,
)

if TYPE_CHECKING:
    from modelpack.oci.reference import Reference
    from modelpack.targets.opener import TargetOptions

log = logging.getLogger("modelpack.targets.s3")

LAYOUT_FILE = b'{"imageLayoutVersion":"1.0.0"}'
MAX_INDEX_BYTES = 64 * 1024 * 1024
MAX_MANIFEST_BYTES = 4 * 1024 * 1024
MIB = 1024 * 1024
DEFAULT_PART_SIZE = 16 * MIB
DEFAULT_CONCURRENCY = 8
MAX_PARTS = 10_000
INDEX_RETRIES = 12
READ_RESUMES = 3
_CONFLICT_CODES = {"PreconditionFailed", "ConditionalRequestConflict", "NoSuchKey"}
_UNSUPPORTED_CODES = {"NotImplemented"}


@dataclass
class S3Settings:
    """Transfer tuning. ``part_size`` must be ≥ 5 MiB on AWS and MinIO (the server enforces it)."""

    part_size: int = DEFAULT_PART_SIZE
    multipart_threshold: int | None = None  # blobs larger than this go multipart; None = part_size
    concurrency: int = DEFAULT_CONCURRENCY  # parts in flight per target (bounds memory)
    conditional_writes: str = "auto"  # auto | on | off

    def __post_init__(self) -> None:
        if self.part_size < 1:
            raise ValueError("S3 part size must be positive")
        if self.concurrency < 1:
            raise ValueError("S3 concurrency must be at least 1")
        if self.conditional_writes not in ("auto", "on", "off"):
            raise ValueError("conditional_writes must be auto, on or off")

    @property
    def threshold(self) -> int:
        return self.part_size if self.multipart_threshold is None else self.multipart_threshold

    @classmethod
    def from_options(cls, extra: dict[str, Any] | None = None) -> S3Settings:
        """From ``TargetOptions.extra`` (``s3_part_size``, ``s3_concurrency``, …), else the env."""
        extra = extra or {}

        def pick(key: str, env: str) -> Any:
            if extra.get(key) is not None:
                return extra[key]
            return os.environ.get(env) or None

        s = cls()
        if (v := pick("s3_part_size", "MODELPACK_S3_PART_SIZE")) is not None:
            s.part_size = int(v)
        if (v := pick("s3_multipart_threshold", "MODELPACK_S3_MULTIPART_THRESHOLD")) is not None:
            s.multipart_threshold = int(v)
        if (v := pick("s3_concurrency", "MODELPACK_S3_CONCURRENCY")) is not None:
            s.concurrency = int(v)
        if (v := pick("s3_conditional_writes", "MODELPACK_S3_CONDITIONAL_WRITES")) is not None:
            s.conditional_writes = str(v)
        s.__post_init__()
        return s


# --------------------------------------------------------------------------- client & errors
def endpoint_from_env() -> str | None:
    return (
        os.environ.get("MODELPACK_S3_ENDPOINT")
        or os.environ.get("AWS_ENDPOINT_URL_S3")
        or os.environ.get("AWS_ENDPOINT_URL")
        or None
    )


def _quiet_wire_loggers() -> None:
    """Keep botocore's DEBUG wire logs off, even under ``modelpack --debug``.

    They print signed request headers, including the access key id and ``x-amz-security-token``
    (measured: ``modelpack --debug push … s3://…`` printed the session token). modelpack's own
    ``modelpack.targets.s3`` logger still reports every decision, by key.
    """
    for name in ("botocore", "boto3", "s3transfer"):
        lg = logging.getLogger(name)
        if lg.getEffectiveLevel() < logging.INFO:  # only under --debug; other levels stay as set
            lg.setLevel(logging.INFO)


_LOADER: Any = None
_LOADER_LOCK = threading.Lock()


def _botocore_session() -> Any:
    """A fresh botocore session (credentials re-resolved from the chain each time) sharing one
    data loader, so the S3 service model JSON is parsed once per process, not per target."""
    import botocore.loaders
    import botocore.session

    global _LOADER
    with _LOADER_LOCK:
        if _LOADER is None:
            _LOADER = botocore.loaders.create_loader()
    bs = botocore.session.Session()
    bs.register_component("data_loader", _LOADER)
    return bs


def make_client(endpoint: str | None = None, region: str | None = None, *, max_pool: int = 16) -> Any:
    """A boto3 S3 client from the standard credential chain (boto3 is imported only here).

    A custom endpoint (S3-compatible store, moto) gets path-style addressing, which works with IP
    addresses and bucket names containing dots.
    """
    try:
        import boto3
        from botocore.config import Config
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise S3Error("s3:// needs boto3: pip install 'modelpack[s3]'") from exc
    _quiet_wire_loggers()
    endpoint = endpoint or endpoint_from_env()
    session = boto3.session.Session(botocore_session=_botocore_session())
    region = region or session.region_name or "us-east-1"
    config = Config(
        retries={"mode": "standard", "max_attempts": 5},
        max_pool_connections=max_pool,
        s3={"addressing_style": "path"} if endpoint else {},
        user_agent_extra="modelpack",
    )
    return session.client("s3", endpoint_url=endpoint, region_name=region, config=config)


def _error_code(exc: BaseException) -> tuple[str, int]:
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return "", 0
    code = str((response.get("Error") or {}).get("Code") or "")
    status = int((response.get("ResponseMetadata") or {}).get("HTTPStatusCode") or 0)
    return code, status


def _is_not_found(exc: BaseException) -> bool:
    code, status = _error_code(exc)
    return code in ("NoSuchKey", "404", "NotFound") or (status == 404 and code != "NoSuchBucket")


def _is_conflict(exc: BaseException) -> bool:
    code, status = _error_code(exc)
    return code in _CONFLICT_CODES or status in (409, 412)


def _is_unsupported(exc: BaseException) -> bool:
    code, status = _error_code(exc)
    return code in _UNSUPPORTED_CODES or status == 501


def _wrap(exc: BaseException, operation: str, where: str) -> ModelpackError:
    """A typed error naming the object; botocore's message carries no credentials, only codes."""
    if isinstance(exc, ModelpackError):
        return exc
    code, status = _error_code(exc)
    if code == "NoSuchBucket":
        return NotFoundError(f"{where}: bucket does not exist")
    if _is_not_found(exc):
        return NotFoundError(f"{where}: not found")
    name = type(exc).__name__
    if name in ("NoCredentialsError", "PartialCredentialsError"):
        return S3Error(
            f"{where}: no AWS credentials (environment, profile, web identity or instance metadata)",
            operation=operation,
            key=where,
        )
    detail = f"{code} (HTTP {status})" if code else f"{name}: {exc}"
    return S3Error(
        f"{where}: S3 {operation} failed: {detail}", operation=operation, key=where, code=code, status=status
    )


def _client_errors() -> tuple[type[BaseException], ...]:
    from botocore.exceptions import BotoCoreError, ClientError

    return (ClientError, BotoCoreError)


# --------------------------------------------------------------------------- streaming reads
class S3ReadStream(io.RawIOBase):
    """A GetObject body from ``start`` to ``end``; resumes with a ranged GET if the connection drops.

    A resumed read is pinned to the first response's ETag (``If-Match``), so the bytes cannot
    silently switch to another object version mid-stream.
    """

    def __init__(
        self, client: Any, bucket: str, key: str, start: int, end: int, where: str, *, etag: str | None = None
    ) -> None:
        super().__init__()
        self._client = client
        self._bucket = bucket
        self._key = key
        self._pos = start
        self._end = end
        self._where = where
        self._etag: str | None = etag
        self._body: Any = None
        self._resumes = 0
        if start < end:
            self._open()

    def _open(self) -> None:
        kwargs: dict[str, Any] = {"Bucket": self._bucket, "Key": self._key}
        if self._pos > 0 or self._etag is not None:
            kwargs["Range"] = f"bytes={self._pos}-{self._end - 1}"
        if self._etag is not None:
            kwargs["IfMatch"] = self._etag
        try:
            resp = self._client.get_object(**kwargs)
        except _client_errors() as exc:
            if self._etag is not None and _error_code(exc)[0] == "PreconditionFailed":
                raise S3Error(
                    f"{self._where}: the object changed while it was being read (ETag no longer "
                    f"{self._etag}); refusing the new bytes",
                    operation="GetObject",
                    key=self._where,
                    code="PreconditionFailed",
                    status=412,
                ) from exc
            raise _wrap(exc, "GetObject", self._where) from exc
        total = _object_size(resp)
        if total is not None and total != self._end:
            raise SizeMismatchError(self._where.rsplit("/", 1)[-1], self._end, total, source=self._where)
        self._etag = resp.get("ETag")
        self._body = resp["Body"]

    @property
    def resumes(self) -> int:
        """How many times a dropped connection was resumed with a ranged GET."""
        return self._resumes

    def readable(self) -> bool:
        return True

    def read(self, n: int | None = -1) -> bytes:
        if n is None or n < 0:
            n = self._end - self._pos
        n = min(n, self._end - self._pos)
        if n <= 0:
            return b""
        while True:
            try:
                data: bytes = self._body.read(n)
            except Exception as exc:  # urllib3 ProtocolError / ReadTimeout etc. mid-stream
                if self._resumes >= READ_RESUMES:
                    raise S3Error(f"{self._where}: read failed at byte {self._pos}: {exc}") from exc
                self._resumes += 1
                log.debug("%s: resuming read at byte %d after %s", self._where, self._pos, type(exc).__name__)
                self._body.close()
                self._open()
                continue
            if not data:
                raise SizeMismatchError(
                    self._where.rsplit("/", 1)[-1], self._end, self._pos, source=self._where
                )
            self._pos += len(data)
            return data

    def readinto(self, buf: Any) -> int:
        view = memoryview(buf).cast("B")
        data = self.read(len(view))
        view[: len(data)] = data
        return len(data)

    def close(self) -> None:
        if self._body is not None:
            with contextlib.suppress(Exception):
                self._body.close()
            self._body = None
        super().close()


def _object_size(resp: dict[str, Any]) -> int | None:
    """The whole object's size from a GetObject response (``Content-Range`` total if ranged)."""
    cr = resp.get("ContentRange")
    if isinstance(cr, str) and "/" in cr:
        total = cr.rsplit("/", 1)[1]
        return int(total) if total.isdigit() else None
    cl = resp.get("ContentLength")
    return int(cl) if cl is not None else None


def _read_exact(stream: BinaryIO, n: int) -> bytes:
    chunks = []
    got = 0
    while got < n:
        data = stream.read(n - got)
        if not data:
            break
        chunks.append(data)
        got += len(data)
    return b"".join(chunks)


@dataclass(frozen=True)
class _Part:
    number: int
    size: int
    etag: str


# --------------------------------------------------------------------------- the target
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
        self._conditional = self.settings.conditional_writes != "off"
        self._layout_ok = False
        self._lock = threading.Lock()
        self._part_slots = threading.BoundedSemaphore(self.settings.concurrency)
        self._pool: ThreadPoolExecutor | None = None
        self._manifest_cache: dict[str, bytes] = {}
        self.stats = {"parts_uploaded": 0, "parts_reused": 0, "uploads_aborted": 0, "uploads_resumed": 0}
        self._stats_lock = threading.Lock()

    def _count(self, what: str) -> None:
        with self._stats_lock:
            self.stats[what] += 1

    @classmethod
    def from_reference(cls, ref: Reference, options: TargetOptions | None = None) -> S3Target:
        from modelpack.targets.opener import TargetOptions

        options = options or TargetOptions()
        return cls(
            ref.bucket,
            ref.prefix,
            endpoint=options.s3_endpoint,
            region=options.s3_region,
            settings=S3Settings.from_options(options.extra),
        )

    # ----------------------------------------------------------------- keys & helpers
    def key(self, relpath: str) -> str:
        return f"{self.prefix}/{relpath}" if self.prefix else relpath

    def blob_key(self, digest: str) -> str:
        return self.key(f"blobs/sha256/{Digest(digest).hex}")

    def _where(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def _call(self, operation: str, key: str, fn: Callable[..., Any], **kwargs: Any) -> Any:
        try:
            return fn(Bucket=self.bucket, Key=key, **kwargs)
        except _client_errors() as exc:
            raise _wrap(exc, operation, self._where(key)) from exc

    def _head_size(self, key: str) -> int | None:
        try:
            resp = self.client.head_object(Bucket=self.bucket, Key=key)
        except _client_errors() as exc:
            if _is_not_found(exc):
                return None
            raise _wrap(exc, "HeadObject", self._where(key)) from exc
        return int(resp["ContentLength"])

    def _get_small(self, key: str, limit: int, *, what: str) -> tuple[bytes, str] | None:
        """An object of at most ``limit`` bytes and its ETag, or None when absent."""
        try:
            resp = self.client.get_object(Bucket=self.bucket, Key=key)
        except _client_errors() as exc:
            if _is_not_found(exc):
                return None
            raise _wrap(exc, "GetObject", self._where(key)) from exc
        body = resp["Body"]
        try:
            if int(resp.get("ContentLength") or 0) > limit:
                raise S3LayoutError(f"{self._where(key)}: {what} is larger than {limit} bytes; refusing it")
            data: bytes = body.read(limit + 1)
        except _client_errors() as exc:
            raise _wrap(exc, "GetObject", self._where(key)) from exc
        finally:
            body.close()
        if len(data) > limit:
            raise S3LayoutError(f"{self._where(key)}: {what} is larger than {limit} bytes; refusing it")
        return data, str(resp.get("ETag") or "")

    def _put_if_absent(self, key: str, body: bytes, content_type: str) -> bool:
        """PutObject only if no object has the key; False when one already did."""
        kwargs: dict[str, Any] = {"Body": body, "ContentType": content_type}
        if self._conditional:
            try:
                self.client.put_object(Bucket=self.bucket, Key=key, IfNoneMatch="*", **kwargs)
                return True
            except _client_errors() as exc:
                if _is_conflict(exc):
                    return False
                if not (_is_unsupported(exc) and self.settings.conditional_writes == "auto"):
                    raise _wrap(exc, "PutObject", self._where(key)) from exc
                log.warning(
                    "%s: endpoint rejects conditional writes; falling back to HEAD-then-write", self.name
                )
                self._conditional = False
        if self._head_size(key) is not None:
            return False
        self._call("PutObject", key, self.client.put_object, **kwargs)
        return True

    # ----------------------------------------------------------------- layout & index
    @property
    def _index_key(self) -> str:
        return self.key("index.json")

    @staticmethod
    def _empty_index() -> dict[str, Any]:
        return {"schemaVersion": 2, "mediaType": MEDIA_TYPE_OCI_INDEX, "manifests": []}

    def _check_layout_bytes(self, raw: bytes) -> None:
        try:
            version = json.loads(raw).get("imageLayoutVersion")
        except (ValueError, AttributeError) as exc:
            raise S3LayoutError(
                f"{self._where(self.key('oci-layout'))}: unreadable oci-layout: {exc}"
            ) from exc
        if version != "1.0.0":
            raise S3LayoutError(
                f"{self._where(self.key('oci-layout'))}: unsupported imageLayoutVersion {version!r}"
            )

    def _ensure_layout(self) -> None:
        """Create ``oci-layout`` (if absent) before the first write; check it if present."""
        if self._layout_ok:
            return
        key = self.key("oci-layout")
        got = self._get_small(key, 4096, what="oci-layout")
        if got is None:
            if not self._put_if_absent(key, LAYOUT_FILE, "application/json"):
                got = self._get_small(key, 4096, what="oci-layout")
        if got is not None:
            self._check_layout_bytes(got[0])
        self._layout_ok = True

    def _read_index(self, *, must_exist: bool = True) -> tuple[dict[str, Any], str | None]:
        got = self._get_small(self._index_key, MAX_INDEX_BYTES, what="index.json")
        if got is None:
            if must_exist:
                raise NotFoundError(f"{self.name} is not an OCI layout (no index.json)")
            return self._empty_index(), None
        raw, etag = got
        try:
            doc = json.loads(raw)
        except ValueError as exc:
            raise S3LayoutError(f"{self._where(self._index_key)}: invalid index: {exc}") from exc
        if not isinstance(doc, dict) or not isinstance(doc.get("manifests", []), list):
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
            if self._conditional:
                kwargs.update({"IfMatch": etag} if etag else {"IfNoneMatch": "*"})
            try:
                self.client.put_object(Bucket=self.bucket, Key=key, **kwargs)
                return
            except _client_errors() as exc:
                if self._conditional and _is_conflict(exc):
                    delay = min(1.0, 0.01 * (2**attempt)) * (0.5 + random.random())
                    log.debug(
                        "%s: index.json changed concurrently; retry %d in %.2fs",
                        self.name,
                        attempt + 1,
                        delay,
                    )
                    time.sleep(delay)
                    continue
                if self._conditional and _is_unsupported(exc) and self.settings.conditional_writes == "auto":
                    log.warning(
                        "%s: endpoint rejects conditional writes; index.json is last-writer-wins", self.name
                    )
                    self._conditional = False
                    continue
                raise _wrap(exc, "PutObject", self._where(key)) from exc
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
        got = self._get_small(key, MAX_MANIFEST_BYTES, what="manifest")
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
        if offset == descriptor.size and self._head_size(key) is None:
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
        resp = self._call(
            "GetObject", key, self.client.get_object, Range=f"bytes={offset}-{offset + length - 1}"
        )
        body = resp["Body"]
        try:
            total = _object_size(resp)
            if total is not None and total != descriptor.size:
                raise SizeMismatchError(descriptor.digest, descriptor.size, total, source=where)
            data = _read_exact(body, length)
        finally:
            body.close()
        if len(data) != length:
            raise SizeMismatchError(descriptor.digest, offset + length, offset + len(data), source=where)
        return data

    def exists(self, descriptor: Descriptor) -> bool:
        return self._head_size(self.blob_key(descriptor.digest)) == descriptor.size

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
    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    max_workers=self.settings.concurrency, thread_name_prefix="modelpack-s3-part"
                )
            return self._pool

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None

    def push_blob(self, source: BlobSource) -> None:
        desc = source.descriptor
        key = self.blob_key(desc.digest)
        self._ensure_layout()
        present = self._head_size(key)
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
            self._put_multipart(source, key)
        stored = self._head_size(key)
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
        self._put_if_absent(key, data, "application/octet-stream")

    # multipart ---------------------------------------------------------------
    def _list_parts(self, key: str, upload_id: str) -> dict[int, _Part]:
        parts: dict[int, _Part] = {}
        marker = 0
        while True:
            resp = self._call(
                "ListParts", key, self.client.list_parts, UploadId=upload_id, PartNumberMarker=marker
            )
            for p in resp.get("Parts", []):
                parts[int(p["PartNumber"])] = _Part(int(p["PartNumber"]), int(p["Size"]), str(p["ETag"]))
            if not resp.get("IsTruncated"):
                return parts
            marker = int(resp["NextPartNumberMarker"])

    def incomplete_uploads(self, key: str) -> list[dict[str, Any]]:
        """In-progress multipart uploads for exactly ``key``, newest first."""
        out: list[dict[str, Any]] = []
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": key}
        while True:
            try:
                resp = self.client.list_multipart_uploads(**kwargs)
            except _client_errors() as exc:
                raise _wrap(exc, "ListMultipartUploads", self._where(key)) from exc
            out += [u for u in resp.get("Uploads", []) if u.get("Key") == key]
            if not resp.get("IsTruncated"):
                break
            kwargs["KeyMarker"] = resp.get("NextKeyMarker")
            kwargs["UploadIdMarker"] = resp.get("NextUploadIdMarker")
        out.sort(key=lambda u: u.get("Initiated") or 0, reverse=True)
        return out

    def _abort(self, key: str, upload_id: str) -> None:
        try:
            self.client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
            self._count("uploads_aborted")
            log.debug("%s: aborted multipart upload for %s", self.name, key)
        except _client_errors() as exc:
            if not _is_not_found(exc) and _error_code(exc)[0] != "NoSuchUpload":
                log.warning("%s: could not abort an upload for %s: %s", self.name, key, _error_code(exc)[0])

    def _find_resumable(self, key: str, size: int) -> tuple[str, int, dict[int, _Part]] | None:
        """Pick an interrupted upload of this blob to resume; abort the ones that cannot be."""
        chosen: tuple[str, int, dict[int, _Part]] | None = None
        for upload in self.incomplete_uploads(key):
            upload_id = str(upload["UploadId"])
            if chosen is None:
                try:
                    parts = self._list_parts(key, upload_id)
                except NotFoundError:
                    continue
                part_size = parts[1].size if 1 in parts else self.settings.part_size
                count = -(-size // part_size) if part_size else 0
                ok = (
                    part_size >= 1
                    and count <= MAX_PARTS
                    and all(
                        p.number <= count and (p.size == part_size or p.number == count)
                        for p in parts.values()
                    )
                )
                if ok:
                    chosen = (upload_id, part_size, parts)
                    continue
            self._abort(key, upload_id)
        return chosen

    def _upload_part(self, key: str, upload_id: str, number: int, data: bytes) -> str:
        try:
            resp = self._call(
                "UploadPart", key, self.client.upload_part, UploadId=upload_id, PartNumber=number, Body=data
            )
            self._count("parts_uploaded")
            return str(resp["ETag"])
        finally:
            self._part_slots.release()

    def _put_multipart(self, source: BlobSource, key: str) -> None:
        desc = source.descriptor
        where = self._where(key)
        resumable = self._find_resumable(key, desc.size)
        if resumable is not None:
            upload_id, part_size, existing = resumable
            self._count("uploads_resumed")
            log.debug("%s: resuming upload of %s (%d parts stored)", self.name, key, len(existing))
        else:
            part_size = max(self.settings.part_size, -(-desc.size // MAX_PARTS))
            existing = {}
            resp = self._call(
                "CreateMultipartUpload",
                key,
                self.client.create_multipart_upload,
                ContentType="application/octet-stream",
            )
            upload_id = str(resp["UploadId"])
        count = -(-desc.size // part_size)
        pool = self._executor()
        futures: list[tuple[int, Future[str]]] = []
        etags: dict[int, str] = {}
        h = hashlib.sha256()
        try:
            with source.open(0) as raw:
                for number in range(1, count + 1):
                    want = min(part_size, desc.size - (number - 1) * part_size)
                    data = _read_exact(raw, want)
                    if len(data) != want:
                        raise SizeMismatchError(
                            desc.digest,
                            desc.size,
                            (number - 1) * part_size + len(data),
                            source=f"upload to {where}",
                        )
                    h.update(data)
                    prev = existing.get(number)
                    if (
                        prev is not None
                        and prev.size == want
                        and prev.etag.strip('"') == hashlib.md5(data).hexdigest()
                    ):
                        etags[number] = prev.etag
                        self._count("parts_reused")
                        continue
                    self._part_slots.acquire()
                    try:
                        fut = pool.submit(self._upload_part, key, upload_id, number, data)
                    except BaseException:
                        self._part_slots.release()
                        raise
                    futures.append((number, fut))
                    for _n, f in futures:  # surface a failed part early
                        if f.done() and f.exception() is not None:
                            f.result()
                if raw.read(1):
                    raise SizeMismatchError(
                        desc.digest, desc.size, desc.size + 1, source=f"upload to {where}"
                    )
            actual = "sha256:" + h.hexdigest()
            if actual != desc.digest:
                raise DigestMismatchError(desc.digest, actual, what="blob", source=f"upload to {where}")
            for number, fut in futures:
                etags[number] = fut.result()
        except (DigestMismatchError, SizeMismatchError):
            # Wrong bytes: never complete this upload.
            self._drain(futures)
            self._abort(key, upload_id)
            raise
        except BaseException:
            # Interrupted, lost connection, refused request: keep the upload so a rerun resumes
            # it (it stays invisible; the rerun re-verifies every stored part).
            self._drain(futures)
            raise
        parts = [{"PartNumber": n, "ETag": etags[n]} for n in range(1, count + 1)]
        kwargs: dict[str, Any] = {"UploadId": upload_id, "MultipartUpload": {"Parts": parts}}
        if self._conditional:
            kwargs["IfNoneMatch"] = "*"
        try:
            self.client.complete_multipart_upload(Bucket=self.bucket, Key=key, **kwargs)
        except _client_errors() as exc:
            if _is_conflict(exc):  # another writer completed the same blob first
                self._abort(key, upload_id)
                return
            if _error_code(exc)[0] == "NoSuchUpload" and self._head_size(key) == desc.size:
                return  # a concurrent writer resumed and completed our upload of the same bytes
            if _is_unsupported(exc) and self.settings.conditional_writes == "auto":
                self._conditional = False
                if self._head_size(key) is None:
                    kwargs.pop("IfNoneMatch", None)
                    self._call(
                        "CompleteMultipartUpload", key, self.client.complete_multipart_upload, **kwargs
                    )
                else:
                    self._abort(key, upload_id)
                return
            raise _wrap(exc, "CompleteMultipartUpload", where) from exc

    @staticmethod
    def _drain(futures: list[tuple[int, Future[str]]]) -> None:
        for _n, f in futures:
            f.cancel()
        for _n, f in futures:
            with contextlib.suppress(BaseException):
                f.result()

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
        if self._head_size(key) != len(raw):
            self._put_if_absent(key, raw, media_type)
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

    def untag(self, tag: str) -> None:
        validate_tag(tag)
        self._update_index(lambda entries: index_entries_without(entries, tag))


__all__ = ["S3Error", "S3LayoutError", "S3ReadStream", "S3Settings", "S3Target", "make_client"]
