"""Safetensors dtype names → torch dtypes, refusing the ones this torch build cannot hold."""

from __future__ import annotations

import torch

from modelpack.errors import UnsupportedDtypeError

_TORCH_DTYPES: dict[str, str] = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "I16": "int16",
    "U16": "uint16",
    "F16": "float16",
    "BF16": "bfloat16",
    "I32": "int32",
    "U32": "uint32",
    "F32": "float32",
    "C64": "complex64",
    "I64": "int64",
    "U64": "uint64",
    "F64": "float64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E8M0": "float8_e8m0fnu",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
}


def torch_dtype(st_dtype: str, *, where: str = "") -> torch.dtype:
    """Looked up by name because older torch builds lack the float8 types: refuse, never guess."""
    name = _TORCH_DTYPES.get(st_dtype)
    dt = getattr(torch, name, None) if name else None
    if not isinstance(dt, torch.dtype):
        raise UnsupportedDtypeError(f"{where}: safetensors dtype {st_dtype} has no torch equivalent here")
    return dt
