"""The vLLM load format ``modelpack``: each rank's weights through modelpack's verified loader.

``vllm serve DIR --load-format modelpack --model-loader-extra-config '{…}'`` (keys in
``settings.py``). Registered with vLLM by ``vllm_plugin.register`` (entry point group
``vllm.general_plugins``), which vLLM runs in every process, so the format exists wherever a
worker resolves ``--load-format``. This module is the only place besides the plugin that imports
vLLM; the checks and the streaming live in ``weights.py``.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn
from vllm.config import CompilationMode, ModelConfig, ParallelConfig, VllmConfig
from vllm.config.load import LoadConfig
from vllm.distributed import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    get_tp_group,
)
from vllm.model_executor.model_loader import register_model_loader
from vllm.model_executor.model_loader.base_loader import BaseModelLoader

from modelpack.errors import ServingError
from modelpack.serving.weights import EngineExperts, RankLoad, open_rank_load

LOAD_FORMAT = "modelpack"


@register_model_loader(LOAD_FORMAT)
class ModelpackModelLoader(BaseModelLoader):
    """Reads only this TP rank's slice of each tensor, verified, and hands vLLM full shapes."""

    def __init__(self, load_config: LoadConfig) -> None:
        super().__init__(load_config)
        extra = load_config.model_loader_extra_config
        self.extra_config: dict[str, Any] = dict(extra) if isinstance(extra, dict) else {}
        self.rank: RankLoad | None = None
        self.parallel: ParallelConfig | None = None

    def load_model(self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str = "") -> nn.Module:
        """vLLM's load (create the model, ``load_weights``, post-process), then, with ``assets``
        set and compilation on, the compile cache for this load before vLLM compiles."""
        self.parallel = vllm_config.parallel_config  # load_weights needs its expert parallelism
        model = super().load_model(vllm_config, model_config, prefix)
        rank = self.rank
        if rank is not None and rank.settings.assets is not None:
            _compile_assets(model, rank, vllm_config, model_config)
        return model

    def download_model(self, model_config: ModelConfig) -> None:
        """Nothing to download ahead: the weights are read (and verified) in ``load_weights``."""

    @torch.no_grad()
    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        tp_size = get_tensor_model_parallel_world_size()
        tp_rank = get_tensor_model_parallel_rank()
        rank = open_rank_load(
            self.extra_config,
            model_config.model,
            model_config.hf_config,
            tp_size,
            tp_rank,
            experts=_engine_experts(self.parallel, tp_size, tp_rank),
        )
        # the TP ranks share chunk-verified reads over vLLM's own gloo group (each chunk read once)
        rank.group = get_tp_group().cpu_group if tp_size > 1 else None
        self.rank = rank
        try:
            if rank.settings.layout == "sharded_state":
                _load_sharded_state(model, rank, model_config.model)
                rank.events.emit("serving.weights_loaded", **rank.summary())
                return
            # every vLLM model class has load_weights(iterable of (name, tensor)) -> loaded names;
            # unquantized, whole tensors are read straight into the parameters it copies them to
            # (found by a dry run of that load_weights before any byte is read)
            tensors = rank.tensors(model if model_config.quantization is None else None)
            loaded = cast(Any, model).load_weights(tensors)
        except BaseException as exc:
            rank.events.emit(
                "serving.failed",
                start_id=rank.start_id,
                tp_rank=tp_rank,
                reason=f"{type(exc).__name__}: {exc}"[:2000],
            )
            raise
        if model_config.quantization is None and loaded is not None:
            missing = {name for name, _ in model.named_parameters()} - set(loaded)
            if missing:
                reason = f"parameters not in the checkpoint: {sorted(missing)[:20]}"
                rank.events.emit("serving.failed", start_id=rank.start_id, tp_rank=tp_rank, reason=reason)
                raise ServingError(f"{model_config.model}: {reason}")
        rank.events.emit("serving.weights_loaded", **rank.summary())


def _engine_experts(parallel: ParallelConfig | None, tp_size: int, tp_rank: int) -> EngineExperts | None:
    """vLLM's expert parallelism for this worker, as its ``FusedMoE`` layers compute it: EP spans
    the data- and context-parallel replicas × TP, this worker's EP rank is its flattened rank
    (``FusedMoEParallelConfig.flatten_tp_across_dp_and_pcp``)."""
    if parallel is None:
        return None
    from vllm.distributed.parallel_state import get_dp_group, get_pcp_group

    dp = int(getattr(parallel, "data_parallel_size", 1) or 1)
    pcp = int(getattr(parallel, "prefill_context_parallel_size", 1) or 1)
    dp_rank = get_dp_group().rank_in_group if dp > 1 else 0
    pcp_rank = get_pcp_group().rank_in_group if pcp > 1 else 0
    return EngineExperts(
        enabled=bool(parallel.enable_expert_parallel),
        ep_size=dp * pcp * tp_size,
        ep_rank=dp_rank * pcp * tp_size + pcp_rank * tp_size + tp_rank,
        placement=str(parallel.expert_placement_strategy),
        eplb=bool(parallel.enable_eplb),
        replicas=dp * pcp,
    )


def _load_sharded_state(model: nn.Module, rank: RankLoad, where: str) -> None:
    """This rank's sharded_state tensors into the model's parameters, as vLLM's ShardedStateLoader
    does (same alias filtering), each verified by modelpack's loader before it is copied."""
    from vllm.model_executor.model_loader.sharded_state_loader import ShardedStateLoader

    from modelpack.serving.sharded_state import copy_into_state

    state = ShardedStateLoader._filter_subtensors(model.state_dict())
    copy_into_state(state, rank.tensors(), where=where)


def _compile_assets(
    model: nn.Module, rank: RankLoad, vllm_config: VllmConfig, model_config: ModelConfig
) -> None:
    """Fetch the ``vllm`` asset into the directory vLLM's compile cache reads, and time t6."""
    import vllm.envs as envs

    from modelpack.serving.compile_assets import fetch_compile_cache, time_first_forward

    mode = vllm_config.compilation_config.mode
    if model_config.enforce_eager or mode == CompilationMode.NONE:
        rank.events.emit(
            "assets.skipped",
            start_id=rank.start_id,
            tp_rank=rank.tp_rank,
            kind=rank.settings.assets.kind if rank.settings.assets else "vllm",
            reason="vLLM compiles nothing in this start (enforce_eager, or compilation mode NONE)",
        )
        return
    param = next(iter(model.parameters()), None)
    cache = fetch_compile_cache(
        rank,
        cache_root=envs.VLLM_CACHE_ROOT,
        device=param.device if param is not None else "cpu",
        dtype=str(model_config.dtype),
        quantization=model_config.quantization,
    )
    time_first_forward(model, rank, cache.state)
