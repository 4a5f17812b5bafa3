"""The books of one repository's mirrors: each mirror's state, the bytes each source delivered,
and an event for every abandonment.

``MirroredBlobs`` (whole-blob spools and ranges) and ``SourcesStream`` (a blob read in order
through the sources) both report here, through these public methods only: a mirror that failed
is marked down (``DOWN_FOR_S``) and the abandonment logged and emitted
(``registry.mirror_abandoned``), and the bytes a source delivered are added to
``bytes_by_source``.
"""

from __future__ import annotations

import logging
import threading
import time

from modelpack.errors import RegistryConnectionError
from modelpack.events import EventLog
from modelpack.oci.descriptor import Descriptor
from modelpack.targets.registry.mirror_config import MirrorEndpoint
from modelpack.targets.registry.repository import RepositoryAPI
from modelpack.targets.registry.source_events import emit, failure_kind, origin_url

log = logging.getLogger("modelpack.targets.registry")

#: a mirror whose connection failed is not asked again for this long
DOWN_FOR_S = 30.0


class Mirror:
    """One mirror of the repository: its endpoint, its client, and whether it may be asked."""

    def __init__(self, endpoint: MirrorEndpoint, repo: RepositoryAPI) -> None:
        self.endpoint = endpoint
        self.repo = repo
        self.down_until = 0.0
        #: it alone served a blob whose bytes failed the digest: not asked again this run
        self.lied = False

    @property
    def name(self) -> str:
        return self.endpoint.host

    def usable(self, now: float) -> bool:
        """Not marked down after a failed connection, and never caught lying."""
        return self.down_until <= now and not self.lied


class SourceLedger:
    """Bytes delivered per source and abandonments, for one repository (thread-safe)."""

    def __init__(self, origin: RepositoryAPI, events: EventLog | None) -> None:
        self.origin = origin
        self.events = events
        self._lock = threading.Lock()
        self.bytes_by_source: dict[str, int] = {}
        self.abandoned = 0

    @property
    def origin_name(self) -> str:
        """The origin's host, the name its bytes are booked under."""
        return self.origin.client.host

    @property
    def origin_url(self) -> str:
        """The origin's URL without credentials."""
        return origin_url(self.origin.client)

    def count(self, source: str, n: int) -> None:
        """Book ``n`` bytes delivered by ``source`` (a mirror's name or the origin's host)."""
        if n:
            with self._lock:
                self.bytes_by_source[source] = self.bytes_by_source.get(source, 0) + n

    def abandon(self, mirror: Mirror, desc: Descriptor, reason: str, offset: int, *, failure: str) -> None:
        """``mirror`` is left for ``desc`` at ``offset``. ``failure`` is the kind
        (``source_events.failure_kind`` of a typed error, or what the caller itself saw): never
        guessed from ``reason``, whose hosts and digests hold digits."""
        with self._lock:
            self.abandoned += 1
        log.warning("mirror %s abandoned for %s at byte %d: %s", mirror.name, desc.digest, offset, reason)
        emit(
            self.events,
            "registry.mirror_abandoned",
            source=mirror.endpoint.url,
            kind="mirror",
            failure=failure,
            mirror=mirror.name,
            blob=str(desc.digest),
            reason=reason[:300],
            offset=offset,
            registry=self.origin.name,
        )

    def mirror_failed(self, mirror: Mirror, desc: Descriptor, exc: BaseException, offset: int) -> None:
        """``mirror`` failed ``desc`` at ``offset``: marked down after a failed connection (so a
        dead mirror costs one short budget per run), abandoned for the next source."""
        self._mark_down_after(mirror, exc)
        self.abandon(mirror, desc, str(exc), offset, failure=failure_kind(exc))

    def manifest_abandoned(self, mirror: Mirror, what: str, exc: BaseException) -> None:
        """A manifest (or referrers listing) ``mirror`` could not serve: the next source is asked."""
        self._mark_down_after(mirror, exc)
        with self._lock:
            self.abandoned += 1
        log.warning("mirror %s abandoned for %s: %s", mirror.name, what, exc)
        emit(
            self.events,
            "registry.mirror_abandoned",
            source=mirror.endpoint.url,
            kind="mirror",
            failure=failure_kind(exc),
            mirror=mirror.name,
            manifest=what,
            reason=str(exc)[:300],
            registry=self.origin.name,
        )

    @staticmethod
    def _mark_down_after(mirror: Mirror, exc: BaseException) -> None:
        if isinstance(exc, RegistryConnectionError):
            mirror.down_until = time.monotonic() + DOWN_FOR_S
