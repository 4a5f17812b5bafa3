"""The node facts and ``--variant`` choices of an engine start, from its environment.

The KServe initializer and the vLLM load format pick an entry of an index of variants with the
same ``VariantSelector`` as ``pull`` and ``load`` (``modelpack.oci.variant_selection``); these are
the settings they read it from:

``MODELPACK_VARIANT``
    ``KEY=VALUE`` pairs separated by commas (``precision=bf16,engine=vllm``), as ``--variant``.
``MODELPACK_TP_SIZE``
    the tensor-parallel size to select for (vLLM's own ``tensor_parallel_size`` wins there).
``MODELPACK_ENGINE``
    the engine name (the vLLM load format always says ``vllm``).
``MODELPACK_ACCELERATOR``
    the device arch to select for (``cuda-sm_90``…). Without it the arch is computed as
    ``loader.fingerprint.device_arch`` does, for the first CUDA device or the CPU — which, in an
    init container that sees no GPU, is the CPU: set it there (per node pool), or name the
    variant.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from modelpack import settings
from modelpack.oci.variant_selection import VariantSelector


def detected_accelerator() -> Callable[[], str]:
    """This process's device arch, computed on first use (torch is imported only then)."""

    def compute() -> str:
        import torch

        from modelpack.loader.fingerprint import device_arch

        return device_arch("cuda:0" if torch.cuda.is_available() else "cpu")

    return compute


def selector_from_environ(
    env: Mapping[str, str] | None = None, *, tp_size: int | None = None, engine: str | None = None
) -> VariantSelector:
    """The selector these settings describe; ``tp_size``/``engine`` (what the engine itself says)
    override the environment's."""
    if tp_size is None:
        tp_size = settings.TP_SIZE.get(env)
    accelerator: str | Callable[[], str] = settings.ACCELERATOR.get(env) or detected_accelerator()
    return VariantSelector.from_options(
        list(settings.VARIANT.get(env)),
        accelerator=accelerator,
        tp_size=tp_size,
        engine=engine or settings.ENGINE.get(env),
    )
