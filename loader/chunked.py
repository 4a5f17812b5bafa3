"""Read path for a file covered by a signed chunk table: verify each chunk before using any byte.

Reads are widened to chunk boundaries; consecutive needed chunks share one range read (up to a
staging slot), and every chunk of a read is hashed against the table in the worker before any
tensor counts its bytes. On the CPU a block whose tensors take contiguous runs of it is read
straight into them (``scatter``: gaps into the slot, each chunk hashed where its bytes landed,
no copy); otherwise it is staged and copied out after the check (CPU memcpy, or H2D into a
device scratch buffer and a device-side gather into the destination). A rank therefore reads and verifies only the chunks its shard touches,
each once: chunks already verified while the header was read (``headers.VerifiedChunks``) are
copied from memory instead of fetched again.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from modelpack.loader.blocks import SpanIndex
from modelpack.loader.column_reads import column_shares, read_column_shares
from modelpack.loader.device_copier import Slot
from modelpack.loader.engine import LoadEngine
from modelpack.loader.plan import FilePlan, coalesce
from modelpack.loader.readers import RangeReader, read_scatter
from modelpack.loader.scatter import Segment, land, parts, scatter_plan, verify_chunk_parts
from modelpack.loader.weight_files import WeightFile

if TYPE_CHECKING:
    from modelpack.signing.chunks import ChunkTable


def needed_chunks(
    fp: FilePlan, table: ChunkTable, layer: str, skip: frozenset[str] = frozenset()
) -> set[int]:
    """Indexes of the chunks (of ``table``'s ``layer``) holding any byte of the plan's (covering)
    ranges; ``skip``: tensors read another way (their columns, ``column_reads``)."""
    needed: set[int] = set()
    spans = [(t.span.offset, t.span.end) for t in fp.tensors if t.span.nbytes and t.name not in skip]
    for s, e in coalesce(spans):
        needed.update(table.chunks_covering(layer, s, e))
    return needed


def read_chunked(
    load: LoadEngine,
    reader: RangeReader,
    f: WeightFile,
    fp: FilePlan,
    ids: list[int],
    only: set[int] | None = None,
) -> Iterator[int]:
    """Read, verify and copy out the chunks this rank needs (``only``: just those of them)."""
    table = f.chunks
    layer = str(f.descriptor.digest) if f.descriptor else ""
    columns = column_shares(load, reader, table, layer, fp, ids) if only is None else []
    by_columns = {load.tensors[c.tensor].name for c in columns}
    needed = needed_chunks(fp, table, layer, frozenset(by_columns))
    if only is not None:
        needed &= only
    ids = [i for i in ids if load.tensors[i].name not in by_columns]
    kept = load.verified.indexes(f.relpath) & needed if load.verified is not None else set()
    if load.verified is not None:
        for idx in load.verified.indexes(f.relpath) - needed:
            load.verified.take(f.relpath, idx)  # verified for the header, not needed by this rank
    index = SpanIndex({i: load.tensors[i].span for i in ids if load.tensors[i].span.nbytes})
    cap = load.copier.slot_bytes  # consecutive chunks fetched by one range read, up to a slot
    groups: list[list[int]] = []
    held_bytes = 0
    for c in sorted(needed):
        clen = table.chunk_range(layer, c)[1]
        if c in kept:
            groups.append([c])  # copied from memory, on its own
            held_bytes = cap
        elif groups and groups[-1][-1] == c - 1 and groups[-1][-1] not in kept and held_bytes + clen <= cap:
            groups[-1].append(c)
            held_bytes += clen
        else:
            groups.append([c])
            held_bytes = clen
    for group in groups:
        g0, _ = table.chunk_range(layer, group[0])
        last0, last_len = table.chunk_range(layer, group[-1])
        glen = last0 + last_len - g0
        slot = yield from load.next_slot()
        held = load.verified.take(f.relpath, group[0]) if group[0] in kept and load.verified else None

        segments = scatter_plan(load, index, g0, g0 + glen, slot.view)

        def task(
            slot: Slot = slot,
            group: list[int] = group,
            g0: int = g0,
            glen: int = glen,
            held: bytearray | None = held,
            segments: list[Segment] | None = segments,
        ) -> None:
            if held is not None:  # verified when the header was read, in memory only this load sees
                if segments is None:
                    slot.view[:glen] = held
                    return
                for seg in segments:
                    seg.view[:] = held[seg.start - g0 : seg.end - g0]
                return
            if segments is not None:  # straight into the destinations, hashed where it landed
                read_scatter(reader, g0, [seg.view for seg in segments])
                for c in group:  # every chunk checked before any tensor counts its bytes
                    c0, clen = table.chunk_range(layer, c)
                    verify_chunk_parts(table, layer, c, parts(segments, c0, c0 + clen))
                return
            reader.read_into(g0, slot.view[:glen])
            for c in group:  # every chunk checked before ANY byte is copied towards a tensor
                c0, clen = table.chunk_range(layer, c)
                table.verify_chunk(layer, c, slot.view[c0 - g0 : c0 - g0 + clen])

        def done(
            _: Any,
            slot: Slot = slot,
            g0: int = g0,
            glen: int = glen,
            segments: list[Segment] | None = segments,
        ) -> None:
            if segments is not None:
                land(load, segments)
            else:
                load.copy_out(slot, g0, g0 + glen, index.candidates(g0, g0 + glen))
            load.release(slot)

        yield from load.submit(task, done)
    yield from read_column_shares(load, reader, layer, columns)
