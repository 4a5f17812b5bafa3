"""Reading responses from a registry that may be hostile: bodies bounded in bytes *and* in time,
and which failures are the transport's (worth a retry).

A socket timeout bounds each read, not a body: a registry that trickles one byte every few
seconds never trips it and can hold a pull, a login or an error report forever. Every body
modelpack reads whole — documents, tokens, error bodies, success bodies it ignores — goes
through ``read_by_deadline``; blobs are streamed, hashed and size-checked elsewhere.
"""

from __future__ import annotations

import http.client
import socket
import time
from typing import Any

import requests
import urllib3

from modelpack import boundedjson
from modelpack.errors import DocumentError

#: bytes asked of the socket per read while assembling a small body
READ_CHUNK = 64 * 1024
MAX_ERROR_BODY = 64 * 1024
#: what is read of a success body nobody uses (GET /v2/, 201/202 answers) before the connection is dropped
MAX_IGNORED_BODY = 64 * 1024
#: how long an error body or an ignored success body may take to arrive (then it is dropped)
SMALL_BODY_SECONDS = 30.0
#: what a cut, reset or timed-out connection raises, whichever layer notices it first (requests'
#: own errors derive from OSError too: ``is_transport_error`` tells the transient ones apart)
TRANSPORT_ERRORS: tuple[type[BaseException], ...] = (
    requests.exceptions.RequestException,
    urllib3.exceptions.HTTPError,
    http.client.HTTPException,
    OSError,
)
_REQUESTS_TRANSIENT = (
    requests.exceptions.ConnectionError,
    requests.exceptions.Timeout,
    requests.exceptions.ChunkedEncodingError,
)


def is_transport_error(exc: BaseException) -> bool:
    """A cut, reset, refused or timed-out connection (worth a retry), as opposed to a request
    ``requests`` refused to make (bad URL, redirect loop) or a body it could not decode."""
    if isinstance(exc, requests.exceptions.RequestException):
        return isinstance(exc, _REQUESTS_TRANSIENT)
    return isinstance(exc, TRANSPORT_ERRORS)


def unreachable_reason(exc: BaseException) -> str | None:
    """Why a host cannot be reached at all — "connection refused" (nothing listens on the port) or
    "the host name does not resolve" — found anywhere in the chain ``requests`` and ``urllib3``
    wrap it in; None for a failure of a connection that was made (a reset, a timeout, a cut body).
    From a host that never answered, these cannot heal within a retry budget: a typo'd port or
    host name, not an outage."""
    seen: set[int] = set()
    stack: list[BaseException | None] = [exc]
    while stack:
        err = stack.pop()
        if err is None or id(err) in seen:
            continue
        seen.add(id(err))
        if isinstance(err, (urllib3.exceptions.NameResolutionError, socket.gaierror)):
            return "the host name does not resolve"
        if isinstance(err, ConnectionRefusedError):
            return "connection refused"
        stack += [err.__cause__, err.__context__, getattr(err, "reason", None)]
        stack += [arg for arg in err.args if isinstance(arg, BaseException)]
    return None


def read_by_deadline(
    raw: Any, limit: int, seconds: float, *, decode_content: bool = True
) -> tuple[bytes, bool]:
    """Up to ``limit`` bytes of ``raw`` (a urllib3 response), read as they arrive.

    Returns ``(body, in_time)``: ``in_time`` is False when ``seconds`` passed before the body
    ended or reached ``limit`` (the caller refuses a document, or drops the connection)."""
    deadline = time.monotonic() + seconds
    body = bytearray()
    while len(body) < limit:
        # read1: whatever has arrived (read() would wait for the whole amount)
        chunk = raw.read1(min(READ_CHUNK, limit - len(body)), decode_content=decode_content)
        if not chunk:
            return bytes(body), True
        body += chunk
        if time.monotonic() > deadline and len(body) < limit:
            return bytes(body), False
    return bytes(body), True


def discard_body(resp: requests.Response, seconds: float) -> None:
    """Consume a success body nobody reads so the connection can be reused — at most
    ``MAX_IGNORED_BODY`` bytes within ``seconds``: a longer, endless or trickling one costs the
    connection instead."""
    try:
        data, in_time = read_by_deadline(resp.raw, MAX_IGNORED_BODY + 1, seconds, decode_content=False)
    except TRANSPORT_ERRORS:
        resp.close()
        return
    if len(data) > MAX_IGNORED_BODY or not in_time:
        resp.close()  # drops the connection: the rest of the body is never read
    else:
        resp.raw.release_conn()


def oci_error(response: requests.Response, seconds: float = SMALL_BODY_SECONDS) -> tuple[str | None, str]:
    """First OCI error code and message from an error body (bounded in bytes and time; never raises)."""
    try:
        raw, _ = read_by_deadline(response.raw, MAX_ERROR_BODY, seconds) if response.raw else (b"", True)
    except Exception:
        raw = b""
    try:
        doc = boundedjson.loads(raw, what="error body", max_bytes=MAX_ERROR_BODY, max_depth=16)
    except DocumentError:
        return None, ""
    errs = doc.get("errors") if isinstance(doc, dict) else None
    if isinstance(errs, list) and errs and isinstance(errs[0], dict):
        code = errs[0].get("code")
        msg = errs[0].get("message") or ""
        return (str(code)[:100] if code else None), str(msg)[:300]
    return None, ""
