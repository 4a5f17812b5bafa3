"""Transfer progress as plain lines, for ``kubectl logs`` (no bars, no carriage returns).

``CountingTarget`` wraps the target a pull reads from and counts the blob bytes that arrive;
``ProgressLines`` prints one line every ``interval`` seconds while a pull runs::

    [1/2] modelpack://registry.example/models/llama@sha256:3f… → /mnt/models: 1.2 GiB of 4.0 GiB, 96.0 MiB/s
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, BinaryIO

from modelpack.oci.descriptor import Descriptor, Manifest
from modelpack.targets.base import ReadableTarget, SourceAccounting


def human_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


class _CountingStream:
    def __init__(self, raw: BinaryIO, count: Callable[[int], None]) -> None:
        self._raw = raw
        self._count = count

    def read(self, n: int = -1) -> bytes:
        data = self._raw.read(n)
        self._count(len(data))
        return data

    def readinto(self, buf: Any) -> int:
        n: int = self._raw.readinto(buf)  # type: ignore[attr-defined]
        self._count(n or 0)
        return n

    def __enter__(self) -> _CountingStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self._raw.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


class CountingTarget:
    """A readable target that counts the blob bytes read through it (everything else delegated)."""

    def __init__(self, inner: ReadableTarget) -> None:
        self._inner = inner
        self._lock = threading.Lock()
        self.blob_bytes = 0
        self.total_bytes = 0  # the layers' size, once a manifest was read

    def _count(self, n: int) -> None:
        if n:
            with self._lock:
                self.blob_bytes += n

    def fetch_manifest(self, reference: str) -> tuple[bytes, str]:
        raw, media_type = self._inner.fetch_manifest(reference)
        try:
            manifest = Manifest.parse(raw)
            self.total_bytes = sum(layer.size for layer in manifest.layers)
        except Exception:  # an index or a bad document: the pull itself reports it
            pass
        return raw, media_type

    def fetch_blob(self, descriptor: Descriptor, offset: int = 0) -> BinaryIO:
        return _CountingStream(self._inner.fetch_blob(descriptor, offset), self._count)  # type: ignore[return-value]

    def fetch_range(self, descriptor: Descriptor, offset: int, length: int) -> bytes:
        data = self._inner.fetch_range(descriptor, offset, length)
        self._count(len(data))
        return data

    def bytes_by_source(self) -> dict[str, int]:
        """The inner target's per-source bytes (a capability is declared, not found through
        ``__getattr__``: Python 3.12's Protocol checks do not look there)."""
        inner = self._inner
        return inner.bytes_by_source() if isinstance(inner, SourceAccounting) else {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class ProgressLines:
    """Prints ``label: X of Y, R/s`` every ``interval`` seconds (0: never) while in the ``with``."""

    def __init__(
        self, label: str, target: CountingTarget, write: Callable[[str], None], interval: float
    ) -> None:
        self._label = label
        self._target = target
        self._write = write
        self._interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._start = time.monotonic()

    def line(self) -> str:
        done = self._target.blob_bytes
        elapsed = max(time.monotonic() - self._start, 1e-6)
        total = f" of {human_size(self._target.total_bytes)}" if self._target.total_bytes else ""
        return f"{self._label}: downloaded {human_size(done)}{total}, {human_size(done / elapsed)}/s"

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self._write(self.line())

    def __enter__(self) -> ProgressLines:
        if self._interval > 0:
            self._thread = threading.Thread(target=self._run, name="kserve-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
