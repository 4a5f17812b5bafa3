"""Reading response bodies from a registry that may be hostile: bounded in bytes *and* in time.

A socket timeout bounds each read, not a body: a registry that trickles one byte every few
seconds never trips it and can hold a pull, a login or an error report forever. Every body
modelpack reads whole — documents, tokens, error bodies, success bodies it ignores — goes
through ``read_by_deadline``; blobs are streamed, hashed and size-checked elsewhere.
"""

from __future__ import annotations

import time
from typing import Any

#: bytes asked of the socket per read while assembling a small body
READ_CHUNK = 64 * 1024


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
