"""Byte readers behind the loader: a local file, or any Target's blob by range (docs/loader.md#sources).

Every reader fills caller-owned buffers (``read_into``) so the pipeline can reuse its staging
ring or read straight into destination tensors; none allocates per read except the Target
reader over a target whose protocol returns ``bytes`` (S3; a registry receives in place).
Readers count the bytes they deliver (``bytes_read``) and log where they came from
(``reads``): the load attributes them to split kinds
(``accounting``), and the tests use both to check that a rank reads ≈ 1/TP of the model.

- ``FileReader``: positional ``os.preadv`` (thread-safe: no shared file offset, so a few worker
  threads read one file in parallel), optional ``O_DIRECT`` for cold NVMe (page-aligned reads into
  aligned buffers, bypassing the page cache; falls back to buffered reads where the filesystem
  refuses it, e.g. tmpfs), and ``gather_rows`` for dim-1 shards: only the rank's columns are
  copied, by the kernel out of a short-lived mapping (``gather``), so a file that shrinks under
  the load is a ``TruncatedSourceError``, never a SIGBUS.
- ``TargetReader``: ``target.fetch_range`` (HTTP Range for a registry, ranged GET for S3, pread
  for an OCI layout); the pipeline keeps many 8–16 MiB ranges in flight. A registry receives
  each range straight into the caller's buffers (``fetch_range_into``), no ``bytes`` between.

Both readers also fill a list of buffers from one range (``read_scatter``): the verified paths
read a block straight into the destination tensors it feeds, gaps into a staging slot.

``RowsReader`` (``read_rows``): a strided run of rows without the bytes between them, for a
column-split share checked against signed column blocks (``column_reads``): ``gather_rows`` for a
file, ``fetch_ranges_into`` (a multipart range request, or ``preadv`` per row in a layout) for a
target that reads from the one source it names (``MultiRangeFetcher.multi_range``).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Sequence
from typing import BinaryIO, Protocol, runtime_checkable

import numpy as np
from modelpack.loader.gather import gather_rows

from modelpack.errors import SourceError, TruncatedSourceError
from modelpack.oci.descriptor import Descriptor
from modelpack.targets.base import (
    CheckedRangeFetcher,
    MultiRangeFetcher,
    RangeCheck,
    RangeIntoFetcher,
    ReadableTarget,
    VerifiedSpooler,
)

ALIGN = 4096


class RangeReader(Protocol):
    name: str
    size: int
    local: bool

    def read_into(self, offset: int, buf: memoryview) -> None:
        """Fill ``buf`` with the bytes at ``offset`` exactly, or raise ``TruncatedSourceError``."""
        ...

    @property
    def bytes_read(self) -> int: ...

    @property
    def reads(self) -> list[tuple[int, int, int]]: ...

    def close(self) -> None: ...


@runtime_checkable
class ScatterReader(Protocol):
    """A reader that fills several buffers from one range in one request (both readers here)."""

    def read_scatter(self, offset: int, views: Sequence[memoryview]) -> None: ...


@runtime_checkable
class RowsReader(Protocol):
    """A reader that fetches a strided run of rows (a column-split share) without the bytes between
    them, where ``reads_rows`` (``column_reads``)."""

    @property
    def reads_rows(self) -> bool: ...

    def read_rows(self, offset: int, length: int, stride: int, rows: int, dest: memoryview) -> None:
        """Fill ``dest`` (``rows × length`` bytes) with ``rows`` runs of ``length`` bytes,
        ``stride`` apart from ``offset``, or raise ``TruncatedSourceError``."""
        ...


def read_scatter(reader: RangeReader, offset: int, views: Sequence[memoryview]) -> None:
    """``reader.read_scatter`` where the reader has it, else one ``read_into`` per view."""
    if isinstance(reader, ScatterReader):
        reader.read_scatter(offset, views)
        return
    for v in views:
        reader.read_into(offset, v)
        offset += len(v)


def _advance(views: Sequence[memoryview], n: int) -> Iterator[memoryview]:
    """``views`` past their first ``n`` bytes (after a short ``preadv``)."""
    for v in views:
        if n >= len(v):
            n -= len(v)
            continue
        yield v[n:] if n else v
        n = 0


class _Counter:
    """Bytes delivered, and each read as (offset, bytes, end of the covering range)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._n = 0
        self._reads: list[tuple[int, int, int]] = []

    def add(self, n: int, offset: int = -1, end: int = -1) -> None:
        with self._lock:
            self._n += n
            if offset >= 0 and n:
                self._reads.append((offset, n, end if end >= 0 else offset + n))

    @property
    def value(self) -> int:
        return self._n

    @property
    def reads(self) -> list[tuple[int, int, int]]:
        with self._lock:
            return list(self._reads)


