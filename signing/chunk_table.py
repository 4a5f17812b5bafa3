"""The chunk-digest table as data: per weight layer, its chunks' digests and where they begin,
and its 2-D tensors' column blocks; the predicate's wire form, parsed and checked
(docs/signing.md#formats-what-is-stored). Hashing, signing and finding tables: ``chunks``.

Predicate::

    {"manifestDigest": "sha256:…", "chunkSize": 16777216, "algorithm": "sha256",
     "layers": {"sha256:<layer>": {"size": 123, "chunks": ["<hex>", …]}}}

A layer entry with ``"runs": [[start, length, count], …]`` has chunks aligned to its tensors
(``chunk_bounds``; ``chunkSize`` is then the longest chunk): what ``compute_chunk_table(...,
aligned=True)`` and ``modelpack sign`` write. A layer without ``runs`` is cut every ``chunkSize``
bytes, as every table published before; both verify the same way. Aligned entries also carry
``"columns": [[start, rows, rowBytes, blocks], …]`` and ``"columnChunks": ["<hex>", …]``: the
digests of the column blocks of its 2-D tensors (``chunk_bounds.column_blocks``), which let a
column-split share be read and checked without the other ranks' columns. A verifier that does not
know them ignores them (the contiguous chunks still tile the blob).
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import hmac
from dataclasses import dataclass, field
from typing import Any

from modelpack.signing.chunk_bounds import ColumnSpec, column_specs_from, runs_of, starts_from_runs

from modelpack.errors import ChunkDigestMismatch, ChunkTableError
from modelpack.oci.descriptor import Manifest
from modelpack.oci.digest import Digest
from modelpack.targets.base import RangeCheck

MIN_CHUNK_SIZE = 64 * 1024
MAX_CHUNK_SIZE = 1024 * 1024 * 1024

__all__ = ["MAX_CHUNK_SIZE", "MIN_CHUNK_SIZE", "ChunkTable", "ColumnBlocks", "LayerChunks"]


@dataclass(frozen=True)
class ColumnBlocks:
    """A 2-D tensor's columns signed in ``len(digests)`` equal blocks: block ``j`` is every row's
    ``j``-th slice of ``block_bytes``, rows in order (``chunk_bounds.column_blocks``)."""

    start: int
    rows: int
    row_bytes: int
    digests: tuple[bytes, ...]

    @property
    def end(self) -> int:
        return self.start + self.rows * self.row_bytes

    @property
    def block_bytes(self) -> int:
        return self.row_bytes // len(self.digests)

    @property
    def spec(self) -> ColumnSpec:
        return (self.start, self.rows, self.row_bytes, len(self.digests))


@dataclass(frozen=True)
class LayerChunks:
    size: int
    digests: list[bytes]  # raw 32-byte sha256 per chunk; the last chunk may be short
    # aligned tables: where each chunk begins (ascending, from 0); None: every chunk_size bytes
    starts: tuple[int, ...] | None = None
    columns: tuple[ColumnBlocks, ...] = ()  # aligned tables: the 2-D tensors' column blocks

    @functools.cached_property
    def column_at(self) -> dict[int, ColumnBlocks]:
        """The column blocks by the byte their tensor starts at (one lookup per tensor)."""
        return {c.start: c for c in self.columns}


@dataclass(frozen=True)
class ChunkTable:
    manifest_digest: str
    chunk_size: int  # fixed layers: the chunk length; aligned layers: the longest chunk
    layers: dict[str, LayerChunks] = field(default_factory=dict)

    @property
    def aligned(self) -> bool:
        """Whether any layer's chunks are aligned to its tensors (``runs`` on the wire)."""
        return any(lc.starts is not None for lc in self.layers.values())

    def chunk_range(self, layer_digest: str, index: int) -> tuple[int, int]:
        """(offset, length) of chunk ``index`` in the layer blob."""
        layer = self._layer(layer_digest)
        if not 0 <= index < len(layer.digests):
            raise ChunkTableError(
                f"layer {layer_digest}: chunk {index} out of range (0..{len(layer.digests) - 1})"
            )
        if layer.starts is None:
            start = index * self.chunk_size
            return start, min(self.chunk_size, layer.size - start)
        start = layer.starts[index]
        end = layer.starts[index + 1] if index + 1 < len(layer.starts) else layer.size
        return start, end - start

    def chunk_index(self, layer_digest: str, offset: int) -> int:
        """The index of the chunk holding byte ``offset`` of the layer."""
        layer = self._layer(layer_digest)
        if layer.starts is None:
            return offset // self.chunk_size
        return max(0, bisect.bisect_right(layer.starts, offset) - 1)

    def chunks_covering(self, layer_digest: str, start: int, end: int) -> range:
        """Indexes of the chunks holding any byte of ``[start, end)``."""
        if end <= start:
            return range(0)
        return range(self.chunk_index(layer_digest, start), self.chunk_index(layer_digest, end - 1) + 1)

    def chunk_at(self, layer_digest: str, offset: int) -> tuple[int, int]:
        """(offset, length) of the chunk holding byte ``offset`` of the layer."""
        return self.chunk_range(layer_digest, self.chunk_index(layer_digest, offset))

    def column_blocks(self, layer_digest: str, start: int, end: int) -> ColumnBlocks | None:
        """The signed column blocks of the tensor at ``[start, end)`` of the layer, if any."""
        layer = self.layers.get(str(layer_digest))
        found = layer.column_at.get(start) if layer is not None and layer.columns else None
        return found if found is not None and found.end == end else None

    def _layer(self, layer_digest: str) -> LayerChunks:
        try:
            return self.layers[str(layer_digest)]
        except KeyError:
            raise ChunkTableError(
                f"chunk table of {self.manifest_digest} has no entry for layer {layer_digest}"
            ) from None

    def verify_chunk(self, layer_digest: str, index: int, data: bytes | bytearray | memoryview) -> None:
        """Raise ``ChunkDigestMismatch`` unless ``data`` is exactly chunk ``index`` of the layer."""
        layer = self._layer(layer_digest)
        _, length = self.chunk_range(layer_digest, index)
        expected = layer.digests[index]
        actual = hashlib.sha256(data).digest()
        if len(data) != length or not hmac.compare_digest(actual, expected):
            raise ChunkDigestMismatch(
                str(layer_digest),
                index,
                f"sha256:{expected.hex()} ({length} bytes)",
                f"sha256:{actual.hex()} ({len(data)} bytes)",
            )

    def wrong_chunks(self, layer_digest: str, offset: int, data: bytes) -> list[tuple[int, int]]:
        """(offset, length) of each whole chunk inside ``data`` (read at ``offset`` of the layer)
        whose bytes do not match the table; chunks ``data`` covers only in part are not judged."""
        layer = self._layer(layer_digest)
        wrong = []
        first = self.chunk_index(layer_digest, offset)
        if first < len(layer.digests) and self.chunk_range(layer_digest, first)[0] < offset:
            first += 1  # begins before ``data``: not judged
        for idx in range(first, len(layer.digests)):
            c0, clen = self.chunk_range(layer_digest, idx)
            if c0 + clen > offset + len(data):
                break
            part = data[c0 - offset : c0 - offset + clen]
            if not hmac.compare_digest(hashlib.sha256(part).digest(), layer.digests[idx]):
                wrong.append((c0, clen))
        return wrong

    def range_check(self, layer_digest: str) -> RangeCheck:
        """``wrong_chunks`` for one layer: what a mirrored range read uses to refetch bad chunks."""
        return lambda offset, data: self.wrong_chunks(layer_digest, offset, data)

    # -------------------------------------------------------------- wire form
    def to_predicate(self) -> dict[str, Any]:
        return {
            "manifestDigest": str(self.manifest_digest),
            "chunkSize": self.chunk_size,
            "algorithm": "sha256",
            "layers": {d: self._layer_doc(lc) for d, lc in sorted(self.layers.items())},
        }

    @staticmethod
    def _layer_doc(lc: LayerChunks) -> dict[str, Any]:
        doc: dict[str, Any] = {"size": lc.size, "chunks": [c.hex() for c in lc.digests]}
        if lc.starts is not None:
            doc["runs"] = runs_of(lc.starts, lc.size)
        if lc.columns:
            doc["columns"] = [list(c.spec) for c in lc.columns]
            doc["columnChunks"] = [d.hex() for c in lc.columns for d in c.digests]
        return doc

    @classmethod
    def from_predicate(cls, doc: Any, manifest: Manifest | None = None) -> ChunkTable:
        """Parse and check a predicate; with ``manifest`` also check every layer belongs to it."""
        if not isinstance(doc, dict):
            raise ChunkTableError("chunk table predicate must be an object")
        if doc.get("algorithm", "sha256") != "sha256":
            raise ChunkTableError(f"chunk table algorithm {doc.get('algorithm')!r}; only sha256 is accepted")
        chunk_size = doc.get("chunkSize")
        if (
            isinstance(chunk_size, bool)
            or not isinstance(chunk_size, int)
            or not (MIN_CHUNK_SIZE <= chunk_size <= MAX_CHUNK_SIZE)
        ):
            raise ChunkTableError(f"chunk table chunkSize {chunk_size!r} out of range")
        try:
            manifest_digest = Digest(doc.get("manifestDigest", ""))
        except ValueError as exc:
            raise ChunkTableError(f"chunk table manifestDigest: {exc}") from exc
        layers_doc = doc.get("layers")
        if not isinstance(layers_doc, dict):
            raise ChunkTableError("chunk table layers must be an object")
        sizes = {str(layer.digest): layer.size for layer in manifest.layers} if manifest else None
        layers: dict[str, LayerChunks] = {}
        for digest, entry in layers_doc.items():
            try:
                Digest(digest)
            except ValueError as exc:
                raise ChunkTableError(f"chunk table layer key: {exc}") from exc
            if not isinstance(entry, dict):
                raise ChunkTableError(f"chunk table layer {digest}: must be an object")
            size, chunks = entry.get("size"), entry.get("chunks")
            if isinstance(size, bool) or not isinstance(size, int) or size < 0:
                raise ChunkTableError(f"chunk table layer {digest}: bad size {size!r}")
            if sizes is not None and sizes.get(digest) != size:
                raise ChunkTableError(
                    f"chunk table layer {digest} ({size} bytes) is not a layer of manifest {manifest_digest}"
                )
            starts: tuple[int, ...] | None = None
            if "runs" in entry:  # aligned: the runs must tile the blob exactly
                starts = tuple(
                    starts_from_runs(entry["runs"], size, chunk_size, f"chunk table layer {digest}")
                )
                expected_n = len(starts)
            else:
                expected_n = -(-size // chunk_size)
            if not isinstance(chunks, list) or len(chunks) != expected_n:
                raise ChunkTableError(f"chunk table layer {digest}: expected {expected_n} chunk digests")
            raw = _hex_digests(chunks, f"chunk table layer {digest}")
            columns: tuple[ColumnBlocks, ...] = ()
            if "columns" in entry:
                what = f"chunk table layer {digest}"
                specs = column_specs_from(entry["columns"], size, what)
                blocks = entry.get("columnChunks")
                if not isinstance(blocks, list) or len(blocks) != sum(k for *_, k in specs):
                    raise ChunkTableError(
                        f"{what}: expected {sum(k for *_, k in specs)} column chunk digests"
                    )
                col_raw = _hex_digests(blocks, what)
                pos = 0
                out = []
                for start, rows, row_bytes, k in specs:
                    out.append(ColumnBlocks(start, rows, row_bytes, tuple(col_raw[pos : pos + k])))
                    pos += k
                columns = tuple(out)
            layers[digest] = LayerChunks(size, raw, starts, columns)
        return cls(str(manifest_digest), chunk_size, layers)


def _hex_digests(items: list[Any], what: str) -> list[bytes]:
    """Raw sha256 digests from a list of 64-digit hex strings (``ChunkTableError`` otherwise)."""
    raw: list[bytes] = []
    for c in items:
        if not isinstance(c, str) or len(c) != 64:
            raise ChunkTableError(f"{what}: bad chunk digest {c!r}")
        try:
            raw.append(bytes.fromhex(c))
        except ValueError as exc:
            raise ChunkTableError(f"{what}: bad chunk digest {c!r}") from exc
    return raw
