"""How a registry client waits out an outage: one ``--retry-for`` budget for everything it does,
and which failures are worth waiting for at all.

A refused connection or a name that does not resolve is an outage (a registry restarting, a
service's DNS moving) from a host that answered an HTTP request in this process, retried within
``--retry-for``; from any other host it is a typo'd host or port, which waiting cannot heal, and
fails at once (``RegistryOutages.cannot_heal``). While waiting, one line on a terminal says what
for and until when (``say_waiting``).
"""

from __future__ import annotations

import logging
import os
import threading
import time

from modelpack.targets.registry.bodies import unreachable_reason
from modelpack.targets.retry import OutageClock, RetryBudget

log = logging.getLogger("modelpack.targets.registry")

#: the API hosts that answered an HTTP request in this process
_ANSWERED_HOSTS: set[str] = set()
_answered_lock = threading.Lock()


class RegistryOutages:
    """The retry budget, retry count and outage state of one client of registry ``host`` (whose
    API lives at ``api_host``)."""

    def __init__(
        self, host: str, api_host: str, retry_for: float | None, lock: threading.Lock | None = None
    ) -> None:
        self.host = host
        self.api_host = api_host
        self.retry_for = retry_for
        self.retries = 0  # requests retried after a transport failure or a "not now" status
        self.clock = OutageClock()  # --retry-for is one budget for everything the client does
        self._lock = lock or threading.Lock()
        self._said = threading.Event()  # this outage's "waiting for" line was printed

    def under(self, retry_for: float | None) -> RegistryOutages:
        """The same client's outages under another ``--retry-for``: its own clock and line."""
        other = RegistryOutages(self.host, self.api_host, retry_for, self._lock)
        other.retries = self.retries
        return other

    def budget(self) -> RetryBudget:
        """A fresh retry budget for one operation, drawing on the client's one ``--retry-for``."""
        return RetryBudget(self.retry_for, shared=self.clock, on_outage=self.say_waiting)

    def count_retry(self) -> None:
        with self._lock:
            self.retries += 1

    def say_waiting(self, left_s: float) -> None:
        """One line on a terminal's stderr (a log warning) when the client starts waiting out an
        outage: what it waits for and until when, so a retrying command is never a silent one.
        Said again only after the registry answered in between. Not on a log or a pipe: there a
        failure stays the one line every command ends with (README, "Exit status"), however many
        times a flapping registry made the command wait."""
        if not os.isatty(2):
            return
        with self._lock:
            if self._said.is_set():
                return
            self._said.set()
        until = time.strftime("%H:%M:%S", time.localtime(time.time() + left_s))
        log.warning(
            "waiting for the registry %s to answer; retrying until %s (--retry-for sets how long)",
            self.host,
            until,
        )

    def mark_answered(self) -> None:
        """The registry answered (any HTTP status): later refusals are an outage, worth waiting."""
        self._said.clear()
        if self.api_host not in _ANSWERED_HOSTS:
            with _answered_lock:
                _ANSWERED_HOSTS.add(self.api_host)

    def ever_answered(self) -> bool:
        """Whether the registry's API host answered an HTTP request in this process."""
        return self.api_host in _ANSWERED_HOSTS

    def cannot_heal(self, exc: BaseException) -> bool:
        """A refused connection or an unresolvable name from a host that never answered in this
        process: a typo, failed at once instead of after ``--retry-for``."""
        return not self.ever_answered() and unreachable_reason(exc) is not None
