"""Fast generation of large Llama-shaped checkpoints for the loader benchmarks.

``modelpack.testdata.synthetic`` derives every byte from a seeded SHAKE-128 stream per tensor
(reproducible, one core); the benchmarks need 4–16 GiB in seconds. Here one random block (finite as bf16: the top exponent bit
of every 16-bit word is cleared) is written at a different rotation for every tensor, so no two
tensors are equal and nothing compresses, at disk speed.
"""

from __future__ import annotations

import json
import os

from modelpack.packing.safetensors_format import build_header
from modelpack.testdata.synthetic import DTYPE_SIZES, SyntheticSpec, hf_config, tensor_shapes

BLOCK = 64 * 1024 * 1024


def _block(seed: int) -> bytes:
    import random

    rng = random.Random(seed)
    buf = bytearray(rng.randbytes(BLOCK))
    buf[1::2] = buf[1::2].translate(bytes(b & 0xBF for b in range(256)))
    return bytes(buf)


def write_fast_checkpoint(directory: str, total_bytes: int, shards: int = 4, *, seed: int = 0) -> list[str]:
    """About ``total_bytes`` of bf16 Llama-shaped tensors in ``shards`` files (+ config.json)."""
    spec = SyntheticSpec.for_size(total_bytes, shards=shards, seed=seed)
    shapes = tensor_shapes(spec)
    es = DTYPE_SIZES[spec.dtype]
    sizes = [(n, s, es * _numel(s)) for n, s in shapes]
    total = sum(b for _, _, b in sizes)
    groups: list[list[tuple[str, tuple[int, ...], int]]] = [[] for _ in range(shards)]
    acc = 0
    g = 0
    for item in sizes:
        if acc >= total / shards * (g + 1) and g < shards - 1:
            g += 1
        groups[g].append(item)
        acc += item[2]
    os.makedirs(directory, exist_ok=True)
    block = _block(seed)
    view = memoryview(block)
    paths = []
    rot = 0
    for i, group in enumerate(groups):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        path = os.path.join(directory, name)
        prefix, _ = build_header(((n, spec.dtype, s, b) for n, s, b in group), {"format": "pt"})
        with open(path, "wb") as f:
            f.write(prefix)
            for _, _, nbytes in group:
                rot = (rot + 4099 * 2) % BLOCK
                left = nbytes
                pos = rot
                while left:
                    n = min(left, BLOCK - pos)
                    f.write(view[pos : pos + n])
                    left -= n
                    pos = 0
        paths.append(path)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(hf_config(spec), f)
    return paths


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def warm(paths: list[str]) -> int:
    """Read files once so they sit in the page cache (hot-cache benchmarks); returns bytes."""
    buf = bytearray(16 * 1024 * 1024)
    total = 0
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while True:
                n = f.readinto(buf)
                if not n:
                    break
                total += n
    return total
