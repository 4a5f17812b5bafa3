"""vLLM plugin entry point: registers the ``modelpack`` load format in each vLLM process, checks
``--model`` before vLLM reads anything from it, and, in the OpenAI server, holds the node cache's
reader lease on every LoRA adapter snapshot it serves (``serving.adapter_leases``)."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, Protocol

LOAD_FORMAT = "modelpack"
_GUARDED = "_modelpack_checks_model_dir"
_LEASING = "_modelpack_leases_adapters"
#: where vLLM's OpenAI server keeps the adapters it serves (imported by the server's entry point
#: before it builds any engine arguments, so before ``register`` runs in that process)
_SERVING_MODELS = "vllm.entrypoints.openai.models.serving"


def register() -> None:
    """Run by vLLM in every process (API server first, then engine core and workers).

    The first process fixes this start's t0 and start id in the environment, which the engine core
    and the TP workers inherit, so every rank's events fall into one start in ``modelpack
    timeline``. ``$MODELPACK_T0`` / ``$MODELPACK_START_ID`` set by the caller (a pod's creation
    time, a benchmark's launch time) win.

    vLLM runs this from ``EngineArgs.__post_init__``, before it builds its config; the plugin then
    wraps ``EngineArgs.create_engine_config`` and ``create_model_config`` (where vLLM first reads
    ``config.json``, imports ``trust_remote_code`` modules and finds the tokenizer) so that, for
    ``--load-format modelpack``, the whole ``--model`` directory is checked against the pinned
    artifact first (``model_dir.check_before_vllm_reads``).
    """
    from modelpack.serving.weights import process_start_time
    from modelpack.settings import resolve_start_id, share_with_child_processes

    share_with_child_processes(t0=process_start_time(), start_id=resolve_start_id())
    guard_model_directory()
    lease_served_adapters()
    from modelpack.serving import vllm_loader  # noqa: F401  (the decorator registers the format)


def _checked_first(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        if str(getattr(self, "load_format", "")) == LOAD_FORMAT and not getattr(self, _GUARDED, False):
            from modelpack.serving.model_dir import check_before_vllm_reads

            check_before_vllm_reads(
                str(self.model),
                getattr(self, "model_loader_extra_config", None),
                tokenizer=getattr(self, "tokenizer", None),
                hf_config_path=getattr(self, "hf_config_path", None),
            )
            from modelpack.serving.sharded_state import check_layout_before_start

            check_layout_before_start(
                str(self.model),
                getattr(self, "model_loader_extra_config", None),
                tp_size=int(getattr(self, "tensor_parallel_size", 1) or 1),
            )
            setattr(self, _GUARDED, True)  # checked once per EngineArgs
        lease_served_adapters()  # the server's modules are imported by now, whichever way it started
        return original(self, *args, **kwargs)

    setattr(wrapper, _GUARDED, True)
    return wrapper


def guard_model_directory() -> None:
    """Wrap vLLM's config builders once per process (idempotent)."""
    from vllm.engine.arg_utils import EngineArgs

    for name in ("create_engine_config", "create_model_config"):
        current = getattr(EngineArgs, name)
        if not getattr(current, _GUARDED, False):
            setattr(EngineArgs, name, _checked_first(current))


def lease_served_adapters() -> None:
    """In vLLM's OpenAI server process (idempotent; nothing elsewhere): each adapter it loads
    whose path is a node-cache snapshot holds that snapshot's reader lease for as long as the
    server serves it, so ``cache gc`` cannot remove it from under the engine, which reads its
    files again whenever it reloads it. A snapshot that is gone fails the load (at start: the
    start); a reload from another snapshot releases the old lease once vLLM serves the new one;
    an unload releases it; the process's end releases all of them."""
    models = getattr(sys.modules.get(_SERVING_MODELS), "OpenAIServingModels", None)
    if models is None or getattr(models.load_lora_adapter, _LEASING, False):
        return
    models.load_lora_adapter = _leased_while_served(models.load_lora_adapter)
    models.unload_lora_adapter = _released_on_unload(models.unload_lora_adapter)


class _AdapterRequest(Protocol):
    """What vLLM's load/unload adapter requests carry that the leases need."""

    lora_name: str
    lora_path: str


def _leased_while_served(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    async def wrapper(self: object, request: _AdapterRequest, *args: Any, **kwargs: Any) -> Any:
        from modelpack.serving.adapter_leases import ENGINE_ADAPTER_LEASES as leases

        name = str(request.lora_name)
        before = leases.held().get(name, [])
        digest = leases.take(name, str(request.lora_path))  # before vLLM reads a file of it
        try:
            result = await original(self, request, *args, **kwargs)
        except BaseException:
            if digest is not None and digest not in before:
                leases.release(name, digest)
            raise
        if isinstance(result, str):  # vLLM's "Success: …"; an ErrorResponse otherwise
            leases.keep_only(name, digest)
        elif digest is not None and digest not in before:
            leases.release(name, digest)
        return result

    setattr(wrapper, _LEASING, True)
    return wrapper


def _released_on_unload(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    async def wrapper(self: object, request: _AdapterRequest, *args: Any, **kwargs: Any) -> Any:
        result = await original(self, request, *args, **kwargs)
        if isinstance(result, str):
            from modelpack.serving.adapter_leases import ENGINE_ADAPTER_LEASES

            ENGINE_ADAPTER_LEASES.release(str(request.lora_name))
        return result

    setattr(wrapper, _LEASING, True)
    return wrapper
