"""Llama-shaped synthetic checkpoint specs of any size from 32 MiB to 156+ GiB (benchmarks only).

``SyntheticSpec.for_size`` keeps Llama-7B's hidden size and vocabulary and varies the layer
count, so it cannot go below ~360 MiB and has too few tensors to fill 141 shards. Here the layer
count is fixed (80, as in 70B-class models) and hidden (a multiple of 32) and the vocabulary
(4 × hidden) grow with the size: 723 tensors at any size, so 141 shards hold about five tensors
each and none is empty, and every sharded dimension divides by 8 (TP=2 and TP=8 plans are valid).
"""

from __future__ import annotations

from modelpack.testdata.synthetic import SyntheticSpec

LAYERS = 80


def spec_for(size: int, shards: int, seed: int = 0) -> SyntheticSpec:
    """An 80-layer bf16 Llama shape of about ``size`` bytes in ``shards`` files."""

    def nbytes(h: int) -> int:
        inter, vocab = _inter(h), 4 * h
        per_layer = 2 * h * h + 2 * (h // 4) * h + 3 * h * inter + 2 * h
        return 2 * (2 * vocab * h + LAYERS * per_layer + h)

    h = 32
    while nbytes(h + 32) <= size:
        h += 32
    if abs(nbytes(h + 32) - size) < abs(nbytes(h) - size):
        h += 32
    return SyntheticSpec(
        hidden=h,
        intermediate=_inter(h),
        layers=LAYERS,
        heads=32,
        kv_heads=8,
        vocab=4 * h,
        shards=shards,
        seed=seed,
    )


def _inter(h: int) -> int:
    return (int(h * 2.6875) + 63) // 64 * 64
