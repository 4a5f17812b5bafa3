"""Read path for a file with no chunk table: hash the whole layer, hand nothing out before it matched.

The layer is read in order in slot-sized blocks; blocks are copied into their tensors as they
arrive, but those tensors stay held (``LoadEngine.held``) until the layer's sha256 equals the
manifest digest. Every rank therefore reads the entire layer, whatever its shard.

The plan was built from a header parsed out of separate, unverified reads. The bytes hashed here
include the header, so they are compared with the bytes that were parsed: placement (which file
bytes land in which tensor) is then covered by the digest too, and a source that served a forged
header to the first reads and honest bytes afterwards fails the load (``HeaderMismatchError``).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from typing import Any

from modelpack.loader.blocks import SpanIndex
from modelpack.loader.engine import LoadEngine
from modelpack.loader.plan import FilePlan
from modelpack.loader.readers import RangeReader
from modelpack.loader.staging import Slot
from modelpack.loader.weight_files import WeightFile

from modelpack.errors import DigestMismatchError, HeaderMismatchError


def read_whole_layer(
    load: LoadEngine, reader: RangeReader, f: WeightFile, fp: FilePlan, ids: list[int]
) -> Iterator[int]:
    assert load.ring is not None and f.descriptor is not None
    desc = f.descriptor
    size = desc.size
    block = load.ring.slot_bytes
    hasher = hashlib.sha256()
    if f.relpath not in load.header_bytes:  # every header is read before any data: else a bug
        raise HeaderMismatchError(f.relpath, str(desc.digest), source=load.src.name)
    parsed: bytes = load.header_bytes[f.relpath]
    hlen = len(parsed)
    index = SpanIndex({i: load.tensors[i].span for i in ids if load.tensors[i].span.nbytes})
    nblocks = max(1, math.ceil(size / block))
    for b in range(nblocks):
        b0 = b * block
        b1 = min(size, b0 + block)
        slot = yield from load.next_slot()

        def task(slot: Slot = slot, b0: int = b0, b1: int = b1) -> None:
            reader.read_into(b0, slot.view[: b1 - b0])

        def done(_: Any, slot: Slot = slot, b0: int = b0, b1: int = b1) -> None:
            hasher.update(slot.view[: b1 - b0])  # FIFO completion keeps the hash in file order
            if b0 < hlen and slot.view[: min(b1, hlen) - b0] != parsed[b0 : min(b1, hlen)]:
                load.release(slot)
                raise HeaderMismatchError(f.relpath, str(desc.digest), source=load.src.name)
            load.copy_out(slot, b0, b1, index.candidates(b0, b1))
            load.release(slot)

        yield from load.submit(task, done)
    # every block must be hashed before the verdict: finish this file's reads first
    yield from load.drain()
    actual = "sha256:" + hasher.hexdigest()
    if actual != desc.digest:
        raise DigestMismatchError(desc.digest, actual, what=f"layer {f.relpath}", source=load.src.name)
    load.release_held(ids)
