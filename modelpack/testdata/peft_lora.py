"""A PEFT-format LoRA adapter for a Llama-shaped model, generated (no ``peft`` needed, nothing downloaded).

The files are what ``PeftModel.save_pretrained`` writes for ``LoraConfig(r, lora_alpha,
target_modules=["q_proj", "v_proj"])``: ``adapter_config.json`` and ``adapter_model.safetensors``
with tensors ``base_model.model.model.layers.<i>.self_attn.<m>.lora_A.weight`` (``[r, in]``) and
``…lora_B.weight`` (``[out, r]``). A non-zero ``lora_B`` changes the model: the effective weight
is ``W + (lora_alpha / r) · B @ A``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any


def lora_tensor_shapes(model_config: Mapping[str, Any], rank: int) -> dict[str, tuple[int, int]]:
    hidden = int(model_config["hidden_size"])
    heads = int(model_config["num_attention_heads"])
    kv_heads = int(model_config.get("num_key_value_heads", heads))
    head_dim = int(model_config.get("head_dim", hidden // heads))
    outs = {"q_proj": heads * head_dim, "v_proj": kv_heads * head_dim}
    shapes: dict[str, tuple[int, int]] = {}
    for i in range(int(model_config["num_hidden_layers"])):
        for module, out in outs.items():
            prefix = f"base_model.model.model.layers.{i}.self_attn.{module}"
            shapes[prefix + ".lora_A.weight"] = (rank, hidden)
            shapes[prefix + ".lora_B.weight"] = (out, rank)
    return shapes


def write_lora_adapter(
    directory: str,
    model_config: Mapping[str, Any],
    *,
    rank: int = 8,
    alpha: int = 16,
    seed: int = 1,
    scale: float = 0.5,
    base_model_name_or_path: str = "tiny-llama",
) -> str:
    """Write a float32 LoRA adapter for ``model_config`` (a Llama ``config.json``) into ``directory``."""
    import numpy as np
    from safetensors.numpy import save_file

    os.makedirs(directory, exist_ok=True)
    rng = np.random.default_rng(seed)
    tensors = {
        name: (rng.standard_normal(shape) * scale).astype(np.float32)
        for name, shape in lora_tensor_shapes(model_config, rank).items()
    }
    save_file(tensors, os.path.join(directory, "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": ["q_proj", "v_proj"],
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "modules_to_save": None,
        "base_model_name_or_path": base_model_name_or_path,
    }
    with open(os.path.join(directory, "adapter_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    return directory
