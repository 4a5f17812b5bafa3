"""Where the chunks of a signed chunk table begin: fixed-size, or aligned to the tensors.

A fixed table (``chunkSize`` only, the form published first) cuts every layer blob every
``chunkSize`` bytes, so a chunk straddles tensors and a rank whose share ends mid-chunk reads
bytes it does not need, for another rank. An aligned table (``runs`` per layer) cuts where the
shares a rank reads begin and end, read from the layer's safetensors header:

- the header is chunks of its own (every rank reads it);
- every tensor of at least ``SMALL`` bytes starts and ends on a boundary, and is cut along its
  first dimension into ``P`` equal parts (``P`` the largest power of two up to ``GRID`` that
  divides the rows, halves of ``SMALL`` bytes or more, finer parts of half a chunk or more): a
  dim-0 share at TP ∈ {2, 4, 8, …} and the experts of a stacked tensor under a linear EP map are
  whole parts; each part is then cut every ``chunkSize`` bytes;
- runs of smaller tensors (norms, biases, scales) share chunks of up to ``SMALL`` bytes.

A dim-1 (column-split) share is strided over every row of its tensor, so no contiguous chunk is one
rank's. Aligned tables therefore also sign **column blocks** (``column_blocks``): every 2-D tensor
of ``2·SMALL`` bytes or more is cut along its second dimension into ``K`` equal blocks (``K`` the
largest power of two up to ``COLUMN_GRID`` dividing the columns, halves of ``SMALL`` bytes or more,
finer blocks of half a chunk or more), and block ``j``'s digest is over the concatenation of every
row's ``j``-th slice. A rank whose dim-1 share at TP ∈ {2, 4, 8} is whole blocks reads just its
columns (one range per row) and checks them against these digests. The contiguous chunks still
tile the blob, so every other reader (a group, a mirror's spool, a whole-layer check) is unchanged.

So every chunk holds ``SMALL`` bytes or more except at most two per tensor (its tail and the
small run before it) and the header's: a layer of ``size`` bytes has at most
``max_chunks(size)`` chunks, which is what a verifier allows (a table with more is refused as
absurd). The wire form is run-length: ``[start, length, count]`` for ``count`` consecutive chunks
of ``length`` bytes from ``start`` (docs/signing.md#formats-what-is-stored).
"""

from __future__ import annotations

from collections.abc import Sequence

from modelpack.errors import ChunkTableError
from modelpack.packing.safetensors_format import SafetensorsHeader

SMALL = 64 * 1024  # tensors below this share chunks; every aligned part is at least this long
GRID = 64  # a tensor's first dimension is cut into up to this many parts (TP/EP up to 64)
COLUMN_GRID = 8  # a 2-D tensor's columns are signed in up to this many blocks (dim-1 shares at TP ≤ 8)

__all__ = [
    "COLUMN_GRID",
    "GRID",
    "SMALL",
    "ColumnSpec",
    "aligned_starts",
    "column_blocks",
    "column_specs_from",
    "fixed_starts",
    "max_chunks",
    "runs_of",
    "starts_from_runs",
]

# (start, rows, row bytes, blocks): a 2-D tensor at ``[start, start + rows·row_bytes)`` of the
# blob, its columns signed in ``blocks`` equal blocks (the wire form of one ``columns`` entry)
ColumnSpec = tuple[int, int, int, int]


