"""The pre-warm DaemonSet (the third way a model reaches a pod, docs/node.md): keeps chosen
models pulled in selected nodes' caches, optionally serving them to the other nodes as peers
(``cache serve --fill`` behind the headless Service of ``peers_service``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from modelpack.mount.k8s_containers import (
    DEFAULT_CACHE_HOST_PATH,
    DEFAULT_CACHE_MOUNT,
    cache_owner_container,
    credential_env_and_mounts,
    env_var,
    literal,
    node_cache_volume,
    pull_command,
)
from modelpack.mount.k8s_settings import PodPullSettings, peer_token_env

from modelpack.errors import InvalidReferenceError, K8sError
from modelpack.oci.reference import Reference, parse_reference


def prewarm_daemonset(
    references: Sequence[str | Reference],
    *,
    node_selector: Mapping[str, str],
    host_path: str = DEFAULT_CACHE_HOST_PATH,
    cache_path: str = DEFAULT_CACHE_MOUNT,
    interval_s: int = 300,
    policy_secret: str | None = None,
    policy_key: str = "policy.yaml",
    registry_secret: str | None = None,
    modelpack_image: str,
    name: str = "modelpack-prewarm",
    namespace: str | None = None,
    tolerate_all: bool = False,
    serve_port: int | None = None,
    peer_token_secret: str | None = None,
    pull: PodPullSettings | None = None,
) -> dict[str, Any]:
    """A DaemonSet that pulls ``references`` into every selected node's cache and re-checks them.

    Tags are allowed here (pre-warming "the current v1"), but pods should consume digests.
    Re-pulling a cached digest is a hit (no hashing, no transfer), so the loop is cheap.

    With ``serve_port``, each pod also runs ``cache serve --fill`` (the digest-pinned references;
    only it mounts the cache writable) on that port and pulls ask the peers of ``peers_service``
    first (``MODELPACK_MIRRORS=dns+http://…``, then the user's mirrors), ranked per blob, the
    origin last. Peer serving needs ``peer_token_secret`` (a Secret whose ``token`` key the server
    requires, ``MODELPACK_SERVE_TOKEN``, and the pulls present, ``MODELPACK_PEER_TOKEN``). ``pull``
    reaches every pull, and the fills (its mirrors excepted: a fill asks the origin).
    """
    pull = pull or PodPullSettings()
    pull.check()
    if not references:
        raise K8sError("prewarm needs at least one reference")
    if not node_selector:
        raise K8sError("prewarm needs --node-selector KEY=VALUE (pre-warming every node is rarely meant)")
    refs = []
    for r in references:
        ref = parse_reference(r) if isinstance(r, str) else r
        if ref.scheme != "registry":
            raise InvalidReferenceError(f"prewarm: {ref} is not a registry reference")
        refs.append(str(ref))
    if interval_s < 10:
        raise K8sError("--interval must be at least 10 seconds")
    if serve_port is not None and not 1 <= serve_port <= 65535:
        raise K8sError(f"--serve-peers {serve_port}: not a port")
    if serve_port is not None and not peer_token_secret:
        raise K8sError(
            "--serve-peers needs --peer-token-secret NAME (a Secret with key 'token'): the peers serve "
            "the node's cached models to holders of that token only"
        )
    env, mounts, volumes = credential_env_and_mounts(registry_secret, policy_secret, policy_key)
    mounts, volumes = [*mounts, *pull.mounts()], [*volumes, *pull.volumes()]
    fills = [r for r in refs if parse_reference(r).digest is not None] if serve_port is not None else []
    serve_env, serve_mounts, _ = credential_env_and_mounts(registry_secret, None, policy_key)
    serve_env = [*serve_env, *pull.env(with_mirrors=False)] if fills else []
    serve_mounts = [*serve_mounts, *pull.mounts()] if fills else []
    if serve_port is not None:
        assert peer_token_secret is not None
        serve_env.append(peer_token_env("MODELPACK_SERVE_TOKEN", peer_token_secret))
        env = [
            *env,
            *([env_var("MODELPACK_PEER_ORDER", "blob")] if fills else []),
            *pull.env(mirrors_first=(peers_url(name, namespace, serve_port),)),
            peer_token_env("MODELPACK_PEER_TOKEN", peer_token_secret),
            {"name": "MODELPACK_NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
            {"name": "MODELPACK_NODE_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        ]
    else:
        env = [*env, *pull.env()]
    pulls = pull_command(refs, cache_path, policy_secret, policy_key)
    loop = "".join(f"  {p} || echo 'prewarm failed: exit '$? >&2\n" for p in pulls)
    script = f"set -u\nwhile true; do\n{loop}  sleep {int(interval_s)}\ndone\n"
    labels = {"app.kubernetes.io/name": name, "app.kubernetes.io/component": "modelpack-prewarm"}
    meta: dict[str, Any] = {"name": name, "labels": dict(labels)}
    if namespace:
        meta["namespace"] = namespace
    pod_spec: dict[str, Any] = {
        "nodeSelector": dict(node_selector),
        "initContainers": [cache_owner_container(modelpack_image, cache_path)],
        "containers": [
            {
                "name": "prewarm",
                "image": modelpack_image,
                "command": ["sh", "-c", literal(script)],
                "env": [*env, env_var("MODELPACK_CACHE", cache_path)],
                "volumeMounts": [{"name": "modelpack-cache", "mountPath": cache_path}, *mounts],
                "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}},
                "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True},
            }
        ],
        "volumes": [node_cache_volume("hostPath", host_path, None), *volumes],
    }
    if serve_port is not None:
        pod_spec["containers"].append(
            {
                "name": "peer-serve",
                "image": modelpack_image,
                "command": [
                    "modelpack",
                    "cache",
                    "serve",
                    "--cache",
                    literal(cache_path),
                    "--listen",
                    f"0.0.0.0:{serve_port}",
                    *(arg for ref in fills for arg in ("--fill", literal(ref))),
                ],
                "env": serve_env,
                "ports": [{"name": "peers", "containerPort": serve_port, "protocol": "TCP"}],
                # a TCP check: every HTTP path, /v2/ included, answers 401 without the token
                "readinessProbe": {"tcpSocket": {"port": serve_port}, "periodSeconds": 10},
                "volumeMounts": [
                    {"name": "modelpack-cache", "mountPath": cache_path, "readOnly": not fills},
                    *serve_mounts,
                ],
                "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}},
                "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True},
            }
        )
    if tolerate_all:
        pod_spec["tolerations"] = [{"operator": "Exists"}]
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": meta,
        "spec": {
            "selector": {"matchLabels": dict(labels)},
            "updateStrategy": {"type": "RollingUpdate"},
            "template": {"metadata": {"labels": dict(labels)}, "spec": pod_spec},
        },
    }


def peers_url(name: str, namespace: str | None, port: int) -> str:
    """The ``dns+http://`` mirror naming every pod behind ``peers_service``."""
    host = f"{name}-peers" + (f".{namespace}.svc" if namespace else "")
    return f"dns+http://{host}:{port}"


def peers_service(name: str, namespace: str | None, port: int) -> dict[str, Any]:
    """The headless Service over the pre-warm DaemonSet's ``cache serve`` containers: its name
    resolves to one address per ready pod (``publishNotReadyAddresses`` off: a pod whose serve
    is not answering yet is not a peer)."""
    labels = {"app.kubernetes.io/name": name, "app.kubernetes.io/component": "modelpack-prewarm"}
    meta: dict[str, Any] = {"name": f"{name}-peers", "labels": dict(labels)}
    if namespace:
        meta["namespace"] = namespace
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta,
        "spec": {
            "clusterIP": "None",
            "selector": dict(labels),
            "ports": [{"name": "peers", "port": port, "targetPort": port, "protocol": "TCP"}],
        },
    }
