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
from modelpack.targets.retry import OutageClock, RetryBudget
from modelpack.targets.s3.client import (
    client_errors,
    error_code,
    is_transient,
    redact_credentials,
    wrap_client_error,
)

log = logging.getLogger("modelpack.targets.s3")

READ_RESUMES = 3


class S3Patience:
    """A command's patience with an S3 endpoint, shared by all its streams: once the endpoint
    has answered (a listing, a first GET), a connection it refuses, resets or times out is
    retried for ``retry_for`` seconds of outage in all (``--retry-for``, as registry transfers
    are), so a restarting endpoint is ridden out; an endpoint that never answered fails at once
    (a typo'd host is not an outage)."""

    def __init__(self, retry_for: float | None = None) -> None:
        self.retry_for = retry_for
        self.clock = OutageClock()
        self.answered = False

    def budget(self) -> RetryBudget:
        return RetryBudget(self.retry_for if self.answered else 0.0, shared=self.clock)


class S3ReadStream(io.RawIOBase):
    """A GetObject body from ``start`` to ``end``; resumes with a ranged GET if the connection drops.

    A resumed read is pinned to the first response's ETag (``If-Match``), so the bytes cannot
    silently switch to another object version mid-stream. With ``patience``, an endpoint that
    goes away is waited for within its budget (a GET that cannot connect is retried, a cut body
    resumed), instead of ``READ_RESUMES`` immediate attempts.
    """

    def __init__(
        self,
        client: Any,
        bucket: str,
        key: str,
        start: int,
        end: int,
        where: str,
        *,
        etag: str | None = None,
        patience: S3Patience | None = None,
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
        self._patience = patience
        self._budget: RetryBudget | None = None
        if start < end:
            self._open()

    def _wait(self, exc: BaseException) -> bool:
        """After a transient failure: sleep and say True while the patience allows another try."""
        if self._patience is None or not is_transient(exc):
            return False
        if self._budget is None:
            self._budget = self._patience.budget()
        ok = self._budget.wait()
        if ok:
            log.debug("%s: endpoint unavailable (%s); retrying", self._where, type(exc).__name__)
        return ok

    def _open(self) -> None:
        while True:
            try:
                self._open_once()
                return
            except client_errors() as exc:
                if not self._wait(exc):
                    raise wrap_client_error(exc, "GetObject", self._where) from exc

    def _open_once(self) -> None:
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
            raise
        if self._patience is not None:
            self._patience.answered = True
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
                if self._patience is not None:
                    if self._budget is None:
                        self._budget = self._patience.budget()
                    if not self._budget.wait():
                        raise S3Error(
                            f"{self._where}: read failed at byte {self._pos} and the endpoint did not "
                            f"come back within --retry-for: {type(exc).__name__}: "
                            f"{redact_credentials(str(exc))}"
                        ) from exc
                elif self._resumes >= READ_RESUMES:
                    raise S3Error(
                        f"{self._where}: read failed at byte {self._pos}: "
                        f"{type(exc).__name__}: {redact_credentials(str(exc))}"
                    ) from exc
                self._resumes += 1
                log.debug("%s: resuming read at byte %d after %s", self._where, self._pos, type(exc).__name__)
                self._body.close()
                self._open()
                continue
            if self._budget is not None:
                self._budget.progressed()
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
