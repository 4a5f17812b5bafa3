"""The pieces every generated Kubernetes workload shares (``k8s`` pods, the ``k8s_prewarm``
DaemonSet): where the node cache and the secrets are mounted, strings made literal for the
kubelet (``literal``), the cache volume and the container that hands a hostPath cache to the
image's user, the ``modelpack pull`` command, and the registry-credential and policy mounts.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from typing import Any

from modelpack.errors import K8sError

DEFAULT_CACHE_HOST_PATH = "/var/cache/modelpack"
DEFAULT_CACHE_MOUNT = "/var/cache/modelpack"
POLICY_MOUNT = "/etc/modelpack/policy"
DOCKER_CONFIG_MOUNT = "/etc/modelpack/docker"
#: the modelpack image's user (images/modelpack/Containerfile), who owns a node cache it writes
CACHE_UID = 1000


def literal(value: str) -> str:
    """``value`` as the kubelet will hand it to the process from ``command``, ``args`` or an env
    ``value``: it replaces ``$(NAME)`` with a variable's value and ``$$`` with ``$`` (anything
    else after a ``$`` is left alone), so doubling every ``$`` is exactly undone by it."""
    return value.replace("$", "$$")


def env_var(name: str, value: str) -> dict[str, str]:
    return {"name": name, "value": literal(value)}


def secret_volume(name: str, secret: str, items: list[dict[str, str]] | None = None) -> dict[str, Any]:
    src: dict[str, Any] = {"secretName": secret, "defaultMode": 0o440}
    if items:
        src["items"] = items
    return {"name": name, "secret": src}


def node_cache_volume(kind: str, host_path: str, size_limit: str | None) -> dict[str, Any]:
    if kind == "hostPath":
        return {"name": "modelpack-cache", "hostPath": {"path": host_path, "type": "DirectoryOrCreate"}}
    if kind == "emptyDir":
        empty: dict[str, Any] = {}
        if size_limit:
            empty["sizeLimit"] = size_limit
        return {"name": "modelpack-cache", "emptyDir": empty}
    raise K8sError(f"cache volume must be hostPath or emptyDir, got {kind!r}")


#: how long an init container's pull keeps a base and its adapters from ``cache gc``: the
#: serving container's image pull and start, until vLLM leases each adapter it serves
ADAPTER_POD_HOLD = "1h"


def cache_owner_container(image: str, cache_path: str) -> dict[str, Any]:
    """For a hostPath cache: the kubelet creates a missing node directory as root, mode 0755, where
    the image's uid 1000 cannot write. This one-shot container gives that directory (not what is
    in it) to uid 1000, as root with no capability but CAP_CHOWN; everything else runs as 1000."""
    return {
        "name": "modelpack-cache-owner",
        "image": image,
        "command": ["chown", f"{CACHE_UID}:{CACHE_UID}", literal(cache_path)],
        "volumeMounts": [{"name": "modelpack-cache", "mountPath": cache_path}],
        "securityContext": {
            "runAsUser": 0,
            "runAsNonRoot": False,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"], "add": ["CHOWN"]},
        },
    }


def pull_command(
    references: Sequence[str],
    cache_path: str,
    policy_secret: str | None,
    policy_key: str,
    adapters: Sequence[str] = (),
) -> list[str]:
    args = ["modelpack", "pull"]
    cmd: list[str] = []
    for r in references:
        one = [*args, r, "--cache", cache_path, "--json"]
        for a in adapters:  # LoRA adapters of this base, each checked against it by the pull
            one += ["--adapter", a]
        if adapters:  # kept from gc until the server starts and leases them (serving.adapter_leases)
            one += ["--hold", ADAPTER_POD_HOLD]
        if policy_secret:
            one += ["--policy", f"{POLICY_MOUNT}/{policy_key}"]
        cmd.append(shlex.join(one))
    return cmd


def credential_env_and_mounts(
    registry_secret: str | None, policy_secret: str | None, policy_key: str
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    env: list[dict[str, Any]] = []
    mounts: list[dict[str, Any]] = []
    volumes: list[dict[str, Any]] = []
    if registry_secret:
        # A kubernetes.io/dockerconfigjson Secret: its .dockerconfigjson becomes $DOCKER_CONFIG/config.json
        volumes.append(
            secret_volume(
                "registry-credentials",
                registry_secret,
                [{"key": ".dockerconfigjson", "path": "config.json"}],
            )
        )
        mounts.append({"name": "registry-credentials", "mountPath": DOCKER_CONFIG_MOUNT, "readOnly": True})
        env.append(env_var("DOCKER_CONFIG", DOCKER_CONFIG_MOUNT))
    if policy_secret:
        volumes.append(secret_volume("trust-policy", policy_secret))
        mounts.append({"name": "trust-policy", "mountPath": POLICY_MOUNT, "readOnly": True})
    return env, mounts, volumes
