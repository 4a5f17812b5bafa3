"""Deterministic synthetic checkpoints (Llama-shaped) for the demo, tests and benchmarks.

Written with the standard library only (no torch/numpy needed), so ``make demo`` works on a bare
machine. Tensor bytes come from a seeded SHAKE-128 stream: reproducible and
incompressible, like real weights.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

from modelpack.packing.safetensors_format import build_header

DTYPE_SIZES = {"BF16": 2, "F16": 2, "F32": 4}
TORCH_DTYPE = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}


@dataclass(frozen=True)
class SyntheticSpec:
    hidden: int = 256
    intermediate: int = 688
    layers: int = 2
    heads: int = 8
    kv_heads: int = 4
    vocab: int = 1024
    dtype: str = "BF16"
    shards: int = 1
    seed: int = 0

    @classmethod
    def for_size(cls, total_bytes: int, shards: int = 1, dtype: str = "BF16", seed: int = 0) -> SyntheticSpec:
        """Pick dimensions so the checkpoint is about ``total_bytes`` (for benchmarks)."""
        hidden = 2048
        inter = 5504
        vocab = 32000
        per_layer = (4 * hidden * hidden + 3 * hidden * inter) * DTYPE_SIZES[dtype]
        base = 2 * vocab * hidden * DTYPE_SIZES[dtype]
        layers = max(1, round((total_bytes - base) / per_layer))
        return cls(hidden, inter, layers, 16, 8, vocab, dtype, shards, seed)


def hf_config(spec: SyntheticSpec) -> dict[str, object]:
    """The transformers ``config.json`` that describes the synthetic tensors."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "vocab_size": spec.vocab,
        "torch_dtype": TORCH_DTYPE[spec.dtype],
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
    }


def tensor_shapes(spec: SyntheticSpec) -> list[tuple[str, tuple[int, ...]]]:
    h, i, kv = spec.hidden, spec.intermediate, spec.hidden * spec.kv_heads // spec.heads
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (spec.vocab, h))]
    for n in range(spec.layers):
        p = f"model.layers.{n}."
        out += [
            (p + "input_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (h, h)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.weight", (kv, h)),
            (p + "self_attn.o_proj.weight", (h, h)),
            (p + "post_attention_layernorm.weight", (h,)),
            (p + "mlp.gate_proj.weight", (i, h)),
            (p + "mlp.up_proj.weight", (i, h)),
            (p + "mlp.down_proj.weight", (h, i)),
        ]
    out += [("model.norm.weight", (h,)), ("lm_head.weight", (spec.vocab, h))]
    return out


_CLAMP = bytes(b & 0xBF for b in range(256))


def _fill(f: object, nbytes: int, key: bytes) -> None:
    """Write ``nbytes`` of seeded pseudo-random bytes (SHAKE-128 stream), finite as bf16/f16/f32.

    The high byte of every 16-bit little-endian word gets its top exponent bit cleared, so no
    value is inf/NaN (NaN would make bit-identical comparisons through float ops misleading).
    """
    block = 1 << 22
    counter = 0
    written = 0
    while written < nbytes:
        n = min(block, nbytes - written)
        buf = bytearray(hashlib.shake_128(key + counter.to_bytes(8, "little")).digest(n))
        counter += 1
        buf[1::2] = buf[1::2].translate(_CLAMP)
        f.write(buf)  # type: ignore[attr-defined]
        written += n


def write_checkpoint(
    directory: str, spec: SyntheticSpec | None = None, *, extra_files: bool = True
) -> list[str]:
    """Write a Llama-shaped safetensors checkpoint (+ config/tokenizer/README); returns file paths."""
    spec = spec or SyntheticSpec()
    os.makedirs(directory, exist_ok=True)
    shapes = tensor_shapes(spec)
    esize = DTYPE_SIZES[spec.dtype]
    groups: list[list[tuple[str, tuple[int, ...]]]] = [[] for _ in range(spec.shards)]
    total = sum(esize * _numel(s) for _, s in shapes)
    target = total / spec.shards
    acc = 0
    g = 0
    for name, shape in shapes:
        if acc >= target * (g + 1) and g < spec.shards - 1:
            g += 1
        groups[g].append((name, shape))
        acc += esize * _numel(shape)
    paths = []
    weight_map = {}
    for idx, group in enumerate(groups):
        fname = (
            "model.safetensors"
            if spec.shards == 1
            else f"model-{idx + 1:05d}-of-{spec.shards:05d}.safetensors"
        )
        path = os.path.join(directory, fname)
        prefix, _ = build_header(((n, spec.dtype, s, esize * _numel(s)) for n, s in group), {"format": "pt"})
        with open(path, "wb") as f:
            f.write(prefix)
            for name, shape in group:
                _fill(f, esize * _numel(shape), f"{spec.seed}:{name}".encode())
                weight_map[name] = fname
        paths.append(path)
    if spec.shards > 1:
        p = os.path.join(directory, "model.safetensors.index.json")
        with open(p, "w") as f:
            json.dump(
                {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
                f,
                indent=2,
            )
        paths.append(p)
    if extra_files:
        cfg = hf_config(spec)
        for name, content in (
            ("config.json", json.dumps(cfg, indent=2, sort_keys=True) + "\n"),
            ("generation_config.json", json.dumps({"bos_token_id": 1, "eos_token_id": 2}) + "\n"),
            ("tokenizer_config.json", json.dumps({"model_max_length": 2048}) + "\n"),
            (
                "README.md",
                "# synthetic-llama\n\nGenerated by modelpack.testdata.synthetic for tests and demos.\n",
            ),
        ):
            p = os.path.join(directory, name)
            with open(p, "w") as f:
                f.write(content)
            paths.append(p)
    return sorted(paths)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
