"""Strict header parsing: each malformed file gives a typed error naming the file (and tensor)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from modelpack.errors import SafetensorsError
from modelpack.packing.safetensors_format import DTYPE_BITS, build_header, read_header


def _write(path: Path, header: bytes | dict, data: bytes = b"", length: int | None = None) -> Path:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)
    return path


def test_real_safetensors_file_parses_with_offsets_in_file_order(tmp_path: Path) -> None:
    tensors = {
        "b": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "a": torch.ones(4, dtype=torch.bfloat16),
    }
    p = tmp_path / "m.safetensors"
    save_file(tensors, str(p), metadata={"format": "pt"})
    hdr = read_header(p)
    assert {t.name for t in hdr.tensors} == {"a", "b"}
    assert hdr.metadata == {"format": "pt"}
    raw = p.read_bytes()
    for t in hdr.tensors:
        start, end = hdr.absolute(t)
        expected = tensors[t.name].contiguous().view(torch.uint8).numpy().tobytes()
        assert raw[start:end] == expected
    assert hdr.param_count == 10


def test_build_header_round_trips(tmp_path: Path) -> None:
    prefix, spans = build_header([("x", "F16", (2, 2), 8), ("y", "F8_E4M3", (3,), 3)], {"k": "v"})
    assert len(prefix) % 8 == 0 and spans == [(0, 8), (8, 11)]
    p = tmp_path / "x.safetensors"
    p.write_bytes(prefix + bytes(11))
    hdr = read_header(p)
    assert [(t.name, t.dtype, t.shape) for t in hdr.tensors] == [("x", "F16", (2, 2)), ("y", "F8_E4M3", (3,))]


def test_full_dtype_table() -> None:
    for dtype in (
        "F8_E4M3",
        "F8_E5M2",
        "F8_E8M0",
        "F8_E4M3FNUZ",
        "F8_E5M2FNUZ",
        "BF16",
        "F16",
        "F32",
        "F64",
        "I8",
        "U8",
        "BOOL",
        "I64",
        "U64",
    ):
        assert dtype in DTYPE_BITS


def _t(dtype: str = "F32", shape: list[int] | None = None, offs: list[int] | None = None) -> dict:
    return {"dtype": dtype, "shape": shape if shape is not None else [2], "data_offsets": offs or [0, 8]}


CASES = {
    "length past EOF": (lambda p: _write(p, {"w": _t()}, bytes(8), length=10_000), "runs past the end", None),
    "header over 100 MB": (
        lambda p: _write(p, b"{}", b"", length=100_000_001),
        "not a safetensors file",
        None,
    ),
    "too short": (lambda p: p.write_bytes(b"\x01\x00"), "at least 8", None),
    "overlap": (
        lambda p: _write(p, {"a": _t(offs=[0, 8]), "b": _t(offs=[4, 12])}, bytes(12)),
        "overlap",
        "b",
    ),
    "gap": (lambda p: _write(p, {"a": _t(offs=[0, 8]), "b": _t(offs=[12, 20])}, bytes(20)), "gap", "b"),
    "wrong size": (lambda p: _write(p, {"a": _t(shape=[3], offs=[0, 8])}, bytes(8)), "does not match", "a"),
    "unknown dtype": (lambda p: _write(p, {"a": _t(dtype="F12")}, bytes(8)), "unknown dtype", "a"),
    "invalid utf8": (lambda p: _write(p, b'{"\xff": 1}', b""), "UTF-8", None),
    "invalid json": (lambda p: _write(p, b'{"a": ', b""), "JSON", None),
    "not an object": (lambda p: _write(p, b"[1, 2]", b""), "object", None),
    "duplicate key": (
        lambda p: _write(
            p,
            b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}',
            bytes(1),
        ),
        "duplicate",
        None,
    ),
    "trailing bytes": (lambda p: _write(p, {"a": _t()}, bytes(12)), "trailing", None),
    "data past end": (lambda p: _write(p, {"a": _t(offs=[0, 8])}, bytes(4)), "data bytes", "a"),
    "negative dim": (lambda p: _write(p, {"a": _t(shape=[-2])}, bytes(8)), "shape", "a"),
    "bad offsets": (lambda p: _write(p, {"a": _t(offs=[8, 0])}, bytes(8)), "data_offsets", "a"),
    "bad metadata": (lambda p: _write(p, {"__metadata__": {"k": 1}}, b""), "__metadata__", None),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_malformed_files_give_typed_errors_naming_the_file(tmp_path: Path, case: str) -> None:
    make, needle, tensor = CASES[case]
    p = tmp_path / f"{case.replace(' ', '_')}.safetensors"
    make(p)
    with pytest.raises(SafetensorsError) as info:
        read_header(p)
    assert str(p) in str(info.value)
    assert needle in str(info.value)
    assert info.value.tensor == tensor
