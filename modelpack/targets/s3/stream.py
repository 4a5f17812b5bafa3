"""Reading one S3 object as a stream of a known size, resuming a dropped connection mid-read.

Sizes are checked (a short or long object is an error, not a silently spliced stream); digests
are the caller's job, as for every target: the copy engine verifies every blob it moves.
"""

from __future__ import annotations

import contextlib
import io
import logging
from typing import Any

from modelpack.errors import S3Error, SizeMismatchError
from modelpack.targets.s3.client import client_errors, error_code, redact_credentials, wrap_client_error

log = logging.getLogger("modelpack.targets.s3")

READ_RESUMES = 3


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
        except client_errors() as exc:
            if self._etag is not None and error_code(exc)[0] == "PreconditionFailed":
                raise S3Error(
                    f"{self._where}: the object changed while it was being read (ETag no longer "
                    f"{self._etag}); refusing the new bytes",
                    operation="GetObject",
                    key=self._where,
                    code="PreconditionFailed",
                    status=412,
                ) from exc
            raise wrap_client_error(exc, "GetObject", self._where) from exc
        total = object_size(resp)
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
                    raise S3Error(
                        f"{self._where}: read failed at byte {self._pos}: "
                        f"{type(exc).__name__}: {redact_credentials(str(exc))}"
                    ) from exc
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


def object_size(resp: dict[str, Any]) -> int | None:
    """The whole object's size from a GetObject response (``Content-Range`` total if ranged)."""
    cr = resp.get("ContentRange")
    if isinstance(cr, str) and "/" in cr:
        total = cr.rsplit("/", 1)[1]
        return int(total) if total.isdigit() else None
    cl = resp.get("ContentLength")
    return int(cl) if cl is not None else None
