"""What a mirror's bytes must pass before a whole-blob spool takes them: with a signed chunk
table, each chunk checked against it as it arrives (``ChunkGate``: a liar is dropped at its first
wrong chunk); without one, a time bound per blob relative to the throughput floor
(``blob_deadline_s``). Split from ``mirrors``, which decides which source to ask."""

from __future__ import annotations

import hashlib
from typing import IO

from modelpack.oci.descriptor import Descriptor
from modelpack.targets.base import ChunkBounds, RangeCheck
from modelpack.targets.registry.blob_reads import Floor

#: a mirror's part of a whole-blob spool must average this many times the floor…
BLOB_RATE_FACTOR = 4
#: …after a grace of this many floor windows
BLOB_GRACE_WINDOWS = 3


def blob_deadline_s(floor: Floor | None, nbytes: int) -> float | None:
    """Seconds a mirror may take to deliver ``nbytes`` of a blob: ``BLOB_GRACE_WINDOWS`` windows
    plus ``nbytes`` at ``BLOB_RATE_FACTOR`` times the floor; None without a floor."""
    if floor is None or floor.min_bps <= 0:
        return None
    return BLOB_GRACE_WINDOWS * floor.window_s + nbytes / (BLOB_RATE_FACTOR * floor.min_bps)


class BadChunk(Exception):
    """A chunk a mirror sent does not match the signed chunk table (``ChunkGate``)."""

    def __init__(self, offset: int, length: int) -> None:
        super().__init__(f"chunk at byte {offset}")
        self.offset = offset
        self.length = length


class ChunkGate:
    """Between a spool's sources and its hasher and file: with a signed chunk table for the blob
    (``MirroredBlobs.check_chunks``), a mirror's bytes are held back until their chunk is whole,
    checked against the table, and only then hashed and spooled; a wrong chunk raises
    ``BadChunk`` (its bytes are dropped: the next source starts at that chunk). The origin's
    bytes are not judged here (the whole blob's digest is checked as always), nor are bytes of a
    blob without a table."""

    def __init__(
        self,
        desc: Descriptor,
        checks: tuple[ChunkBounds, RangeCheck] | None,
        hasher: hashlib._Hash,
        spool: IO[bytes],
    ) -> None:
        self.size = desc.size
        self.checks = checks
        self.hasher = hasher
        self.spool = spool
        self.done = 0  # bytes hashed and spooled (a chunk boundary while a table is used)
        self.pending = bytearray()

    def _commit(self, data: bytes | bytearray) -> None:
        self.hasher.update(data)
        self.spool.write(data)
        self.done += len(data)

    def add(self, data: bytes, *, checked: bool) -> None:
        if self.checks is None or not checked:
            if self.pending:
                self._commit(self.pending)
                self.pending = bytearray()
            self._commit(data)
            return
        bounds, check = self.checks
        self.pending += data
        while self.pending and self.done < self.size:
            c0, clen = bounds(self.done)
            length = min(c0 + clen, self.size) - self.done
            if length <= 0:  # pragma: no cover - a verified table tiles the blob
                length = self.size - self.done
            if len(self.pending) < length:
                return
            chunk = bytes(self.pending[:length])
            if c0 == self.done and check(self.done, chunk):
                self.pending = bytearray()
                raise BadChunk(self.done, length)
            del self.pending[:length]
            self._commit(chunk)
