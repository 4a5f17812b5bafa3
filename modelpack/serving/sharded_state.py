"""vLLM's ``sharded_state`` layout through the ``modelpack`` load format: rank tensors into parameters.

A sharded_state rank file holds that rank's parameters under vLLM's own names (``qkv_proj``,
``gate_up_proj``), already split, so they are not checkpoint tensors for ``model.load_weights``:
vLLM's ``ShardedStateLoader`` copies each one into the matching entry of the model's state dict
(narrowed where vLLM padded a parameter, e.g. for LoRA). ``copy_into_state`` does the same with
tensors the loader verified, and is stricter where vLLM would go on: a tensor that names no
parameter, a shape larger than its parameter, or a parameter no rank file filled is a
``ServingError`` before the engine serves (vLLM's own loader raises a ``KeyError`` or, for a missing
parameter, a ``ValueError`` after copying the rest).

Kept free of vLLM imports (``vllm_loader.py`` hands in the state dict, filtered by vLLM's own
``ShardedStateLoader._filter_subtensors``), so it is tested without vLLM.
"""

from __future__ import annotations

from collections.abc import Iterable, MutableMapping

import torch

from modelpack.errors import ServingError


def copy_into_state(
    state: MutableMapping[str, torch.Tensor], tensors: Iterable[tuple[str, torch.Tensor]], *, where: str
) -> list[str]:
    """Copy each ``(name, tensor)`` into ``state[name]`` (consumed as filled); the names copied.

    ``state`` is the model's state dict with aliases removed, as vLLM's sharded_state loader builds
    it; everything in it must be filled exactly once.
    """
    copied: list[str] = []
    seen: set[str] = set()
    for name, tensor in tensors:
        param = state.pop(name, None)
        if param is None:
            what = "was filled twice" if name in seen else "is not a parameter of the model vLLM built"
            raise ServingError(f"{where}: sharded_state tensor {name!r} {what}; refusing the load")
        data = param.data
        if tensor.dim() != data.dim():
            raise ServingError(
                f"{where}: sharded_state tensor {name!r} has shape {tuple(tensor.shape)}, the parameter "
                f"{tuple(data.shape)}; refusing the load"
            )
        for dim, size in enumerate(tensor.shape):
            if size > data.shape[dim]:
                raise ServingError(
                    f"{where}: sharded_state tensor {name!r} has shape {tuple(tensor.shape)}, larger than "
                    f"the parameter {tuple(data.shape)} (saved for another model or TP size); refusing the load"
                )
            if size < data.shape[dim]:  # vLLM padded the parameter: fill the leading part, as vLLM does
                data = data.narrow(dim, 0, size)
        data.copy_(tensor)
        copied.append(name)
        seen.add(name)
    if state:
        missing = sorted(state)
        raise ServingError(
            f"{where}: parameters no sharded_state file of this rank holds: {missing[:20]}; refusing the load"
        )
    return copied


__all__ = ["copy_into_state"]
