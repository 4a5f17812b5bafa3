"""How old a cache entry is when the wall clock can step backwards.

Leftovers (temp files, partial downloads, quarantined blobs, temp snapshots) go when they are
older than a TTL, judged by their mtime. After the clock steps back (NTP correction, a VM
restored from a snapshot) an mtime lies in the future and ``now - mtime`` stays negative for as
long as the step was: the entry would never reach its TTL. Such an entry is stamped "now" and
ages from this sweep on.
"""

from __future__ import annotations

import contextlib
import os

# a stamp this far ahead is a clock step, not rounding between two clocks' readings
FUTURE_SLACK_S = 1.0


def age_since(path: str, stamp: float, now: float) -> float:
    """Seconds since ``stamp`` (an mtime or ctime of ``path``); a stamp in the future is reset to
    ``now`` (``utime`` also moves the ctime to now) and counts as age 0."""
    if stamp <= now + FUTURE_SLACK_S:
        return now - stamp
    with contextlib.suppress(OSError):
        os.utime(path, (now, now), follow_symlinks=False)
    return 0.0
