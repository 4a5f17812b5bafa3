"""A fill in flight, followed by its readers: the bytes ``cache serve`` streams before it committed them.

A fill streams (:class:`Fill`): its requesters are answered from the growing temp file as the
origin's bytes land, not once the whole blob is committed (store-and-forward left a requester's
throughput window empty, it abandoned the owner, and the next-ranked peer filled the blob from
the origin again). So a peer now sends bytes it has not verified yet. That is safe because the
client hashes every byte before using any (``MirroredBlobs`` spools and verifies whole blobs;
ranges are checked against the signed chunk table, as from the origin), and because the last byte
of a blob is held back until the fill verified and committed it: a fill that fails (short, too
long, wrong digest, origin error) cuts every response still streaming from it before its last
byte, so no client ever receives a complete wrong blob from a peer, and it abandons this source
for its next one at once.
"""

from __future__ import annotations

import os
import threading
import time

#: states of a :class:`Fill`
RUNNING, DONE, FAILED = "running", "done", "failed"
#: a waiting reader wakes at least this often (to notice a server shutdown)
WAKE_S = 0.5


class Fill:
    """One fill in flight: the origin's bytes land in a temp file that its readers follow.

    ``written`` grows as bytes are on disk; a reader may send up to ``sendable()``: everything
    written but the blob's last byte while the fill runs, the whole blob once it is verified and
    committed (``DONE``). ``FAILED`` ends every reader short of the end."""

    def __init__(self, digest: str, size: int) -> None:
        self.digest = digest
        self.size = size
        self.cond = threading.Condition()
        self.written = 0
        self.state = RUNNING
        self._fd: int | None = None  # read-only fd on the temp file while the fill runs
        self.temp_path: str | None = None  # the temp file, once opened

    def sendable(self) -> int:
        if self.state == DONE:
            return self.size
        return 0 if self.state == FAILED else min(self.written, self.size - 1)

    def reader(self) -> int | None:
        """A private fd on the temp file (the committed blob's inode once renamed), or None when
        there is none (the fill is over, or did not write a temp file): read the committed blob."""
        with self.cond:
            return os.dup(self._fd) if self._fd is not None else None

    def wait(self, pos: int, timeout: float, stop: threading.Event | None = None) -> tuple[int, str]:
        """(sendable bytes, state) as soon as more than ``pos`` bytes are sendable or the fill
        ended, else after ``timeout`` seconds (or ``stop``): bounded, woken every ``WAKE_S``."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while self.state == RUNNING and self.sendable() <= pos:
                left = deadline - time.monotonic()
                if left <= 0 or (stop is not None and stop.is_set()):
                    break
                self.cond.wait(min(left, WAKE_S))
            return self.sendable(), self.state

    def opened(self, fd: int) -> None:
        with self.cond:
            self._fd = fd

    def landed(self, n: int) -> None:
        with self.cond:
            self.written = min(n, self.size)
            self.cond.notify_all()

    def end(self, state: str) -> None:
        with self.cond:
            self.state = state
            if self._fd is not None:
                os.close(self._fd)  # readers hold their own dup
                self._fd = None
            self.cond.notify_all()


__all__ = ["DONE", "FAILED", "RUNNING", "WAKE_S", "Fill"]
