"""How long a transfer keeps retrying through an outage: a time budget, exponential backoff, jitter.

A count of retries says nothing about time: four quick retries give up during a registry restart
that takes 30 s, and a fixed count of long sleeps stalls a command that could have failed fast.
So a budget is a duration (``--retry-for``, ``TargetOptions.retry_for``): the time spent failing,
from each failure until bytes flow again, added up. Progress restarts the backoff at its shortest
delay but does not refill the budget, so a hop that cuts every connection after a few bytes ends
in an error instead of a download that crawls forever, while a pull that meets one registry
restart rides it out.

The budget is one per command, not one per blob: each operation (a request, a blob download, an
upload) has its own ``RetryBudget`` for its backoff, and all of them book their failing time into
one ``OutageClock`` (a registry client holds one), which counts the time during which any of them
was failing, overlaps counted once. ``--retry-for 5s`` on a push of seven blobs on four jobs
gives up about 5 s into the outage, not 5 s per blob.

Backoff doubles from 0.2 s up to 8 s with jitter (each delay is drawn from its upper half), so a
fleet of nodes whose connections were cut at the same moment does not come back in lock step.
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections.abc import Callable

from modelpack import stopping

#: Long enough to ride out a registry restart (~30 s) or a load balancer failing over.
DEFAULT_RETRY_FOR = 60.0
FIRST_DELAY_S = 0.2
MAX_DELAY_S = 8.0


class OutageClock:
    """The time a whole command spent in an outage: the union of the spans during which any of
    its operations was failing (from a failure to the end of the pause after it). Thread-safe;
    spans arrive roughly in the order they start, which is all the union needs."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spent = 0.0
        self._until = -math.inf

    def book(self, start: float, end: float) -> None:
        """Count ``[start, end]`` (monotonic seconds) as outage, what overlaps earlier spans once."""
        with self._lock:
            if end <= self._until:
                return
            self._spent += end - max(start, self._until)
            self._until = end

    def spent(self, now: float | None = None) -> float:
        """Outage seconds up to ``now`` (a pause booked ahead is counted as it elapses)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            return self._spent - max(0.0, self._until - now)


class RetryBudget:
    """One operation's retries: ``next_delay()`` until the budget is spent, ``progressed()``
    when bytes flowed again (the outage's time is booked and the backoff starts over).

    With ``shared`` (the command's ``OutageClock``), the budget is also spent when the command
    as a whole has been failing for ``retry_for``, whichever operation did the failing."""

    def __init__(
        self,
        retry_for: float | None = None,
        *,
        shared: OutageClock | None = None,
        on_outage: Callable[[float], None] | None = None,
    ) -> None:
        self.retry_for = DEFAULT_RETRY_FOR if retry_for is None else max(0.0, float(retry_for))
        self.attempts = 0  # failures since the last progress
        self.retries = 0  # failures retried over the whole operation (reported by callers)
        self._since: float | None = None
        self._spent = 0.0  # seconds of earlier outages of this operation
        self._shared = shared
        self.exhausted = False  # a retry was refused: this operation's or the command's time is spent
        #: told the seconds the budget has left when a wait starts an outage (after progress, or
        #: the first failure): the client says once what it waits for and until when
        self._on_outage = on_outage
        self._left = self.retry_for

    def progressed(self) -> None:
        if self._since is not None:
            self._spent += time.monotonic() - self._since
        self.attempts = 0
        self._since = None

    def next_delay(self, hint: float | None = None) -> float | None:
        """The pause before the next attempt, or None when the budget does not allow one.

        ``hint`` is a server's ``Retry-After``; it is honoured up to the backoff cap.
        """
        now = time.monotonic()
        if self._since is None:
            self._since = now
        self.attempts += 1
        if hint is not None:
            delay = min(max(hint, 0.0), MAX_DELAY_S)
        else:
            ceiling = min(MAX_DELAY_S, FIRST_DELAY_S * (2 ** (self.attempts - 1)))
            delay = ceiling * (0.5 + random.random() / 2)
        left = self.retry_for - self._spent - (now - self._since)
        if self._shared is not None:
            self._shared.book(self._since, now)
            left = min(left, self.retry_for - self._shared.spent(now))
        if left <= 0:
            self.exhausted = True
            return None
        self._left = left
        self.retries += 1
        delay = min(delay, left)
        if self._shared is not None:
            self._shared.book(now, now + delay)
        return delay

    def wait(self, hint: float | None = None) -> bool:
        """Sleep before the next attempt; False (without sleeping) when the budget is spent. A stop
        request (SIGTERM in the CLI) ends the sleep with ``TransferCancelled``."""
        delay = self.next_delay(hint)
        if delay is None:
            return False
        if self.attempts == 1 and self._on_outage is not None:
            self._on_outage(self._left)
        stopping.sleep(delay)
        return True

    @property
    def spent_s(self) -> float:
        """Seconds spent failing so far: this operation's, or the command's when that is more."""
        own = self._spent + (0.0 if self._since is None else time.monotonic() - self._since)
        return max(own, self._shared.spent()) if self._shared is not None else own
