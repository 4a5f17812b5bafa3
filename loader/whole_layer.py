"""Read path for a file with no chunk table: hash the whole layer, hand nothing out before it matched.

The layer is read in order in slot-sized blocks; blocks land in their tensors as they arrive
(on the CPU straight from the reader, ``scatter``; else staged and copied), but those tensors
stay held (``LoadEngine.held``) until the layer's sha256 equals the manifest digest. The hash
runs on its own thread, block after block in file order, beside the reads and the consumer.
Every rank reads the entire layer, whatever its shard.

The plan was built from a header parsed out of separate, unverified reads. The bytes hashed here
include the header, so they are compared with the bytes that were parsed: placement (which file
bytes land in which tensor) is then covered by the digest too, and a source that served a forged
header to the first reads and honest bytes afterwards fails the load (``HeaderMismatchError``).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from modelpack.loader.blocks import SpanIndex
from modelpack.loader.device_copier import Slot
from modelpack.loader.engine import LoadEngine
from modelpack.loader.plan import FilePlan
from modelpack.loader.readers import RangeReader, read_scatter
from modelpack.loader.scatter import Segment, land, scatter_plan
from modelpack.loader.weight_files import WeightFile

from modelpack.errors import DigestMismatchError, HeaderMismatchError


def read_whole_layer(
    load: LoadEngine, reader: RangeReader, f: WeightFile, fp: FilePlan, ids: list[int]
) -> Iterator[int]:
    assert load.copier.slot_bytes and f.descriptor is not None
    desc = f.descriptor
    size = desc.size
    block = load.copier.slot_bytes
    hasher = hashlib.sha256()
    if f.relpath not in load.header_bytes:  # every header is read before any data: else a bug
        raise HeaderMismatchError(f.relpath, str(desc.digest), source=load.src.name)
    parsed: bytes = load.header_bytes[f.relpath]
    hlen = len(parsed)
    index = SpanIndex({i: load.tensors[i].span for i in ids if load.tensors[i].span.nbytes})
    nblocks = max(1, math.ceil(size / block))
    # hashing runs on its own thread, block after block in file order, beside the reads and the
    # consumer; it only reads destinations (stable: held until the verdict) and the parsed header
    hashing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="modelpack-hash")
    hashed: list[Future[None]] = []
    try:
        for b in range(nblocks):
            b0 = b * block
            b1 = min(size, b0 + block)
            slot = yield from load.next_slot()
            segments = scatter_plan(load, index, b0, b1, slot.view)
            if segments is not None and any(g.tensor is None and g.end > hlen for g in segments):
                segments = None  # bytes of no tensor past the header (other ranks' rows): staged
            if segments is not None:
                yield from _direct_block(
                    load, reader, f, parsed, b0, b1, slot, segments, hasher, hashing, hashed
                )
                continue

            def task(slot: Slot = slot, b0: int = b0, b1: int = b1) -> None:
                reader.read_into(b0, slot.view[: b1 - b0])

            def done(_: object, slot: Slot = slot, b0: int = b0, b1: int = b1) -> None:
                for fut in hashed:  # the direct blocks before this one come first in the hash
                    fut.result()
                hashed.clear()
                hasher.update(slot.view[: b1 - b0])  # FIFO completion keeps the hash in file order
                if b0 < hlen and slot.view[: min(b1, hlen) - b0] != parsed[b0 : min(b1, hlen)]:
                    load.release(slot)
                    raise HeaderMismatchError(f.relpath, str(desc.digest), source=load.src.name)
                load.copy_out(slot, b0, b1, index.candidates(b0, b1))
                load.release(slot)

            yield from load.submit(task, done)
        # every block must be hashed before the verdict: finish this file's reads first
        yield from load.drain()
        for fut in hashed:
            fut.result()
    finally:
        hashing.shutdown(wait=True, cancel_futures=True)
    actual = "sha256:" + hasher.hexdigest()
    if actual != desc.digest:
        raise DigestMismatchError(desc.digest, actual, what=f"layer {f.relpath}", source=load.src.name)
    load.release_held(ids)


def _direct_block(
    load: LoadEngine,
    reader: RangeReader,
    f: WeightFile,
    parsed: bytes,
    b0: int,
    b1: int,
    slot: Slot,
    segments: list[Segment],
    hasher: Any,
    hashing: ThreadPoolExecutor,
    hashed: list[Future[None]],
) -> Iterator[int]:
    """One block read straight into its (held) tensors; its gaps are header bytes, compared with
    the header that was parsed, so the hash takes the parsed bytes for them and the slot goes
    back at once."""

    def task() -> None:
        read_scatter(reader, b0, [seg.view for seg in segments])

    def done(_: object) -> None:
        pieces: list[Any] = []
        for seg in segments:
            if seg.tensor is None:  # a gap lies inside the header here (checked by the caller)
                if seg.view != parsed[seg.start : seg.end]:
                    load.release(slot)
                    desc = f.descriptor
                    raise HeaderMismatchError(
                        f.relpath, str(desc.digest if desc else ""), source=load.src.name
                    )
                pieces.append(parsed[seg.start : seg.end])
            else:
                pieces.append(seg.view)
        load.release(slot)
        hashed.append(hashing.submit(_update, hasher, pieces))
        land(load, segments)  # held: no tensor leaves before the layer digest matched

    yield from load.submit(task, done)


def _update(hasher: Any, pieces: list[Any]) -> None:
    for p in pieces:
        hasher.update(p)