class FileReader:
    """A local file read with ``preadv`` from worker threads (and optionally ``O_DIRECT``)."""

    local = True

    def __init__(self, path: str, expected_size: int | None = None, *, direct: bool = False) -> None:
        self.name = path
        self.path = path
        try:
            self._fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            raise SourceError(f"{path}: cannot open: {exc.strerror}") from exc
        self.size = os.fstat(self._fd).st_size
        if expected_size is not None and self.size != expected_size:
            os.close(self._fd)
            raise TruncatedSourceError(path, 0, expected_size, self.size)
        self._direct_fd: int | None = None
        self.direct = False
        if direct and hasattr(os, "O_DIRECT"):
            try:
                self._direct_fd = os.open(path, os.O_RDONLY | os.O_DIRECT | getattr(os, "O_CLOEXEC", 0))
                self.direct = True
            except OSError:
                self._direct_fd = None  # tmpfs and some overlay filesystems refuse O_DIRECT
            if self._direct_fd is not None:
                a, b = os.fstat(self._fd), os.fstat(self._direct_fd)
                if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino):  # the path changed between the opens
                    os.close(self._direct_fd)
                    self._direct_fd = None
                    self.direct = False
        self._count = _Counter()

    @property
    def bytes_read(self) -> int:
        return self._count.value

    @property
    def reads(self) -> list[tuple[int, int, int]]:
        return self._count.reads

    def fileno(self) -> int:
        return self._fd

    def count(self, n: int, offset: int, end: int) -> None:
        """Record bytes the engine reads itself from a mapping of this file (``mapped``)."""
        self._count.add(n, offset, end)

    def fstat(self) -> os.stat_result:
        """The open file's identity (the snapshot binding compares it with the store's blob)."""
        return os.fstat(self._fd)

    def read_into(self, offset: int, buf: memoryview) -> None:
        want = len(buf)
        got = 0
        while got < want:
            n = os.preadv(self._fd, [buf[got:]], offset + got)
            if n <= 0:
                raise TruncatedSourceError(self.path, offset, want, got)
            got += n
        self._count.add(want, offset)

    def read_scatter(self, offset: int, views: Sequence[memoryview]) -> None:
        """Fill ``views`` in order with the bytes at ``offset`` (one ``preadv`` per pass: the
        kernel copies straight into each buffer), or raise ``TruncatedSourceError``."""
        want = sum(len(v) for v in views)
        got = 0
        left = [v for v in views if len(v)]
        while left:
            n = os.preadv(self._fd, left, offset + got)
            if n <= 0:
                raise TruncatedSourceError(self.path, offset, want, got)
            got += n
            left = list(_advance(left, n))
        self._count.add(want, offset)

    def read_direct(self, offset: int, buf: memoryview, *, need: int | None = None) -> None:
        """O_DIRECT read of page-aligned ``offset`` into the page-aligned ``buf`` (aligned length).

        At least ``need`` bytes (default: all of ``buf`` that lies before EOF) must arrive; the
        file's tail may end inside the last page, which O_DIRECT reports as a short read.
        """
        if self._direct_fd is None:
            n = min(len(buf), max(0, self.size - offset))
            self.read_into(offset, buf[:n])
            return
        want = min(len(buf), max(0, self.size - offset)) if need is None else need
        got = 0
        while got < want:
            n = os.preadv(self._direct_fd, [buf[got:]], offset + got)
            if n <= 0:
                raise TruncatedSourceError(self.path, offset, want, got)
            got += n
        self._count.add(got, offset)

    def gather_rows(self, offset: int, length: int, stride: int, rows: int, dest: np.ndarray) -> None:
        """Copy ``rows`` runs of ``length`` bytes, ``stride`` apart, into ``dest`` (rows × length u8).

        SIGBUS-safe (``gather``): a file that shrinks under the load is a ``TruncatedSourceError``.
        """
        if rows == 0 or length == 0:
            return
        end = offset + (rows - 1) * stride + length
        if end > self.size:
            raise TruncatedSourceError(self.path, offset, end - offset, max(0, self.size - offset))
        gather_rows(self._fd, self.path, offset, length, stride, rows, dest)
        self._count.add(rows * length, offset, end)

    reads_rows = True

    def read_rows(self, offset: int, length: int, stride: int, rows: int, dest: memoryview) -> None:
        self.gather_rows(
            offset, length, stride, rows, np.frombuffer(dest, dtype=np.uint8).reshape(rows, length)
        )

    def close(self) -> None:
        for fd in (self._fd, self._direct_fd):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._direct_fd = None
        self._fd = -1


