"""Which checkpoint tensors a vLLM tensor-parallel rank may read in part, and along which dimension.

The `modelpack` load format hands vLLM full-shape tensors in which only this rank's slice was read
(see ``full_shape.py``); vLLM's weight loaders then ``narrow`` that slice out. That is exact only
where the slice read equals the slice vLLM narrows, so a rule here says ``dim0`` / ``dim1`` only
where vLLM's parallel layers split a tensor evenly along that dimension, and ``replicate`` (read the
whole tensor; vLLM narrows it as with its own loader) everywhere else. A wrong ``replicate`` costs
bytes; a wrong ``dim0`` would serve garbage, so unknown architectures read everything.

Known exceptions that force ``replicate`` on an otherwise sharded tensor:

- k_proj / v_proj when the KV heads do not split over the ranks (vLLM replicates heads then, and a
  rank narrows ``rank // replicas``, not ``rank``);
- embed_tokens / lm_head when vLLM pads the vocabulary (its shard boundaries then sit on multiples
  of the padded size, not of the vocabulary);
- already fused checkpoint tensors (qkv_proj, gate_up_proj): vLLM splits them into q/k/v (gate/up)
  parts first and narrows each part, which no single contiguous range describes;
- a mixture-of-experts model's routed experts when their intermediate size does not divide by the
  ranks (vLLM 0.32's ``FusedMoEConfig`` asserts that it does and does not start otherwise; reading
  them whole keeps a later vLLM that pads the last rank's share correct). Without expert
  parallelism vLLM's ``FusedMoE`` narrows each expert as a dense MLP, by ``tp_rank`` in even shares
  (``RoutedExperts._load_w13`` / ``_load_w2``): gate and up along their rows, down along its
  columns. The Llama rules cover Qwen2-MoE's and Qwen3-MoE's ``experts.{i}.{gate,up,down}_proj``;
  Mixtral's ``experts.{i}.w1`` (gate) / ``w3`` (up) / ``w2`` (down) have rules of their own. With
  expert parallelism, experts are whole on the rank vLLM's map gives them, which the loader's
  expert layout says (``weights.py``), and the expert rules come before these.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from modelpack.loader import ShardRule
from modelpack.loader.experts import weight_block_size_of
from modelpack.loader.tp_rules import MIXTRAL_EXPERT_COLUMN, MIXTRAL_EXPERT_ROW

# vLLM pads vocabularies to a multiple of this (vllm.model_executor.layers.vocab_parallel_embedding)
VLLM_VOCAB_PADDING = 64

# Architectures whose vLLM model classes use the Llama layer layout: q/k/v and gate/up as
# QKVParallelLinear / MergedColumnParallelLinear over separate checkpoint tensors, o_proj/down_proj
# as RowParallelLinear, VocabParallelEmbedding / ParallelLMHead. Checked against vLLM 0.32.
LLAMA_LAYOUT_ARCHITECTURES = frozenset(
    {
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
    }
)
# Mixture-of-experts architectures with that layout around the experts (vLLM's FusedMoE, without
# expert parallelism), and the config key of their routed experts' intermediate size:
# - Qwen2-MoE and Qwen3-MoE: ``…mlp.experts.{i}.{gate,up,down}_proj``; the router ``mlp.gate`` and
#   Qwen2-MoE's shared expert gate are replicated, its shared expert is a Llama MLP; Qwen3-MoE's
#   per-head q_norm / k_norm are replicated;
# - Mixtral: ``…block_sparse_moe.experts.{i}.{w1,w2,w3}`` (gate, down, up), the router
#   ``block_sparse_moe.gate`` replicated; its experts are sized by ``intermediate_size``.
# Checked against vLLM 0.32 (tests/serving/test_vllm_tp2.py).
MOE_ARCHITECTURES: Mapping[str, str] = MappingProxyType(
    {
        "Qwen2MoeForCausalLM": "moe_intermediate_size",
        "Qwen3MoeForCausalLM": "moe_intermediate_size",
        "MixtralForCausalLM": "intermediate_size",
    }
)

_COLUMN = r"(^|\.)(q_proj|gate_proj|up_proj)\.weight$"
_KV = r"(^|\.)(k_proj|v_proj)\.weight$"
_ROW = r"(^|\.)(o_proj|down_proj)\.weight$"
_VOCAB = r"(^|\.)(embed_tokens|lm_head)\.weight$"
_ROUTED_EXPERT = r"(^|\.)experts\.\d+\."


def vllm_shard_rules(hf_config: Any, tp_size: int) -> tuple[list[tuple[str, ShardRule]], str]:
    """(rules for ``ReadPlan.build(..., presets=False)``, why) for one model under vLLM TP.

    ``hf_config`` is a transformers config object or its ``config.json`` as a mapping. With
    ``tp_size == 1`` or an architecture not known here, every tensor is replicated.
    """
    cfg = _as_mapping(hf_config)
    if tp_size <= 1:
        return [], "tp_size 1: every tensor is read whole"
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in LLAMA_LAYOUT_ARCHITECTURES or a in MOE_ARCHITECTURES), None)
    if arch is None:
        return [], (
            f"architecture {archs or 'unknown'} is not one whose vLLM sharding modelpack knows; "
            "every tensor is read whole (pass shard_rules to read less)"
        )
    rules: list[tuple[str, ShardRule]] = []
    notes = [arch]
    if arch in MOE_ARCHITECTURES:
        moe = _int(cfg, MOE_ARCHITECTURES[arch])
        whole = _experts_read_whole(cfg, moe, tp_size)
        if whole:
            rules.append((_ROUTED_EXPERT, ShardRule.REPLICATE))
            notes.append(whole)
        elif arch == "MixtralForCausalLM":  # vLLM's MixtralMoE: ckpt_names=("w1", "w2", "w3")
            rules += [(MIXTRAL_EXPERT_COLUMN, ShardRule.DIM0), (MIXTRAL_EXPERT_ROW, ShardRule.DIM1)]
    rules += [(_COLUMN, ShardRule.DIM0), (_ROW, ShardRule.DIM1)]
    heads = _int(cfg, "num_attention_heads")
    kv_heads = _int(cfg, "num_key_value_heads") or heads
    if kv_heads and kv_heads % tp_size == 0:
        rules.append((_KV, ShardRule.DIM0))
    else:
        notes.append(f"{kv_heads} KV heads do not split over {tp_size} ranks: k/v read whole")
    vocab = _int(cfg, "vocab_size")
    if vocab and vocab % VLLM_VOCAB_PADDING == 0 and vocab % tp_size == 0:
        rules.append((_VOCAB, ShardRule.DIM0))
    else:
        notes.append(f"vocabulary {vocab} is padded by vLLM: embeddings read whole")
    return rules, "; ".join(notes)


def _experts_read_whole(cfg: Mapping[str, Any], moe: int, tp_size: int) -> str:
    """Why the routed experts must be read whole under vLLM's TP ("" when they split as vLLM
    narrows them: ``rank * moe / tp_size``, evenly)."""
    if not moe or moe % tp_size:
        return f"expert intermediate size {moe} does not split over {tp_size} ranks: experts read whole"
    qc = cfg.get("quantization_config")
    declared = isinstance(qc, Mapping) and qc.get("weight_block_size") is not None
    block = weight_block_size_of(cfg)
    if declared and block is None:
        return "quantization_config.weight_block_size is not two positive integers: experts read whole"
    if block is not None and (moe // tp_size) % block[0]:
        # vLLM 0.32 refines the block or pads each rank's share to whole blocks
        # (fused_moe/oracle/fp8.py, pad_tp_shard_to_weight_blocks) and narrows at
        # rank * round_up(moe / tp_size, block), not at rank * moe / tp_size
        return (
            f"expert intermediate size {moe} splits into {moe // tp_size} rows per rank, not whole "
            f"FP8 blocks of {block[0]} (vLLM pads or refines them): experts read whole"
        )
    return ""


def _as_mapping(hf_config: Any) -> Mapping[str, Any]:
    if isinstance(hf_config, Mapping):
        return hf_config
    to_dict = getattr(hf_config, "to_dict", None)
    if callable(to_dict):
        doc = to_dict()
        if isinstance(doc, Mapping):
            return doc
    return vars(hf_config) if hasattr(hf_config, "__dict__") else {}


def _int(cfg: Mapping[str, Any], key: str) -> int:
    value = cfg.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else 0
