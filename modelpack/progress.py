"""Progress bars on a terminal, silence in CI: ``--progress auto|on|off``.

Bars are drawn from worker threads, so a reader that goes away (``| head -c 300``, a closed
terminal) must not leave a thread dead inside tqdm's lock: every write goes through a stream that
never raises, and the next progress update raises ``OutputClosedError`` so the transfer stops
the way a process stops on SIGPIPE (its temp files removed on the way out).
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any, BinaryIO

from modelpack.errors import OutputClosedError
from modelpack.terminal import for_terminal, unfiltered


def progress_enabled(mode: str = "auto") -> bool:
    if mode == "on":
        return True
    if mode == "off":
        return False
    if os.environ.get("CI"):
        return False
    return sys.stderr.isatty()


class _GuardedStream:
    """stderr as tqdm sees it: a write to a reader that went away (EPIPE, EIO, closed) marks the
    stream ``broken`` and is dropped instead of raising inside tqdm's lock."""

    def __init__(self, raw: Any) -> None:
        self._raw = raw
        self.broken = False

    def write(self, text: str) -> int:
        if not self.broken:
            try:
                self._raw.write(text)
            except (OSError, ValueError, AttributeError):  # AttributeError: no stderr at all
                self.broken = True
        return len(text)

    def flush(self) -> None:
        if not self.broken:
            try:
                self._raw.flush()
            except (OSError, ValueError, AttributeError):  # AttributeError: no stderr at all
                self.broken = True

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


class Progress:
    """A total bar plus one bar per transfer; a no-op when disabled (no tqdm import either)."""

    def __init__(self, total: int, desc: str, mode: str = "auto") -> None:
        self.enabled = progress_enabled(mode)
        self._lock = threading.Lock()
        self._bar: Any = None
        self._positions: set[int] = set()
        # the bars' own cursor moves must reach the terminal; outside names in them are escaped
        self._out = _GuardedStream(unfiltered(sys.stderr))
        if self.enabled:
            from tqdm import tqdm

            self._tqdm = tqdm
            self._bar = tqdm(
                total=total,
                desc=for_terminal(desc),
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                position=0,
                leave=True,
                file=self._out,
            )

    def update(self, n: int) -> None:
        if self._bar is not None:
            self.check_output()
            with self._lock:
                self._bar.update(n)

    def check_output(self) -> None:
        """Raise ``OutputClosedError`` once stderr is gone (the transfer should stop, like on SIGPIPE)."""
        if self._out.broken:
            raise OutputClosedError("stderr was closed while progress was being drawn")

    def transfer(self, total: int, desc: str) -> TransferBar:
        if not self.enabled:
            return TransferBar(self, None, 0)
        with self._lock:
            pos = 1
            while pos in self._positions:
                pos += 1
            self._positions.add(pos)
            bar = self._tqdm(
                total=total,
                desc=for_terminal(desc)[:40],
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                position=pos,
                leave=False,
                file=self._out,
            )
        return TransferBar(self, bar, pos)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class TransferBar:
    def __init__(self, parent: Progress, bar: Any, pos: int) -> None:
        self._parent = parent
        self._bar = bar
        self._pos = pos

    def update(self, n: int) -> None:
        self._parent.update(n)
        if self._bar is not None:
            self._bar.update(n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            with self._parent._lock:
                self._parent._positions.discard(self._pos)


class CountingReader:
    """Reports bytes read from a stream to a progress bar (and counts them for results)."""

    def __init__(self, raw: BinaryIO, bar: TransferBar | None = None) -> None:
        self._raw = raw
        self._bar = bar
        self.count = 0

    def read(self, n: int = -1) -> bytes:
        data = self._raw.read(n)
        self.count += len(data)
        if self._bar is not None and data:
            self._bar.update(len(data))
        return data

    def readinto(self, buf: Any) -> int:
        n: int = self._raw.readinto(buf)  # type: ignore[attr-defined]
        self.count += n or 0
        if self._bar is not None and n:
            self._bar.update(n)
        return n

    def close(self) -> None:
        self._raw.close()

    def __enter__(self) -> CountingReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
