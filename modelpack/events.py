"""JSON-lines events: every decision that explains a slow or failed model start.

One line per event: ``{"ts": <unix seconds>, "event": "<area>.<what>", ...fields}``. Fields
used across the project: ``reference``, ``digest`` (manifest), ``blob``, ``bytes``,
``duration_ms``, ``reason``, ``stage`` (t2…t9, DESIGN §7), ``state`` (cold | hit | streamed),
``start_id`` (groups the events of one model start). Credentials never go in an event.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import IO, Any

_SECRET_KEYS = ("password", "token", "secret", "authorization", "credential")


class EventLog:
    """Appends events to a file (O_APPEND, one write per line, safe across processes) and/or a stream."""

    def __init__(self, path: str | None = None, stream: IO[str] | None = None) -> None:
        self.path = path
        self.stream = stream
        self._lock = threading.Lock()
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    @classmethod
    def from_spec(cls, path: str | None = None, events: str | None = None) -> EventLog:
        """``events`` is ``-`` for stderr, a file path, or None."""
        if events == "-":
            return cls(path, sys.stderr)
        if events:
            return cls(events if path is None else path, None if path is None else open(events, "a"))
        return cls(path)

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        record: dict[str, Any] = {"ts": round(time.time(), 6), "event": event}
        for key, value in fields.items():
            if value is None:
                continue
            if any(s in key.lower() for s in _SECRET_KEYS):
                raise ValueError(f"refusing to log field {key!r}: it looks like a credential")
            record[key] = value
        line = json.dumps(record, sort_keys=True, default=str) + "\n"
        with self._lock:
            if self.path:
                fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                try:
                    os.write(fd, line.encode())
                finally:
                    os.close(fd)
            if self.stream is not None:
                self.stream.write(line)
                self.stream.flush()
        return record


class NullEventLog(EventLog):
    def __init__(self) -> None:
        super().__init__(None, None)

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        return {"event": event, **fields}


def read_events(path: str) -> list[dict[str, Any]]:
    out = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                doc = json.loads(line)
            except ValueError as exc:
                raise ValueError(f"{path}:{n}: not a JSON line: {exc}") from exc
            if isinstance(doc, dict) and "event" in doc:
                out.append(doc)
    return out
