"""A blob read in order through its sources: each mirror in turn, then the origin, each
continuing from the byte reached (``SourcesStream``; ``MirroredBlobs.open_blob`` opens it).

Not verified here: its consumer checks the whole blob. A mirror that fails, stalls, trickles or
ends short is abandoned for the next source; what each source delivered is booked in the
``SourceLedger`` and said once in a ``registry.blob_sources`` event at close.
"""

from __future__ import annotations

from typing import Any

from modelpack.errors import ModelpackError, RegistryError, TransferInterrupted
from modelpack.oci.descriptor import Descriptor
from modelpack.targets.registry.blob_reads import Floor, ResumingBlobStream
from modelpack.targets.registry.mirror_ledger import Mirror, SourceLedger


class SourcesStream:
    """``desc`` from ``offset``: each of ``mirrors`` (read with ``floor``), then the origin."""

    def __init__(
        self,
        ledger: SourceLedger,
        desc: Descriptor,
        offset: int,
        mirrors: list[Mirror],
        *,
        floor: Floor | None = None,
    ) -> None:
        self._ledger = ledger
        self._floor = floor
        self._desc = desc
        self._pos = offset
        self._left: list[Mirror | None] = [*mirrors, None]
        self._mirror: Mirror | None = None
        self._inner: ResumingBlobStream | None = None
        self._split: dict[str, int] = {}
        self._urls: dict[str, str] = {}
        self._reported = False
        self._next()

    def _next(self) -> None:
        """Open the next source at the byte reached; the origin's failure is the caller's."""
        while self._left:
            mirror = self._left.pop(0)
            try:
                if mirror is None:
                    self._inner = ResumingBlobStream(self._ledger.origin, self._desc, self._pos)
                else:
                    self._inner = ResumingBlobStream(mirror.repo, self._desc, self._pos, floor=self._floor)
                self._mirror = mirror
                return
            except TransferInterrupted:
                raise
            except (RegistryError, ModelpackError) as exc:
                if mirror is None:
                    raise
                self._ledger.mirror_failed(mirror, self._desc, exc, self._pos)

    def _give_up_on_mirror(self, why: BaseException | None) -> None:
        mirror = self._mirror
        assert mirror is not None and self._inner is not None
        if why is None:
            self._ledger.abandon(
                mirror, self._desc, f"short blob: ended at byte {self._pos}", self._pos, failure="short"
            )
        else:
            self._ledger.mirror_failed(mirror, self._desc, why, self._pos)
        self._inner.close()
        self._inner = None
        self._next()

    def _book(self, n: int) -> None:
        if not n:
            return
        mirror = self._mirror
        name = mirror.name if mirror is not None else self._ledger.origin_name
        self._ledger.count(name, n)
        self._split[name] = self._split.get(name, 0) + n
        self._urls.setdefault(name, mirror.endpoint.url if mirror is not None else self._ledger.origin_url)
        self._pos += n

    def read(self, n: int = -1) -> bytes:
        while True:
            assert self._inner is not None
            try:
                data = self._inner.read(n)
            except TransferInterrupted:
                raise
            except (RegistryError, ModelpackError) as exc:
                if self._mirror is None:
                    raise
                self._give_up_on_mirror(exc)
                continue
            if not data and self._pos < self._desc.size and self._mirror is not None:
                self._give_up_on_mirror(None)
                continue
            self._book(len(data))
            return data

    def readinto(self, buf: Any) -> int:
        data = self.read(len(buf))
        buf[: len(data)] = data
        return len(data)

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        if self._inner is not None:
            self._inner.close()
        events = self._ledger.events
        if not self._reported and events is not None and self._split:
            self._reported = True
            events.emit(
                "registry.blob_sources",
                blob=str(self._desc.digest),
                bytes=sum(self._split.values()),
                sources=dict(self._split),
                source_urls=dict(self._urls),
            )

    def __enter__(self) -> SourcesStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