def max_chunks(size: int) -> int:
    """The most chunks an aligned table may give a layer of ``size`` bytes (see the module doc)."""
    return 4 * -(-size // SMALL) + 16


def fixed_starts(size: int, chunk_size: int, begin: int = 0) -> list[int]:
    """Chunk starts every ``chunk_size`` bytes of ``[begin, size)``."""
    return list(range(begin, size, chunk_size))


def _parts(rows: int, nbytes: int, chunk_size: int) -> int:
    """Parts of a tensor: a power of two up to ``GRID`` dividing its rows; halves of at least
    ``SMALL`` bytes, finer parts of at least half a chunk (so a table has at most ~3 chunks more
    per tensor than a fixed one, and a TP=2 dim-0 share is always whole chunks)."""
    p = GRID
    while p > 2 and (rows % p or nbytes // p < max(SMALL, chunk_size // 2)):
        p //= 2
    if p == 2 and (rows % 2 or nbytes // 2 < SMALL):
        p = 1
    return p


def aligned_starts(header: SafetensorsHeader, size: int, chunk_size: int) -> list[int]:
    """Chunk starts of a safetensors blob of ``size`` bytes aligned to its tensors (module doc);
    fixed starts where the header's tensors overlap or leave the blob (not a layout to align to)."""
    ds = header.data_start
    units: list[tuple[int, int, int]] = []  # (start, end, rows of dim 0) in file order
    pos = ds
    for t in sorted(header.tensors, key=lambda t: (t.begin, t.end)):
        s, e = ds + t.begin, ds + t.end
        if s < pos or e > size:
            return fixed_starts(size, chunk_size)
        if s > pos:
            units.append((pos, s, 1))
        if e > s:
            units.append((s, e, t.shape[0] if t.shape else 1))
        pos = e
    if pos < size:
        units.append((pos, size, 1))
    starts = fixed_starts(min(ds, size), chunk_size)
    run: int | None = None  # start of the open run of small units
    for s, e, rows in units:
        if e - s < SMALL:
            if run is None or e - run > SMALL:
                run = s
                starts.append(s)
            continue
        run = None
        p = _parts(rows, e - s, chunk_size) if (e - s) % max(1, rows) == 0 else 1
        step = (e - s) // p
        for k in range(p):
            a = s + k * step
            b = e if k == p - 1 else a + step
            starts.extend(range(a, b, chunk_size))
    return starts


def _tiled(header: SafetensorsHeader, size: int) -> bool:
    """Whether the header's tensors lie in the blob without overlapping (a layout to align to)."""
    pos = header.data_start
    for t in sorted(header.tensors, key=lambda t: (t.begin, t.end)):
        s, e = header.data_start + t.begin, header.data_start + t.end
        if s < pos or e > size:
            return False
        pos = e
    return True


def column_blocks(header: SafetensorsHeader, size: int, chunk_size: int) -> list[ColumnSpec]:
    """The column blocks an aligned table signs for a safetensors blob (module doc), in file order;
    none where the header's tensors overlap or leave the blob."""
    if not _tiled(header, size):
        return []
    out: list[ColumnSpec] = []
    for t in sorted(header.tensors, key=lambda t: t.begin):
        nbytes = t.end - t.begin
        if len(t.shape) != 2 or nbytes < 2 * SMALL or t.shape[0] < 1 or nbytes % t.shape[0]:
            continue
        cols = t.shape[1]
        k = COLUMN_GRID
        while k > 2 and (cols % k or nbytes // k < max(SMALL, chunk_size // 2)):
            k //= 2
        if k == 2 and (cols % 2 or nbytes // 2 < SMALL):
            continue
        out.append((header.data_start + t.begin, t.shape[0], nbytes // t.shape[0], k))
    return out


def column_specs_from(columns: object, size: int, what: str) -> list[ColumnSpec]:
    """The column blocks a predicate's ``columns`` declare, refused (``ChunkTableError``) unless
    each is ``[start, rows, rowBytes, blocks]`` integers with ``blocks`` a power of two from 2 to
    ``COLUMN_GRID`` dividing ``rowBytes``, in ascending, non-overlapping order inside the blob, and
    no more blocks in all than ``max_chunks(size)``."""
    if not isinstance(columns, list) or len(columns) > max_chunks(size):
        raise ChunkTableError(f"{what}: columns must be a list of at most {max_chunks(size)} entries")
    out: list[ColumnSpec] = []
    pos = total = 0
    for entry in columns:
        if (
            not isinstance(entry, list)
            or len(entry) != 4
            or any(isinstance(x, bool) or not isinstance(x, int) for x in entry)
        ):
            raise ChunkTableError(
                f"{what}: column entry {entry!r} is not [start, rows, rowBytes, blocks] integers"
            )
        start, rows, row_bytes, blocks = entry
        if (
            blocks not in {2**i for i in range(1, COLUMN_GRID.bit_length())}
            or row_bytes < blocks
            or row_bytes % blocks
        ):
            raise ChunkTableError(
                f"{what}: column entry {entry}: blocks must be a power of two from 2 to {COLUMN_GRID} dividing rowBytes"
            )
        if start < pos or rows < 1 or start + rows * row_bytes > size:
            raise ChunkTableError(
                f"{what}: column entry {entry} overlaps the one before it (ends at {pos}) or leaves the "
                f"blob's {size} bytes"
            )
        total += blocks
        if total > max_chunks(size):
            raise ChunkTableError(
                f"{what}: more than {max_chunks(size)} column blocks for {size} bytes (refused)"
            )
        pos = start + rows * row_bytes
        out.append((start, rows, row_bytes, blocks))
    return out


def runs_of(starts: Sequence[int], size: int) -> list[list[int]]:
    """``[start, length, count]`` runs of equal-length consecutive chunks."""
    runs: list[list[int]] = []
    for i, s in enumerate(starts):
        length = (starts[i + 1] if i + 1 < len(starts) else size) - s
        last = runs[-1] if runs else None
        if last is not None and last[1] == length and last[0] + last[1] * last[2] == s:
            last[2] += 1
        else:
            runs.append([s, length, 1])
    return runs


def starts_from_runs(runs: object, size: int, chunk_size: int, what: str) -> list[int]:
    """The chunk starts a predicate's ``runs`` declare, refused (``ChunkTableError``) unless they
    tile ``[0, size)`` exactly — no overlap, no gap, nothing past the blob — in chunks of 1 to
    ``chunk_size`` bytes, and no more of them than ``max_chunks(size)``."""
    if not isinstance(runs, list) or len(runs) > max_chunks(size):
        raise ChunkTableError(
            f"{what}: runs must be a list of at most {max_chunks(size)} [start, length, count]"
        )
    total = 0
    pos = 0
    for run in runs:
        if (
            not isinstance(run, list)
            or len(run) != 3
            or any(isinstance(x, bool) or not isinstance(x, int) for x in run)
        ):
            raise ChunkTableError(f"{what}: run {run!r} is not [start, length, count] integers")
        start, length, count = run
        if start < pos:
            raise ChunkTableError(f"{what}: run {run} overlaps the chunks before it (they end at {pos})")
        if start > pos:
            raise ChunkTableError(f"{what}: run {run} leaves bytes {pos}..{start} in no chunk (a gap)")
        if not 1 <= length <= chunk_size or count < 1:
            raise ChunkTableError(f"{what}: run {run}: chunks of 1..{chunk_size} bytes, at least one")
        total += count
        if total > max_chunks(size):
            raise ChunkTableError(
                f"{what}: more than {max_chunks(size)} chunks for {size} bytes (absurdly many; refused)"
            )
        pos = start + length * count
        if pos > size:
            raise ChunkTableError(f"{what}: run {run} ends at {pos}, past the blob's {size} bytes")
    if pos != size:
        raise ChunkTableError(f"{what}: runs end at {pos}, the blob has {size} bytes (a gap at the end)")
    out: list[int] = []
    for start, length, count in runs:
        out.extend(range(start, start + length * count, length))
    return out
