"""JSON-lines events: every decision that explains a slow or failed model start.

One line per event: ``{"ts": <unix seconds>, "event": "<area>.<what>", ...fields}``. Fields
used across the project: ``reference``, ``digest`` (manifest), ``blob``, ``bytes``,
``duration_ms``, ``reason``, ``stage`` (t2…t9, docs/vllm.md#the-timeline-t0--t9), ``state`` (cold | hit | streamed),
``start_id`` (groups the events of one model start). Credentials never go in an event.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import sys
import threading
import time
from typing import IO, Any

from modelpack.errors import EventLogError

_SECRET_KEYS = ("password", "token", "secret", "authorization", "credential")
_OPEN_FLAGS = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
FILE_MODE = 0o644


def open_event_file(path: str) -> int:
    """An fd to append events to ``path`` (created ``0644``), or ``EventLogError`` naming it.

    Never through a symlink at ``path`` (``O_NOFOLLOW``), never into a file of another uid (a
    planted file in a shared directory: root's events would land in a file its planter reads and
    controls), never into a file with other hard links (someone else's file linked in under that
    name), and never into something that cannot take them (a read-only mode such as
    ``/proc/version``'s, a directory)."""
    try:
        fd = os.open(path, _OPEN_FLAGS, FILE_MODE)
    except OSError as exc:
        raise EventLogError(f"{path}: cannot write events there ({_reason(exc)})") from exc
    try:
        st = os.fstat(fd)
        euid = os.geteuid()
        if st.st_uid not in (euid, 0):
            raise EventLogError(
                f"{path}: owned by uid {st.st_uid}, not by you (uid {euid}); refusing to write events "
                "into another user's file (remove it or choose another --events path)"
            )
        if stat.S_ISREG(st.st_mode) and st.st_nlink != 1:
            raise EventLogError(
                f"{path}: has {st.st_nlink} hard links; refusing to write events into a file that is "
                "also somewhere else (remove it or choose another --events path)"
            )
        if stat.S_ISREG(st.st_mode) and not stat.S_IMODE(st.st_mode) & stat.S_IWUSR:
            raise EventLogError(f"{path}: not a writable file (mode {stat.S_IMODE(st.st_mode):04o})")
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISFIFO(st.st_mode) or stat.S_ISCHR(st.st_mode)):
            raise EventLogError(f"{path}: not a file, FIFO or character device; cannot write events there")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _reason(exc: OSError) -> str:
    if exc.errno == errno.ELOOP:
        return "a symlink; event logs are never opened through one"
    return exc.strerror or type(exc).__name__


class EventLog:
    """Appends events to files (O_APPEND, one write per line, safe across processes) and/or a stream.

    ``path`` is the primary file; ``also`` another file the caller asked for (``--events FILE``).
    A file given by the caller is required: it is checked when the log is made and a failure to
    write it is an ``EventLogError`` naming it. With ``best_effort`` the primary file is a
    convenience (the node cache's own ``events.jsonl``, which a read-only cache or a reader of
    another uid cannot write): when it cannot be written, events still go to ``also`` and the
    stream, one line on stderr says so, and nothing fails because of it.
    """

    def __init__(
        self,
        path: str | None = None,
        stream: IO[str] | None = None,
        *,
        also: str | None = None,
        best_effort: bool = False,
    ) -> None:
        self.path = path
        self.stream = stream
        self.also = also
        self.best_effort = best_effort
        self._lock = threading.Lock()
        self._primary_failed = False
        for required in ([] if best_effort else [path]) + [also]:
            if required:
                with contextlib.suppress(OSError):
                    os.makedirs(os.path.dirname(os.path.abspath(required)), exist_ok=True)
                os.close(open_event_file(required))

    @classmethod
    def from_spec(
        cls, path: str | None = None, events: str | None = None, *, best_effort: bool = False
    ) -> EventLog:
        """``events`` is ``-`` for stderr, a file path, or None; ``path`` the primary file."""
        if events == "-":
            return cls(path, sys.stderr, best_effort=best_effort)
        if events and path is None:
            return cls(events)
        return cls(path, also=events or None, best_effort=best_effort)

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        record: dict[str, Any] = {"ts": round(time.time(), 6), "event": event}
        for key, value in fields.items():
            if value is None:
                continue
            if any(s in key.lower() for s in _SECRET_KEYS):
                raise ValueError(f"refusing to log field {key!r}: it looks like a credential")
            record[key] = value
        line = (json.dumps(record, sort_keys=True, default=str) + "\n").encode()
        with self._lock:
            if self.path and not self._primary_failed:
                try:
                    _append(self.path, line)
                except EventLogError as exc:
                    if not self.best_effort:
                        raise
                    self._primary_failed = True
                    with contextlib.suppress(OSError, ValueError):
                        sys.stderr.write(
                            f"modelpack: events not recorded ({exc}); --events FILE or - keeps them\n"
                        )
            if self.also:
                _append(self.also, line)
            if self.stream is not None:
                self.stream.write(line.decode())
                self.stream.flush()
        return record


def _append(path: str, line: bytes) -> None:
    fd = open_event_file(path)
    try:
        os.write(fd, line)
    except OSError as exc:
        raise EventLogError(f"{path}: writing an event failed ({_reason(exc)})") from exc
    finally:
        os.close(fd)


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
