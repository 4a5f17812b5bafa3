"""The one spelling of a time that modelpack writes for people and machines: RFC 3339 in UTC.

``2026-12-03T18:00:00Z`` everywhere (``--json`` outputs, annotations, config ``createdAt``),
with microseconds only where the order of two events within a second matters (signing times:
a rollback check compares them). Every writer of a timestamp calls this module, so no output
says ``1796321564.15`` where another says ``2026-12-03T18:12:44Z``.
"""

from __future__ import annotations

import datetime as dt
import time


def rfc3339_utc(seconds: float, *, fraction: bool = False) -> str:
    """``seconds`` since the epoch as RFC 3339 UTC: whole seconds, or with microseconds
    (``fraction``) where sub-second order matters."""
    when = dt.datetime.fromtimestamp(seconds, tz=dt.timezone.utc)
    return when.strftime("%Y-%m-%dT%H:%M:%S.%fZ" if fraction else "%Y-%m-%dT%H:%M:%SZ")


def rfc3339_utc_or_none(seconds: float | None) -> str | None:
    """A recorded time, or None for "never" (an epoch of 0 means the time was not recorded)."""
    return rfc3339_utc(seconds) if seconds else None


def now_rfc3339_utc() -> str:
    return rfc3339_utc(time.time())
