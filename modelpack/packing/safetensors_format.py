"""Strict safetensors header parsing (DESIGN §6). Shared by the packer, diff and the loader.

Rules: an 8-byte little-endian header length N ≤ 100 MB; N bytes of UTF-8 JSON (an object, no
duplicate keys); every tensor has a known dtype, a shape of non-negative ints and
``data_offsets`` relative to 8+N; sorted by offset the tensors tile the data area exactly (no gap,
no overlap, first at 0, last end = file length − 8 − N); each byte size = numel × bits / 8.
Every error names the file and, where there is one, the tensor.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from modelpack.errors import SafetensorsError

MAX_HEADER_BYTES = 100 * 1000 * 1000

# dtype -> bits per element (safetensors' full table, incl. the float8 and sub-byte float types)
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "C64": 64,
    "I64": 64,
    "U64": 64,
    "F64": 64,
}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # relative to the data area (8 + N)
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class SafetensorsHeader:
    path: str
    header_size: int
    file_size: int
    tensors: tuple[TensorInfo, ...]  # in offset order
    metadata: dict[str, str] = field(default_factory=dict)

    @property
    def data_start(self) -> int:
        return 8 + self.header_size

    def by_name(self) -> dict[str, TensorInfo]:
        return {t.name: t for t in self.tensors}

    def absolute(self, t: TensorInfo) -> tuple[int, int]:
        return self.data_start + t.begin, self.data_start + t.end

    @property
    def param_count(self) -> int:
        return sum(t.numel for t in self.tensors)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def parse_header_bytes(path: str, prefix: bytes, header: bytes, file_size: int) -> SafetensorsHeader:
    """Validate a header whose 8-byte length prefix and JSON bytes were already read."""
    (n,) = struct.unpack("<Q", prefix)
    try:
        text = header.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SafetensorsError(path, f"header is not valid UTF-8 ({exc.reason} at byte {exc.start})") from exc
    try:
        doc = json.loads(text, object_pairs_hook=_no_duplicates)
    except ValueError as exc:
        raise SafetensorsError(path, f"header is not valid JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise SafetensorsError(path, "header must be a JSON object")
    metadata: dict[str, str] = {}
    raw_meta = doc.pop("__metadata__", None)
    if raw_meta is not None:
        if not isinstance(raw_meta, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in raw_meta.items()
        ):
            raise SafetensorsError(path, "__metadata__ must map strings to strings")
        metadata = raw_meta
    data_size = file_size - 8 - n
    tensors: list[TensorInfo] = []
    for name, info in doc.items():
        if not isinstance(info, dict) or set(info) - {"dtype", "shape", "data_offsets"}:
            raise SafetensorsError(
                path, "entry must be an object with dtype, shape, data_offsets", tensor=name
            )
        dtype = info.get("dtype")
        if dtype not in DTYPE_BITS:
            raise SafetensorsError(path, f"unknown dtype {dtype!r}", tensor=name)
        shape = info.get("shape")
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise SafetensorsError(
                path, f"shape must be a list of non-negative integers, got {shape!r}", tensor=name
            )
        offs = info.get("data_offsets")
        if (
            not isinstance(offs, list)
            or len(offs) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offs)
            or offs[0] > offs[1]
        ):
            raise SafetensorsError(
                path, f"data_offsets must be [begin, end] with begin <= end, got {offs!r}", tensor=name
            )
        numel = math.prod(shape)
        bits = numel * DTYPE_BITS[dtype]
        if bits % 8:
            raise SafetensorsError(
                path, f"{numel} elements of {dtype} is not a whole number of bytes", tensor=name
            )
        if offs[1] - offs[0] != bits // 8:
            raise SafetensorsError(
                path,
                f"byte size {offs[1] - offs[0]} does not match shape {shape} × {dtype} = {bits // 8} bytes",
                tensor=name,
            )
        if offs[1] > data_size:
            raise SafetensorsError(
                path, f"data ends at {offs[1]} but the file has only {data_size} data bytes", tensor=name
            )
        tensors.append(TensorInfo(name, dtype, tuple(shape), offs[0], offs[1]))
    tensors.sort(key=lambda t: (t.begin, t.end))
    cursor = 0
    for t in tensors:
        if t.begin < cursor:
            raise SafetensorsError(
                path, f"data_offsets overlap the previous tensor (begin {t.begin} < {cursor})", tensor=t.name
            )
        if t.begin > cursor:
            raise SafetensorsError(
                path, f"gap in the data area: tensor begins at {t.begin}, expected {cursor}", tensor=t.name
            )
        cursor = t.end
    if cursor != data_size:
        raise SafetensorsError(
            path, f"tensors cover {cursor} data bytes but the file has {data_size} (trailing bytes)"
        )
    return SafetensorsHeader(path, n, file_size, tuple(tensors), metadata)


def read_header_from(f: BinaryIO, path: str, file_size: int) -> SafetensorsHeader:
    if file_size < 8:
        raise SafetensorsError(path, f"file is {file_size} bytes; a safetensors file has at least 8")
    prefix = f.read(8)
    (n,) = struct.unpack("<Q", prefix)
    if n > MAX_HEADER_BYTES:
        raise SafetensorsError(path, f"header length {n} exceeds the 100 MB limit")
    if 8 + n > file_size:
        raise SafetensorsError(path, f"header length {n} runs past the end of the file ({file_size} bytes)")
    header = f.read(n)
    if len(header) != n:
        raise SafetensorsError(path, f"header truncated: read {len(header)} of {n} bytes")
    return parse_header_bytes(path, prefix, header, file_size)


def read_header(path: str | os.PathLike[str]) -> SafetensorsHeader:
    p = os.fspath(path)
    with open(p, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        return read_header_from(f, p, size)


def build_header(
    tensors: Iterable[tuple[str, str, tuple[int, ...], int]], metadata: dict[str, str] | None = None
) -> tuple[bytes, list[tuple[int, int]]]:
    """Serialise a header for tensors laid out back to back, in the given order.

    ``tensors`` yields (name, dtype, shape, nbytes). Returns the full prefix (8-byte length +
    JSON padded with spaces to a multiple of 8, as safetensors does) and each tensor's relative
    (begin, end).
    """
    doc: dict[str, Any] = {}
    if metadata:
        doc["__metadata__"] = dict(metadata)
    spans: list[tuple[int, int]] = []
    cursor = 0
    for name, dtype, shape, nbytes in tensors:
        doc[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [cursor, cursor + nbytes]}
        spans.append((cursor, cursor + nbytes))
        cursor += nbytes
    text = json.dumps(doc, separators=(",", ":")).encode()
    pad = (8 - len(text) % 8) % 8
    text += b" " * pad
    return struct.pack("<Q", len(text)) + text, spans
