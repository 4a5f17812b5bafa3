"""Large blobs into S3 as multipart uploads that complete only once the bytes match the digest.

Bytes are hashed as they are read from the source and sent as parts in flight concurrently
(memory bounded by ``concurrency`` parts per target); the upload is completed (with
``If-None-Match: *`` where the endpoint supports it) only after the whole stream matched the
digest and size, and aborted otherwise. An object under a blob key is therefore always complete
and correct when written.

An interrupted upload (process killed, network lost) stays invisible: S3 shows no object until
completion. On the next push of that blob the upload is found with ListMultipartUploads and
resumed: the source is re-hashed from the start, parts already stored whose MD5 ETag matches the
source bytes are kept, others are re-sent; if the digest does not match, the upload is aborted.
Uploads for the key that cannot be resumed (other part layout) are aborted. Buckets should also
carry an ``AbortIncompleteMultipartUpload`` lifecycle rule.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from modelpack.errors import DigestMismatchError, NotFoundError, SizeMismatchError
from modelpack.files import read_exact
from modelpack.targets.base import BlobSource
from modelpack.targets.s3.client import (
    client_errors,
    error_code,
    is_conflict,
    is_not_found,
    is_unsupported,
    wrap_client_error,
)
from modelpack.targets.s3.objects import S3Objects
from modelpack.targets.s3.settings import MAX_PARTS

log = logging.getLogger("modelpack.targets.s3")


@dataclass(frozen=True)
class StoredPart:
    """A part an earlier, interrupted upload left on the server."""

    number: int
    size: int
    etag: str


class MultipartUploader:
    """Multipart uploads into one bucket; owns the part threads (``close`` stops them)."""

    def __init__(self, objects: S3Objects) -> None:
        self._objects = objects
        self._lock = threading.Lock()
        self._part_slots = threading.BoundedSemaphore(objects.settings.concurrency)
        self._pool: ThreadPoolExecutor | None = None

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    max_workers=self._objects.settings.concurrency, thread_name_prefix="modelpack-s3-part"
                )
            return self._pool

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None

    def _list_parts(self, key: str, upload_id: str) -> dict[int, StoredPart]:
        objects = self._objects
        parts: dict[int, StoredPart] = {}
        marker = 0
        while True:
            resp = objects.call(
                "ListParts", key, objects.client.list_parts, UploadId=upload_id, PartNumberMarker=marker
            )
            for p in resp.get("Parts", []):
                parts[int(p["PartNumber"])] = StoredPart(int(p["PartNumber"]), int(p["Size"]), str(p["ETag"]))
            if not resp.get("IsTruncated"):
                return parts
            marker = int(resp["NextPartNumberMarker"])

    def incomplete_uploads(self, key: str) -> list[dict[str, Any]]:
        """In-progress multipart uploads for exactly ``key``, newest first."""
        objects = self._objects
        out: list[dict[str, Any]] = []
        kwargs: dict[str, Any] = {"Bucket": objects.bucket, "Prefix": key}
        while True:
            try:
                resp = objects.client.list_multipart_uploads(**kwargs)
            except client_errors() as exc:
                raise wrap_client_error(exc, "ListMultipartUploads", objects.where(key)) from exc
            out += [u for u in resp.get("Uploads", []) if u.get("Key") == key]
            if not resp.get("IsTruncated"):
                break
            kwargs["KeyMarker"] = resp.get("NextKeyMarker")
            kwargs["UploadIdMarker"] = resp.get("NextUploadIdMarker")
        out.sort(key=lambda u: u.get("Initiated") or 0, reverse=True)
        return out

    def _abort(self, key: str, upload_id: str) -> None:
        objects = self._objects
        try:
            objects.client.abort_multipart_upload(Bucket=objects.bucket, Key=key, UploadId=upload_id)
            objects.count("uploads_aborted")
            log.debug("%s: aborted multipart upload for %s", objects.name, key)
        except client_errors() as exc:
            if not is_not_found(exc) and error_code(exc)[0] != "NoSuchUpload":
                log.warning("%s: could not abort an upload for %s: %s", objects.name, key, error_code(exc)[0])

    def _find_resumable(self, key: str, size: int) -> tuple[str, int, dict[int, StoredPart]] | None:
        """Pick an interrupted upload of this blob to resume; abort the ones that cannot be."""
        chosen: tuple[str, int, dict[int, StoredPart]] | None = None
        for upload in self.incomplete_uploads(key):
            upload_id = str(upload["UploadId"])
            if chosen is None:
                try:
                    parts = self._list_parts(key, upload_id)
                except NotFoundError:
                    continue
                part_size = parts[1].size if 1 in parts else self._objects.settings.part_size
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
        objects = self._objects
        try:
            resp = objects.call(
                "UploadPart",
                key,
                objects.client.upload_part,
                UploadId=upload_id,
                PartNumber=number,
                Body=data,
            )
            objects.count("parts_uploaded")
            return str(resp["ETag"])
        finally:
            self._part_slots.release()

    def upload(self, source: BlobSource, key: str) -> None:
        """Store ``source`` under ``key``, resuming an interrupted upload of it if one is left."""
        objects = self._objects
        desc = source.descriptor
        where = objects.where(key)
        resumable = self._find_resumable(key, desc.size)
        if resumable is not None:
            upload_id, part_size, existing = resumable
            objects.count("uploads_resumed")
            log.debug("%s: resuming upload of %s (%d parts stored)", objects.name, key, len(existing))
        else:
            part_size = max(objects.settings.part_size, -(-desc.size // MAX_PARTS))
            existing = {}
            resp = objects.call(
                "CreateMultipartUpload",
                key,
                objects.client.create_multipart_upload,
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
                    data = read_exact(raw, want)
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
                        objects.count("parts_reused")
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
        self._complete(
            key, upload_id, [{"PartNumber": n, "ETag": etags[n]} for n in range(1, count + 1)], desc.size
        )

    def _complete(self, key: str, upload_id: str, parts: list[dict[str, Any]], size: int) -> None:
        """Complete only if no object has the key yet: another writer may have stored the blob."""
        objects = self._objects
        kwargs: dict[str, Any] = {"UploadId": upload_id, "MultipartUpload": {"Parts": parts}}
        if objects.conditional:
            kwargs["IfNoneMatch"] = "*"
        try:
            objects.client.complete_multipart_upload(Bucket=objects.bucket, Key=key, **kwargs)
        except client_errors() as exc:
            if is_conflict(exc):  # another writer completed the same blob first
                self._abort(key, upload_id)
                return
            if error_code(exc)[0] == "NoSuchUpload" and objects.head_size(key) == size:
                return  # a concurrent writer resumed and completed our upload of the same bytes
            if is_unsupported(exc) and objects.settings.conditional_writes == "auto":
                objects.conditional = False
                if objects.head_size(key) is None:
                    kwargs.pop("IfNoneMatch", None)
                    objects.call(
                        "CompleteMultipartUpload", key, objects.client.complete_multipart_upload, **kwargs
                    )
                else:
                    self._abort(key, upload_id)
                return
            raise wrap_client_error(exc, "CompleteMultipartUpload", objects.where(key)) from exc

    @staticmethod
    def _drain(futures: list[tuple[int, Future[str]]]) -> None:
        for _n, f in futures:
            f.cancel()
        for _n, f in futures:
            with contextlib.suppress(BaseException):
                f.result()
