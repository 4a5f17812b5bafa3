"""Reading a weight file's safetensors header, through verified whole chunks where a table exists.

A header is parsed before the plan exists, so in chunk mode it cannot ride on the load's
chunk-verified ring: ``ChunkFetcher`` verifies the chunks it covers on its own, so no unverified
header byte ever reaches the parser.
"""

from __future__ import annotations

from collections.abc import Callable

from modelpack.loader.readers import RangeReader
from modelpack.loader.sources import WeightFile

from modelpack.packing.safetensors_format import SafetensorsHeader, header_length, parse_header_bytes


def read_header(
    reader: RangeReader, name: str, size: int, verify: Callable[[int, int], bytes] | None
) -> SafetensorsHeader:
    """Header of one file; ``verify(offset, length)`` returns verified bytes (chunk mode)."""

    def get(offset: int, length: int) -> bytes:
        if verify is not None:
            return verify(offset, length)
        buf = bytearray(length)
        reader.read_into(offset, memoryview(buf))
        return bytes(buf)

    prefix = get(0, 8) if size >= 8 else b""
    n = header_length(name, prefix, size)  # the packer's checks, messages included
    return parse_header_bytes(name, prefix, get(8, n), size)


class ChunkFetcher:
    """Verified reads of arbitrary byte ranges through whole chunks (header parsing in chunk mode)."""

    def __init__(self, reader: RangeReader, file: WeightFile) -> None:
        self.reader = reader
        self.file = file
        self.table = file.chunks
        self.layer = str(file.descriptor.digest) if file.descriptor else ""
        # the last verified chunk: the 8-byte prefix and the header JSON are two reads that
        # usually fall in the same chunk, which should cross the network once
        self._last: tuple[int, bytearray] | None = None

    def __call__(self, offset: int, length: int) -> bytes:
        cs = self.table.chunk_size
        out = bytearray()
        first, last = offset // cs, (offset + length - 1) // cs
        for idx in range(first, last + 1):
            c0, clen = self.table.chunk_range(self.layer, idx)
            if self._last is not None and self._last[0] == idx:
                buf = self._last[1]
            else:
                buf = bytearray(clen)
                self.reader.read_into(c0, memoryview(buf))
                self.table.verify_chunk(self.layer, idx, memoryview(buf))
                self._last = (idx, buf)
            s = max(offset, c0) - c0
            e = min(offset + length, c0 + clen) - c0
            out += buf[s:e]
        return bytes(out)
