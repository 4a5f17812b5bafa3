"""Stopping a transfer's siblings: the first failure (or a signal) sets one ``Cancel`` that
every worker checks between reads, so siblings stop within one chunk and clean up after
themselves (the blob writer removes their partials, ``run_all`` waits for them)."""

from __future__ import annotations

import threading
from typing import Any

from modelpack.errors import TransferCancelled
from modelpack.progress import TransferBar


class Cancel:
    """Set once by the thread that saw the first failure (or a signal); every worker checks it
    between reads, so siblings stop within one chunk and clean up after themselves."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def set(self) -> None:
        self._event.set()

    def check(self) -> None:
        if self._event.is_set():
            raise TransferCancelled("cancelled: another part of this transfer failed or was interrupted")


class CancellableReader:
    """A stream that stops with ``TransferInterrupted`` once ``cancel`` is set and reports progress."""

    def __init__(self, raw: Any, cancel: Cancel, bar: TransferBar | None = None) -> None:
        self._raw = raw
        self._cancel = cancel
        self._bar = bar

    def read(self, n: int = -1) -> bytes:
        self._cancel.check()
        data: bytes = self._raw.read(n)
        if self._bar is not None and data:
            self._bar.update(len(data))
        return data

    def readinto(self, buf: Any) -> int:
        view = memoryview(buf).cast("B")
        data = self.read(len(view))
        view[: len(data)] = data
        return len(data)

    def close(self) -> None:
        close = getattr(self._raw, "close", None)
        if close is not None:
            close()


__all__ = ["Cancel", "CancellableReader"]