class TargetReader:
    """A blob of any Target read by ranges (registry HTTP Range, S3 ranged GET, layout pread)."""

    local = False

    def __init__(
        self,
        target: ReadableTarget,
        descriptor: Descriptor,
        *,
        name: str = "",
        check: RangeCheck | None = None,
    ) -> None:
        self.target = target
        self.descriptor = descriptor
        self.size = descriptor.size
        self.name = name or f"{target.name} blob {descriptor.digest}"
        self._count = _Counter()
        # the signed chunk table's check: a mirror's wrong chunks are refetched beneath this reader
        self._checked = target if check is not None and isinstance(target, CheckedRangeFetcher) else None
        self._check = check
        # a target that receives a range straight into caller memory (RegistryTarget)
        self._into = target if isinstance(target, RangeIntoFetcher) else None

    @property
    def bytes_read(self) -> int:
        return self._count.value

    @property
    def reads(self) -> list[tuple[int, int, int]]:
        return self._count.reads

    def read_into(self, offset: int, buf: memoryview) -> None:
        self.read_scatter(offset, [buf])

    def read_scatter(self, offset: int, views: Sequence[memoryview]) -> None:
        """Fill ``views`` in order with the range at ``offset``: received straight into them where
        the target can (``fetch_range_into``: a registry), else fetched and copied."""
        want = sum(len(v) for v in views)
        if offset + want > self.size:
            raise TruncatedSourceError(self.name, offset, want, max(0, self.size - offset))
        if self._into is not None:
            self._into.fetch_range_into(self.descriptor, offset, views, self._check)
        else:
            if self._checked is not None and self._check is not None:
                data = self._checked.fetch_range_checked(self.descriptor, offset, want, self._check)
            else:
                data = self.target.fetch_range(self.descriptor, offset, want)
            if len(data) != want:
                raise TruncatedSourceError(self.name, offset, want, len(data))
            src = memoryview(data)
            pos = 0
            for v in views:
                v[:] = src[pos : pos + len(v)]
                pos += len(v)
        self._count.add(want, offset)

    @property
    def reads_rows(self) -> bool:
        """Only where the target reads the rows from the one source it names (no mirrors)."""
        return isinstance(self.target, MultiRangeFetcher) and self.target.multi_range

    def read_rows(self, offset: int, length: int, stride: int, rows: int, dest: memoryview) -> None:
        end = offset + (rows - 1) * stride + length if rows and length else offset
        if end > self.size:
            raise TruncatedSourceError(self.name, offset, end - offset, max(0, self.size - offset))
        if not rows or not length:
            return
        if not isinstance(self.target, MultiRangeFetcher):
            raise SourceError(f"{self.name}: the target cannot read ranges of rows")
        ranges = [(offset + k * stride, length) for k in range(rows)]
        views = [dest[k * length : (k + 1) * length] for k in range(rows)]
        fetched = self.target.fetch_ranges_into(self.descriptor, ranges, views)
        self._count.add(fetched, offset, end)

    def close(self) -> None:
        pass


class VerifiedSpoolReader:
    """A whole-layer read (no chunk table) through mirrors: the blob is taken whole from the
    mirrors once its bytes matched the digest (``VerifiedSpooler``: a liar's bytes go to the next
    source, then the origin), and the ranges are read from that spool. Reading ranges straight
    from a mirror could not tell a liar until the layer's last byte, and by then the header
    parsed from its bytes has planned the load (a zeroed mirror failed a load the healthy origin
    could serve). Without a usable mirror the origin is read by ranges (``TargetReader``); the
    layer digest is still checked by the whole-layer path either way."""

    local = False

    def __init__(self, target: VerifiedSpooler, descriptor: Descriptor, *, name: str = "") -> None:
        self.target = target
        self.descriptor = descriptor
        self.size = descriptor.size
        self.name = name or f"{target} blob {descriptor.digest}"
        self._lock = threading.Lock()
        self._opened = False
        self._spool: BinaryIO | None = None
        self._ranges = TargetReader(target, descriptor, name=self.name)  # type: ignore[arg-type]
        self._count = _Counter()

    @property
    def bytes_read(self) -> int:
        return self._count.value if self._spool is not None else self._ranges.bytes_read

    @property
    def reads(self) -> list[tuple[int, int, int]]:
        return self._count.reads if self._spool is not None else self._ranges.reads

    def _source(self) -> BinaryIO | None:
        with self._lock:
            if not self._opened:
                self._spool = self.target.fetch_blob_spooled(self.descriptor)
                self._opened = True
            return self._spool

    def read_into(self, offset: int, buf: memoryview) -> None:
        self.read_scatter(offset, [buf])

    def read_scatter(self, offset: int, views: Sequence[memoryview]) -> None:
        spool = self._source()
        if spool is None:
            self._ranges.read_scatter(offset, views)
            return
        want = sum(len(v) for v in views)
        if offset + want > self.size:
            raise TruncatedSourceError(self.name, offset, want, max(0, self.size - offset))
        with self._lock:  # one file position for every reader thread
            spool.seek(offset)
            for v in views:
                got = spool.readinto(v)  # type: ignore[attr-defined]
                if got != len(v):
                    raise TruncatedSourceError(self.name, offset, want, got or 0)
        self._count.add(want, offset)

    def close(self) -> None:
        with self._lock:
            if self._spool is not None:
                self._spool.close()
                self._spool = None
                self._opened = True
