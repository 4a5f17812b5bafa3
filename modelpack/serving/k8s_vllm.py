"""Turn a model pod from ``modelpack.mount.k8s`` into a vLLM server pod using the ``modelpack`` load format.

``mount.k8s`` decides how the model reaches the pod (image volume, or init container + node
cache); this module only fills in the serving container: the vLLM command line (the same builder
the tests and the benchmark use), the pin in ``--model-loader-extra-config``, the start id and t0
that tie the server's events to the pull's, the port and the probes on ``/health``. The serving
image must contain vLLM and ``modelpack-oci[vllm]`` (the plugin registers through its entry point).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

from modelpack.errors import K8sError
from modelpack.mount.k8s import literal
from modelpack.serving.vllm_command import vllm_server_args

VLLM_PORT = 8000
EVENTS_PATH = "/var/log/modelpack/events.jsonl"

VLLM_POD_NOTES = [
    "The server image (--image) needs vLLM and modelpack-oci[vllm] installed (the load format registers via an "
    "entry point); stock vllm/vllm-openai cannot run --load-format modelpack.",
    "The weights are checked against the digest pinned below before vLLM serves; a refusal fails the start.",
    "modelpack events (t0, t3-t5; refusals) go to " + EVENTS_PATH + "; read them with 'modelpack timeline'.",
]


def vllm_server_pod(
    pod: Mapping[str, Any],
    *,
    model_dir: str,
    digest: str,
    trust: str = "snapshot",
    tp_size: int = 1,
    port: int = VLLM_PORT,
    extra_args: Sequence[str] = (),
    python: str = "python3",
    served_model_name: str | None = None,
) -> dict[str, Any]:
    """A copy of ``pod`` whose first container runs vLLM on ``model_dir`` with the pinned weights.

    ``model_dir`` and ``extra_args`` are taken literally (never ``$(VAR)``-expanded by the kubelet).
    ``served_model_name`` is the API's model id (the repository, so it survives a new version).

    ``trust="runtime"`` for an image volume (the runtime verified the pinned image), ``snapshot``
    for a node-cache snapshot (the loader verifies the pin and holds the cache's lease).
    """
    if tp_size < 1:
        raise K8sError(f"--tensor-parallel-size must be at least 1, got {tp_size}")
    out = copy.deepcopy(dict(pod))
    spec = out.get("spec") or {}
    containers = spec.get("containers") or []
    if not containers:
        raise K8sError("the pod has no container to run vLLM in")
    server = containers[0]
    extra: dict[str, Any] = {"expected_digest": digest}
    if trust != "snapshot":
        extra["trust"] = trust
    argv = vllm_server_args(
        model_dir,
        python=python,
        extra_config=extra,
        tp_size=tp_size,
        host="0.0.0.0",
        port=port,
        served_model_name=served_model_name,
    ) + list(extra_args)
    # literal: the kubelet would expand $(VAR) in a model path or an extra argument
    server["command"] = [literal(a) for a in argv]
    env = [
        e for e in server.get("env", []) if e.get("name") not in ("MODELPACK_START_ID", "MODELPACK_EVENTS")
    ]
    env += [
        # the pod UID groups the pull's and every rank's events into one start
        {"name": "MODELPACK_START_ID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}},
        {"name": "MODELPACK_EVENTS", "value": EVENTS_PATH},
    ]
    server["env"] = env
    server["ports"] = [{"name": "http", "containerPort": port, "protocol": "TCP"}]
    # loading a large model takes minutes: the startup probe allows 30 min, then readiness takes over
    server["startupProbe"] = {"httpGet": _health(port), "periodSeconds": 5, "failureThreshold": 360}
    server["readinessProbe"] = {"httpGet": _health(port), "periodSeconds": 5}
    mounts = list(server.get("volumeMounts", []))
    mounts.append({"name": "modelpack-events", "mountPath": EVENTS_PATH.rsplit("/", 1)[0]})
    server["volumeMounts"] = mounts
    volumes = list(spec.get("volumes", []))
    volumes.append({"name": "modelpack-events", "emptyDir": {}})
    spec["volumes"] = volumes
    if tp_size > 1:
        # TP workers share tensors through /dev/shm; the default 64 MiB is far too small
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory"}})
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    return out


def _health(port: int) -> dict[str, Any]:
    return {"path": "/health", "port": port}
