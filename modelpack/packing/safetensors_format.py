"""Strict safetensors header parsing (docs/artifact.md#layers). Shared by the packer, diff and the loader.

Rules: an 8-byte little-endian header length N ≤ 100 MB; N bytes of UTF-8 JSON (an object, no
duplicate keys, at most a few levels deep); every tensor has a known dtype, a shape of at most 64
non-negative ints whose non-zero product stays below 2^48, and ``data_offsets`` relative to 8+N;
sorted by offset the tensors tile the data area exactly (no gap, no overlap, first at 0, last end =
file length − 8 − N); each byte size = numel × bits / 8. Every error names the file and, where
there is one, the tensor.

The shape bounds exist because a zero dimension makes any other dimension "fit" the data area:
``[0, 2**63]`` is 0 bytes, yet torch cannot allocate it (int64 overflow), nor ``[0, 2**40,
2**40]`` (its strides overflow). No real tensor comes near 2^48 elements (256 TiB at one byte).
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from modelpack.boundedjson import loads_object
from modelpack.errors import DocumentError, SafetensorsError

MAX_HEADER_BYTES = 100 * 1000 * 1000
#: Header nesting. The format needs 3 (tensors → entry → shape); a little slack keeps the field
#: checks (which name the tensor) in charge of one-off mistakes, the bound in charge of attacks.
MAX_HEADER_DEPTH = 8
#: More dimensions than any framework uses (torch's CUDA kernels stop at 25).
MAX_DIMS = 64
#: Bound on the product of a shape's non-zero dimensions: what strides and element counts reach.
MAX_ELEMENTS = 2**48

# dtype -> bits per element (safetensors' full table, incl. the float8 and sub-byte float types)
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8,  # ROCm (MI300) float8 variants: no inf, one NaN, bias +1
    "F8_E5M2FNUZ": 8,
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


def header_length(path: str, prefix: bytes, file_size: int) -> int:
    """The header length the 8-byte prefix declares, checked against the file before any read.

    Every reader (a local file, a registry range, an S3 range, the loader) calls this first, so a
    file that merely carries the ``.safetensors`` name is called what it is ("not a safetensors
    file") instead of a 19-digit header length.
    """
    if file_size < 8 or len(prefix) < 8:
        raise SafetensorsError(
            path, f"not a safetensors file: {file_size} bytes, and a safetensors file has at least 8"
        )
    (n,) = struct.unpack("<Q", prefix[:8])
    if 8 + n > file_size:
        raise SafetensorsError(
            path,
            f"not a safetensors file: its first 8 bytes {_show(prefix[:8])} declare a {n}-byte header, "
            f"which runs past the end of the file ({file_size} bytes)",
        )
    if n > MAX_HEADER_BYTES:
        raise SafetensorsError(path, f"header length {n} exceeds the {MAX_HEADER_BYTES // 1000**2} MB limit")
    if n < 2:
        raise SafetensorsError(path, f"not a safetensors file: a {n}-byte header cannot hold a JSON object")
    return int(n)


def _show(data: bytes) -> str:
    """A short, printable picture of a file's first bytes (text shows as text)."""
    if all(32 <= b < 127 for b in data):
        return repr(data.decode("ascii"))
    return data.hex(" ")


def _check_shape(path: str, name: str, shape: Any) -> tuple[int, ...]:
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise SafetensorsError(
            path, f"shape must be a list of non-negative integers, got {_clip(shape)}", tensor=name
        )
    if len(shape) > MAX_DIMS:
        raise SafetensorsError(
            path, f"shape has {len(shape)} dimensions; the limit is {MAX_DIMS}", tensor=name
        )
    product = 1
    for d in shape:
        if d > MAX_ELEMENTS:
            raise SafetensorsError(
                path, f"shape dimension {d} exceeds 2^48 elements; no file holds such a tensor", tensor=name
            )
        if d:
            product *= d
            if product > MAX_ELEMENTS:
                raise SafetensorsError(
                    path,
                    f"shape {_clip(shape)} has more than 2^48 elements (its non-zero dimensions multiply to "
                    f"{math.prod(x for x in shape if x)}); no file holds such a tensor",
                    tensor=name,
                )
    return tuple(shape)


def _clip(value: Any, limit: int = 120) -> str:
    """``repr`` cut to fit one line: headers are hostile input and may hold megabyte values."""
    if isinstance(value, (list, str)) and len(value) > limit:
        value = value[:limit]
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _clip_name(name: str) -> str:
    return name if len(name) <= 200 else name[:200] + "…"


def parse_header_bytes(path: str, prefix: bytes, header: bytes, file_size: int) -> SafetensorsHeader:
    """Validate a header whose 8-byte length prefix and JSON bytes were already read."""
    n = header_length(path, prefix, file_size)
    if len(header) != n:
        raise SafetensorsError(path, f"header truncated: read {len(header)} of {n} bytes")
    if header[:1] != b"{":
        raise SafetensorsError(
            path,
            f"not a safetensors file: the header does not start with '{{' (it starts {_show(header[:8])})",
        )
    try:
        doc = loads_object(header, what="header", max_bytes=MAX_HEADER_BYTES, max_depth=MAX_HEADER_DEPTH)
    except DocumentError as exc:
        raise SafetensorsError(path, f"header: {exc.reason}") from None
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
    for key, info in doc.items():
        name = _clip_name(key)
        if not isinstance(info, dict) or set(info) - {"dtype", "shape", "data_offsets"}:
            raise SafetensorsError(
                path, "entry must be an object with dtype, shape, data_offsets", tensor=name
            )
        dtype = info.get("dtype")
        if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
            raise SafetensorsError(path, f"unknown dtype {_clip(dtype)}", tensor=name)
        shape = _check_shape(path, name, info.get("shape"))
        offs = info.get("data_offsets")
        if (
            not isinstance(offs, list)
            or len(offs) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offs)
            or offs[0] > offs[1]
        ):
            raise SafetensorsError(
                path, f"data_offsets must be [begin, end] with begin <= end, got {_clip(offs)}", tensor=name
            )
        if offs[1] > data_size:
            raise SafetensorsError(
                path, f"data_offsets {_clip(offs)} run past the file's {data_size} data bytes", tensor=name
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
                f"byte size {offs[1] - offs[0]} does not match shape {list(shape)} × {dtype} = {bits // 8} bytes",
                tensor=name,
            )
        tensors.append(TensorInfo(key, dtype, shape, offs[0], offs[1]))
    tensors.sort(key=lambda t: (t.begin, t.end))
    cursor = 0
    for t in tensors:
        if t.begin < cursor:
            raise SafetensorsError(
                path,
                f"data_offsets overlap the previous tensor (begin {t.begin} < {cursor})",
                tensor=_clip_name(t.name),
            )
        if t.begin > cursor:
            raise SafetensorsError(
                path,
                f"gap in the data area: tensor begins at {t.begin}, expected {cursor}",
                tensor=_clip_name(t.name),
            )
        cursor = t.end
    if cursor != data_size:
        raise SafetensorsError(
            path, f"tensors cover {cursor} data bytes but the file has {data_size} (trailing bytes)"
        )
    return SafetensorsHeader(path, n, file_size, tuple(tensors), metadata)


def read_header_from(f: BinaryIO, path: str, file_size: int) -> SafetensorsHeader:
    prefix = f.read(8)
    n = header_length(path, prefix, file_size)
    header = f.read(n)
    if len(header) != n:
        raise SafetensorsError(path, f"header truncated: read {len(header)} of {n} bytes")
    return parse_header_bytes(path, prefix, header, file_size)


def read_header(path: str | os.PathLike[str]) -> SafetensorsHeader:
    p = os.fspath(path)
    try:
        with open(p, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            return read_header_from(f, p, size)
    except OSError as exc:
        raise SafetensorsError(p, f"cannot read: {exc.strerror or exc}") from exc


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
