"""vLLM plugin entry point: registers the ``modelpack`` load format in each vLLM process, and
checks ``--model`` before vLLM reads anything from it."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

LOAD_FORMAT = "modelpack"
_GUARDED = "_modelpack_checks_model_dir"


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
