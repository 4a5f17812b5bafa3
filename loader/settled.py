"""Read path for bytes the node cache vouches for as it fills: read unhashed, handed out only
once the cache verified their blob.

A stream-through load (``loader.stream_through``: a full load on the CPU) reads each weight file
from the node cache's ingest while the cache's own pull downloads it. That pull hashes every blob
whole (size and sha256, the one blob writer) before it commits it; hashing the same bytes again
here, chunk by chunk or whole, doubled the hashing of a first start. So these files are read as
trusted ones are (``trusted.read_trusted_direct``: straight into the destination tensors), their
tensors are held, and once the file's reads are done ``CacheFollowReader.settle`` waits for the
cache's verdict on the blob, reads again whatever came from a partial the cache threw away, and
compares the header the plan was parsed from with the verified file's. Only then are the tensors
handed out. The settle is a task of its own behind the file's reads, so the next files' reads
are queued meanwhile: the fill downloads several blobs at once, and the load follows all of them
as they land instead of one file after another. A forged or torn byte fails the cache's check, which fails the load: no tensor of that
file was handed out, and nothing is committed.

Only where the reads land straight in host tensors: the staged paths (a device, ``direct_io``)
and process groups keep their per-chunk or per-layer hash, since their staging slots are reused
long before the verdict comes.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import wait
from typing import Protocol

from modelpack.loader.engine import LoadEngine
from modelpack.loader.plan import FilePlan
from modelpack.loader.readers import RangeReader
from modelpack.loader.trusted import read_trusted_direct
from modelpack.loader.weight_files import WeightFile

from modelpack.errors import HeaderMismatchError

#: ``LoadStats.verification`` of a file read this way
VERIFIED_BY_COMMIT = "committed"


class SettlingReader(RangeReader, Protocol):
    """A reader whose bytes something else verifies (``stream_through.CacheFollowReader``)."""

    def keep_reads(self) -> None: ...

    def settle(self, header: bytes) -> int: ...


def settles(load: LoadEngine, f: WeightFile) -> bool:
    """Whether ``f`` takes this path in ``load`` (module docstring: host destinations only)."""
    return f.settled and not load.staged and not load.opts.direct_io and not load.peers


def read_settled(
    load: LoadEngine, reader: SettlingReader, f: WeightFile, fp: FilePlan, ids: list[int]
) -> Iterator[int]:
    """Read ``f``'s tensors (allocated held) unhashed; release them once the cache vouched."""
    header = load.header_bytes.get(f.relpath)
    if header is None:  # every header is read before any data: else a bug
        desc = f.descriptor
        raise HeaderMismatchError(f.relpath, str(desc.digest if desc else ""), source=load.src.name)
    load.stats.verification[f.relpath] = VERIFIED_BY_COMMIT
    reader.keep_reads()
    load.collecting = []
    try:
        yield from read_trusted_direct(load, reader, ids)
    finally:
        reads, load.collecting = load.collecting, None

    def settle() -> int:
        # the pool runs tasks in the order queued, so these reads started before this task did
        wait(reads)  # the verdict must cover every read of the file: their errors are raised in order
        return reader.settle(header)

    yield from load.submit(settle, lambda _: load.release_held(ids))
