"""vLLM's ``sharded_state`` layout through the ``modelpack`` load format: rank tensors into parameters.

A sharded_state rank file holds that rank's parameters under vLLM's own names (``qkv_proj``,
``gate_up_proj``), already split, so they are not checkpoint tensors for ``model.load_weights``:
vLLM's ``ShardedStateLoader`` copies each one into the matching entry of the model's state dict
(narrowed where vLLM padded a parameter, e.g. for LoRA). ``copy_into_state`` does the same with
tensors the loader verified, and is stricter where vLLM would go on: a tensor that names no
parameter, a shape larger than its parameter, or a parameter no rank file filled is a
``ServingError`` before the engine serves (vLLM's own loader raises a ``KeyError`` or, for a missing
parameter, a ``ValueError`` after copying the rest).

``check_layout_before_start`` runs from the plugin's config hook (``vllm_plugin.py``): a snapshot of
the other layout, or split for another TP size, is refused before vLLM starts its workers.

Kept free of vLLM imports (``vllm_loader.py`` hands in the state dict, filtered by vLLM's own
``ShardedStateLoader._filter_subtensors``; the plugin hands in the TP size), so it is tested
without vLLM.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, MutableMapping
from typing import Any

import torch

from modelpack.errors import ModelpackError, ServingConfigError, ServingError
from modelpack.events import EventLog


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


def check_layout_before_start(
    model_dir: str,
    extra_config: Mapping[str, Any] | str | None,
    *,
    tp_size: int,
    environ: Mapping[str, str] | None = None,
) -> None:
    """For a node-cache snapshot: refuse, when vLLM builds its config (before any worker starts),
    a layout other than the extra config's ``layout`` or a sharded_state split for another TP size,
    with the same checks each rank runs again before reading (``loader/sharded_state.py``).

    A streamed ``source`` (whose pin may name an index resolved with the engine's TP size) and an
    image volume (``trust: runtime``) are left to the rank load. Writes ``serving.refused`` with
    ``stage: config`` to the start's event log before raising.
    """
    from modelpack.loader import snapshot_binding
    from modelpack.loader.sharded_state import select_rank_files
    from modelpack.loader.weight_files import ResolvedSource, WeightFile, weight_layers
    from modelpack.serving.settings import ServingSettings

    env = os.environ if environ is None else environ
    if isinstance(extra_config, str):
        try:
            extra_config = json.loads(extra_config) if extra_config.strip() else {}
        except ValueError as exc:
            raise ServingConfigError(f"--model-loader-extra-config: not JSON: {exc}") from exc
    if extra_config is not None and not isinstance(extra_config, Mapping):
        raise ServingConfigError("--model-loader-extra-config must be a JSON object")
    settings = ServingSettings.from_extra_config(extra_config, env)
    if settings.source or settings.trust == "runtime":
        return
    found = snapshot_binding.claim(os.path.realpath(model_dir))
    if found is None:
        return  # the directory check refuses it, naming why
    try:
        manifest = snapshot_binding.pinned_manifest(found)

        def never() -> Any:  # pragma: no cover - nothing is read at config time
            raise AssertionError("no file is opened by the config-time layout check")

        files = [
            WeightFile(rel, layer.size, never, "trusted", descriptor=layer)
            for rel, layer in weight_layers(manifest, found.path, from_cache=True)
        ]
        src = ResolvedSource(found.path, found.digest, manifest, files, False, "none", "hit")
        select_rank_files(src, settings.layout, tp_size, 0)
    except ModelpackError as exc:
        if settings.events:
            EventLog(settings.events).emit(
                "serving.refused",
                start_id=settings.start_id,
                stage="config",
                reference=model_dir,
                digest=found.digest,
                reason=f"{type(exc).__name__}: {exc}"[:2000],
            )
        raise


__all__ = ["check_layout_before_start", "copy_into_state"]
