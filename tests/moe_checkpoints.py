"""Tiny mixture-of-experts checkpoints in the common layouts, for the expert-parallel tests.

``write_moe(dir, naming, ...)`` writes safetensors shards (one per layer, plus one for the
embeddings) and a ``config.json`` the way the named family spells them:

- ``deepseek``: ``mlp.experts.{i}.{gate,up,down}_proj``, ``mlp.shared_experts.*``, router
  ``mlp.gate.weight`` + ``mlp.gate.e_score_correction_bias``; ``n_routed_experts``. With
  ``fp8=True`` the projections are ``F8_E4M3`` with block-wise ``weight_scale_inv`` (block
  ``BLOCK``×``BLOCK``, ``quantization_config.weight_block_size``);
- ``mixtral``: ``block_sparse_moe.experts.{i}.w{1,2,3}``, router ``block_sparse_moe.gate``;
  ``num_local_experts``;
- ``stacked``: fused 3-D experts whose first dimension is the expert
  (``mlp.experts.gate_up_proj`` [E, H, 2I], ``mlp.experts.down_proj`` [E, I, H]), a Qwen2-MoE
  shared expert (``mlp.shared_expert.*``, ``mlp.shared_expert_gate``), router ``mlp.gate``;
  ``num_experts``. With ``fp8=True`` the stacked weights carry stacked block scales
  (``…_scale_inv`` [E, H/BLOCK, 2I/BLOCK]).
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

BLOCK = 16
CONFIG_KEY = {"deepseek": "n_routed_experts", "mixtral": "num_local_experts", "stacked": "num_experts"}


def _proj(
    g: torch.Generator, out: int, inp: int, fp8: bool, name: str, into: dict[str, torch.Tensor]
) -> None:
    w = torch.randn(out, inp, generator=g)
    if fp8:
        into[name + ".weight"] = w.to(torch.float8_e4m3fn)
        into[name + ".weight_scale_inv"] = torch.rand(-(-out // BLOCK), -(-inp // BLOCK), generator=g)
    else:
        into[name + ".weight"] = w.to(torch.bfloat16)


def write_moe(
    root: Path,
    naming: str,
    *,
    experts: int = 8,
    layers: int = 2,
    hidden: int = 64,
    inter: int = 96,
    vocab: int = 128,
    fp8: bool = False,
    seed: int = 0,
) -> Path:
    """Write the checkpoint into ``root`` (created) and return it."""
    g = torch.Generator().manual_seed(seed)
    root.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = []
    outer: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": torch.randn(vocab, hidden, generator=g).to(torch.bfloat16),
        "model.norm.weight": torch.randn(hidden, generator=g).to(torch.bfloat16),
        "lm_head.weight": torch.randn(vocab, hidden, generator=g).to(torch.bfloat16),
    }
    shards.append(outer)
    for layer in range(layers):
        p = f"model.layers.{layer}."
        t: dict[str, torch.Tensor] = {
            p + "input_layernorm.weight": torch.randn(hidden, generator=g).bfloat16()
        }
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            _proj(g, hidden, hidden, fp8, p + "self_attn." + proj, t)
        if naming == "deepseek":
            t[p + "mlp.gate.weight"] = torch.randn(experts, hidden, generator=g).bfloat16()
            t[p + "mlp.gate.e_score_correction_bias"] = torch.randn(experts, generator=g)
            for i in range(experts):
                e = p + f"mlp.experts.{i}."
                _proj(g, inter, hidden, fp8, e + "gate_proj", t)
                _proj(g, inter, hidden, fp8, e + "up_proj", t)
                _proj(g, hidden, inter, fp8, e + "down_proj", t)
            for proj, (o, i_) in (
                ("gate_proj", (inter, hidden)),
                ("up_proj", (inter, hidden)),
                ("down_proj", (hidden, inter)),
            ):
                _proj(g, o, i_, fp8, p + "mlp.shared_experts." + proj, t)
        elif naming == "mixtral":
            t[p + "block_sparse_moe.gate.weight"] = torch.randn(experts, hidden, generator=g).bfloat16()
            for i in range(experts):
                e = p + f"block_sparse_moe.experts.{i}."
                _proj(g, inter, hidden, fp8, e + "w1", t)
                _proj(g, hidden, inter, fp8, e + "w2", t)
                _proj(g, inter, hidden, fp8, e + "w3", t)
        elif naming == "stacked":
            t[p + "mlp.gate.weight"] = torch.randn(experts, hidden, generator=g).bfloat16()
            gu = torch.randn(experts, hidden, 2 * inter, generator=g)
            dn = torch.randn(experts, inter, hidden, generator=g)
            if fp8:
                t[p + "mlp.experts.gate_up_proj"] = gu.to(torch.float8_e4m3fn)
                t[p + "mlp.experts.gate_up_proj_scale_inv"] = torch.rand(
                    experts, hidden // BLOCK, 2 * inter // BLOCK, generator=g
                )
                t[p + "mlp.experts.down_proj"] = dn.to(torch.float8_e4m3fn)
                t[p + "mlp.experts.down_proj_scale_inv"] = torch.rand(
                    experts, inter // BLOCK, hidden // BLOCK, generator=g
                )
            else:
                t[p + "mlp.experts.gate_up_proj"] = gu.bfloat16()
                t[p + "mlp.experts.down_proj"] = dn.bfloat16()
            for proj, (o, i_) in (
                ("gate_proj", (inter, hidden)),
                ("up_proj", (inter, hidden)),
                ("down_proj", (hidden, inter)),
            ):
                _proj(g, o, i_, fp8, p + "mlp.shared_expert." + proj, t)
            t[p + "mlp.shared_expert_gate.weight"] = torch.randn(1, hidden, generator=g).bfloat16()
        else:
            raise ValueError(naming)
        shards.append(t)
    n = len(shards)
    for k, tensors in enumerate(shards):
        save_file(tensors, str(root / f"model-{k + 1:05d}-of-{n:05d}.safetensors"), metadata={"format": "pt"})
    config: dict[str, object] = {
        "model_type": {"deepseek": "deepseek_v3", "mixtral": "mixtral", "stacked": "qwen2_moe"}[naming],
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        CONFIG_KEY[naming]: experts,
    }
    if fp8:
        config["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "weight_block_size": [BLOCK, BLOCK],
        }
    (root / "config.json").write_text(json.dumps(config))
    return root


def expert_of(name: str) -> int | None:
    """The routed expert a per-expert tensor belongs to (None: not a per-expert tensor)."""
    parts = name.split(".")
    for a, b in itertools.pairwise(parts):
        if a == "experts" and b.isdigit():
            return int(b)
    return None


def is_stacked(name: str) -> bool:
    return ".experts." in name and expert_of(name) is None


def linear_experts(experts: int, ep: int, rank: int) -> list[int]:
    """vLLM's linear placement: rank r holds experts [r*E/ep, (r+1)*E/ep)."""
    per = experts // ep
    return list(range(rank * per, (rank + 1) * per))
