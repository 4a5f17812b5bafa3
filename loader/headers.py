"""Reading a weight file's safetensors header, through verified whole chunks where a table exists.

A header is parsed before the plan exists, so in chunk mode it cannot ride on the load's
chunk-verified ring: ``ChunkFetcher`` verifies the chunks it covers on its own, so no unverified
header byte ever reaches the parser. Those chunks hold tensor data too; ``VerifiedChunks`` keeps
them (within a budget) so the data pass copies them instead of fetching them a second time.

Without a table the header is parsed from unverified bytes. ``read_header`` therefore returns
the exact bytes it parsed: the whole-layer path compares them with the bytes it hashes, so a
source that serves one header to the parser and another to the digest check is caught.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from modelpack.loader.readers import RangeReader
from modelpack.loader.weight_files import WeightFile

from modelpack.packing.safetensors_format import SafetensorsHeader, header_length, parse_header_bytes


def read_header(
    reader: RangeReader, name: str, size: int, verify: Callable[[int, int], bytes] | None
) -> tuple[SafetensorsHeader, bytes]:
    """Header of one file and the bytes it was parsed from (8-byte prefix + JSON).

    ``verify(offset, length)`` returns verified bytes (chunk mode)."""

    def get(offset: int, length: int) -> bytes:
        if verify is not None:
            return verify(offset, length)
        buf = bytearray(length)
        reader.read_into(offset, memoryview(buf))
        return bytes(buf)

    prefix = get(0, 8) if size >= 8 else b""
    n = header_length(name, prefix, size)  # the packer's checks and messages ("not a safetensors file")
    body = get(8, n)
    return parse_header_bytes(name, prefix, body, size), prefix + body


class VerifiedChunks:
    """Chunks already verified (while reading headers), kept for the data pass up to ``budget`` bytes.

    Headers are read in plan order, so the budget goes to the files the load reads first, and
    each file's chunks are released as soon as its data pass took (or skipped) them.
    """

    def __init__(self, budget: int) -> None:
        self.budget = max(0, budget)
        self.used = 0
        self._lock = threading.Lock()
        self._chunks: dict[tuple[str, int], bytearray] = {}

    def offer(self, file: str, index: int, data: bytearray) -> None:
        with self._lock:
            key = (file, index)
            if key in self._chunks or self.used + len(data) > self.budget:
                return
            self._chunks[key] = data
            self.used += len(data)

    def take(self, file: str, index: int) -> bytearray | None:
        with self._lock:
            data = self._chunks.pop((file, index), None)
            if data is not None:
                self.used -= len(data)
            return data

    def indexes(self, file: str) -> set[int]:
        with self._lock:
            return {i for f, i in self._chunks if f == file}

    def drop(self, file: str) -> None:
        with self._lock:
            for key in [k for k in self._chunks if k[0] == file]:
                self.used -= len(self._chunks.pop(key))

    def clear(self) -> None:
        with self._lock:
            self._chunks.clear()
            self.used = 0


class ChunkFetcher:
    """Verified reads of arbitrary byte ranges through whole chunks (header parsing in chunk mode)."""

    def __init__(self, reader: RangeReader, file: WeightFile, keep: VerifiedChunks | None = None) -> None:
        self.reader = reader
        self.file = file
        self.table = file.chunks
        self.layer = str(file.descriptor.digest) if file.descriptor else ""
        self.keep = keep
        # the chunks verified so far: the 8-byte prefix and the header JSON are two reads that
        # usually fall in the same chunk, which should cross the network once
        self._seen: dict[int, bytearray] = {}

    @property
    def seen(self) -> dict[int, bytearray]:
        """The chunks verified so far, by index."""
        return self._seen

    def preload(self, index: int, data: bytearray) -> None:
        """A chunk the caller verified already (a peer's broadcast): used instead of a read."""
        self._seen[index] = data
        if self.keep is not None:
            self.keep.offer(self.file.relpath, index, data)

    def __call__(self, offset: int, length: int) -> bytes:
        out = bytearray()
        for idx in self.table.chunks_covering(self.layer, offset, offset + length):
            c0, clen = self.table.chunk_range(self.layer, idx)
            buf = self._seen.get(idx)
            if buf is None:
                buf = bytearray(clen)
                self.reader.read_into(c0, memoryview(buf))
                self.table.verify_chunk(self.layer, idx, memoryview(buf))
                self._seen[idx] = buf
                if self.keep is not None:
                    self.keep.offer(self.file.relpath, idx, buf)
            s = max(offset, c0) - c0
            e = min(offset + length, c0 + clen) - c0
            out += buf[s:e]
        return bytes(out)
