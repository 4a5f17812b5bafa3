"""vLLM plugin entry point: registers the ``modelpack`` load format in each vLLM process."""

from __future__ import annotations

import os
import uuid


def register() -> None:
    """Run by vLLM in every process (API server first, then engine core and workers).

    The first process fixes this start's t0 and start id in the environment, which the engine core
    and the TP workers inherit, so every rank's events fall into one start in ``modelpack
    timeline``. ``$MODELPACK_T0`` / ``$MODELPACK_START_ID`` set by the caller (a pod's creation
    time, a benchmark's launch time) win.
    """
    from modelpack.serving.weights import process_start_time

    os.environ.setdefault("MODELPACK_T0", f"{process_start_time():.6f}")
    os.environ.setdefault("MODELPACK_START_ID", uuid.uuid4().hex)
    from modelpack.serving import vllm_loader  # noqa: F401  (the decorator registers the format)
