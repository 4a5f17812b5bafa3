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

__all__ = ["GRID", "SMALL", "aligned_starts", "fixed_starts", "max_chunks", "runs_of", "starts_from_runs"]


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
