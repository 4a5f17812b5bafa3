"""Kubernetes objects for the three ways a model reaches a pod (docs/node.md#three-ways-to-mount-a-model).

1. **image volume** (``volumes[].image``; the ``ImageVolume`` feature gate: alpha in Kubernetes
   1.31, beta but off by default in 1.33 and 1.34, beta and on by default from 1.35): the kubelet
   asks the runtime to pull the artifact and mounts it read-only. CRI-O 1.33+ mounts a raw
   ModelPack artifact as files named by their title annotations; containerd 2.1+ mounts only
   images, so push the image-shaped variant (``--format image``) and find the files under
   ``models/``.
2. **init container**: ``modelpack pull --cache`` verifies signatures per policy and publishes a
   snapshot in a node cache (hostPath, shared by pods on the node) or an emptyDir; the serving
   container mounts it read-only. Works on every runtime.
3. **pre-warm DaemonSet**: keeps chosen models pulled on selected nodes so starts are cache hits.

Every string that lands in a container's ``command``, ``args`` or ``env[].value`` is literal
(``literal``): the kubelet expands ``$(VAR)`` there and turns ``$$`` into ``$`` before the
process starts, so a cache path holding ``$(MODELPACK_CACHE)`` would otherwise be rewritten
beneath ``shlex`` quoting (which only protects against the shell that runs later).

The images are the user's (``modelpack_image``, ``image``; no default in anyone's namespace), and
every pull setting (``PodPullSettings``: mirrors, plain HTTP, CA bundle, retry budget, timeout)
reaches each container that pulls as the ``MODELPACK_*`` variables it reads (``k8s_settings``).

Every reference is pinned by digest: a tag would let two replicas run different weights. The
generated dicts are checked against the ``kubernetes`` client models (``validate``); the tests
also validate them strictly against the published OpenAPI schemas of 1.33 and the newest release.
"""

from __future__ import annotations

import functools
import shlex
from collections.abc import Mapping, Sequence
from typing import Any

from modelpack.mount.k8s_settings import PodPullSettings, peer_token_env

from modelpack.errors import InvalidReferenceError, K8sError
from modelpack.oci.reference import Reference, parse_reference

DEFAULT_CACHE_HOST_PATH = "/var/cache/modelpack"
DEFAULT_CACHE_MOUNT = "/var/cache/modelpack"
POLICY_MOUNT = "/etc/modelpack/policy"
DOCKER_CONFIG_MOUNT = "/etc/modelpack/docker"
PULL_POLICIES = ("Always", "IfNotPresent", "Never")
#: the modelpack image's user (images/modelpack/Containerfile), who owns a node cache it writes
CACHE_UID = 1000

IMAGE_VOLUME_NOTES = [
    "Image volumes need the ImageVolume feature gate: on by default from Kubernetes 1.35; on 1.31-1.34 "
    "(alpha 1.31-1.32, beta 1.33-1.34) enable it on the API server and every kubelet.",
    "CRI-O >= 1.33 mounts the raw ModelPack artifact: files appear under the mount path by title annotation.",
    "containerd >= 2.1 mounts only images: push with 'modelpack push --format image' and read <mount>/models/.",
    "The reference is pinned by digest; pullPolicy IfNotPresent then never re-pulls a changed tag.",
]


def literal(value: str) -> str:
    """``value`` as the kubelet will hand it to the process from ``command``, ``args`` or an env
    ``value``: it replaces ``$(NAME)`` with a variable's value and ``$$`` with ``$`` (anything
    else after a ``$`` is left alone), so doubling every ``$`` is exactly undone by it."""
    return value.replace("$", "$$")


def _env(name: str, value: str) -> dict[str, str]:
    return {"name": name, "value": literal(value)}


def snapshot_path(cache_path: str, digest_hex: str) -> str:
    """Where a node-cache snapshot of the manifest ``digest_hex`` is inside a pod (not escaped)."""
    return f"{cache_path.rstrip('/')}/snapshots/{digest_hex}"


# The pod UID groups the init container's and the server's events into one start (``modelpack timeline``).
def _start_id_env() -> dict[str, Any]:
    return {"name": "MODELPACK_START_ID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}}


def _pinned_image_ref(reference: str | Reference, *, what: str) -> tuple[Reference, str]:
    ref = parse_reference(reference) if isinstance(reference, str) else reference
    if ref.scheme != "registry":
        raise InvalidReferenceError(f"{what}: {ref} is not a registry reference (host/repo@sha256:…)")
    if not ref.digest:
        raise InvalidReferenceError(
            f"{what}: {ref} is not pinned by digest; use host/repo@sha256:… "
            "(resolve it with 'modelpack inspect REF' or pass --resolve)"
        )
    return ref, f"{ref.location}/{ref.repository}@{ref.digest}"


def served_model_name(ref: Reference) -> str:
    """The name vLLM serves the model under: its repository (``team-a/llama``), the same for every
    version, so clients keep one model id across rollouts (the digest stays in the annotation)."""
    return ref.repository


def _name_from(ref: Reference) -> str:
    base = ref.repository.rsplit("/", 1)[-1].replace("_", "-").replace(".", "-").lower()
    return (base or "model")[:50].strip("-") or "model"


def _secret_volume(name: str, secret: str, items: list[dict[str, str]] | None = None) -> dict[str, Any]:
    src: dict[str, Any] = {"secretName": secret, "defaultMode": 0o440}
    if items:
        src["items"] = items
    return {"name": name, "secret": src}


def _cache_volume(kind: str, host_path: str, size_limit: str | None) -> dict[str, Any]:
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


def _cache_owner_container(image: str, cache_path: str) -> dict[str, Any]:
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


def _pull_command(
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


def _credential_env_and_mounts(
    registry_secret: str | None, policy_secret: str | None, policy_key: str
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    env: list[dict[str, Any]] = []
    mounts: list[dict[str, Any]] = []
    volumes: list[dict[str, Any]] = []
    if registry_secret:
        # A kubernetes.io/dockerconfigjson Secret: its .dockerconfigjson becomes $DOCKER_CONFIG/config.json
        volumes.append(
            _secret_volume(
                "registry-credentials",
                registry_secret,
                [{"key": ".dockerconfigjson", "path": "config.json"}],
            )
        )
        mounts.append({"name": "registry-credentials", "mountPath": DOCKER_CONFIG_MOUNT, "readOnly": True})
        env.append(_env("DOCKER_CONFIG", DOCKER_CONFIG_MOUNT))
    if policy_secret:
        volumes.append(_secret_volume("trust-policy", policy_secret))
        mounts.append({"name": "trust-policy", "mountPath": POLICY_MOUNT, "readOnly": True})
    return env, mounts, volumes


def image_volume_pod(
    reference: str | Reference,
    *,
    mount_path: str = "/models",
    pull_policy: str = "IfNotPresent",
    name: str | None = None,
    namespace: str | None = None,
    image: str,
    container_name: str = "server",
) -> dict[str, Any]:
    """A Pod whose model arrives as an image volume (kubelet + runtime pull it, read-only)."""
    ref, image_ref = _pinned_image_ref(reference, what="image volume")
    if pull_policy not in PULL_POLICIES:
        raise K8sError(f"pullPolicy must be one of {', '.join(PULL_POLICIES)}")
    meta = _pod_metadata(ref, name, namespace)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta,
        "spec": {
            "containers": [
                {
                    "name": container_name,
                    "image": image,
                    "env": [_env("MODELPACK_MODEL_DIR", mount_path)],
                    "volumeMounts": [{"name": "model", "mountPath": mount_path, "readOnly": True}],
                }
            ],
            "volumes": [{"name": "model", "image": {"reference": image_ref, "pullPolicy": pull_policy}}],
        },
    }


def _pod_metadata(ref: Reference, name: str | None, namespace: str | None) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name or _name_from(ref),
        "labels": {"app.kubernetes.io/name": name or _name_from(ref)},
        "annotations": {"modelpack.dev/model-digest": str(ref.digest)},
    }
    if namespace:
        meta["namespace"] = namespace
    return meta


def init_container_pod(
    reference: str | Reference,
    *,
    cache_path: str = DEFAULT_CACHE_MOUNT,
    cache_volume: str = "hostPath",
    host_path: str = DEFAULT_CACHE_HOST_PATH,
    size_limit: str | None = None,
    policy_secret: str | None = None,
    policy_key: str = "policy.yaml",
    registry_secret: str | None = None,
    modelpack_image: str,
    image: str,
    name: str | None = None,
    namespace: str | None = None,
    adapters: Sequence[str] = (),
    pull: PodPullSettings | None = None,
) -> dict[str, Any]:
    """A Pod whose init container pulls, verifies and publishes the model in the node cache.

    The serving container mounts the cache read-only and finds the model at
    ``<cache>/snapshots/<manifest hex>`` (``$MODELPACK_MODEL_DIR``), known up front because the
    reference is pinned by digest. ``adapters`` (pinned references of LoRA adapters of this
    base) are pulled by the same command (``--adapter``), each into its own snapshot, held from
    ``cache gc`` (``--hold``, ``ADAPTER_POD_HOLD``) until the server leases them. ``pull``
    (mirrors, plain HTTP, CA bundle, retry budget, timeout) reaches the init container as the
    ``MODELPACK_*`` settings ``modelpack pull`` reads.
    """
    ref, image_ref = _pinned_image_ref(reference, what="init container")
    assert ref.digest is not None
    pull = pull or PodPullSettings()
    pull.check()
    env, mounts, volumes = _credential_env_and_mounts(registry_secret, policy_secret, policy_key)
    env, mounts, volumes = [*env, *pull.env()], [*mounts, *pull.mounts()], [*volumes, *pull.volumes()]
    snapshot = snapshot_path(cache_path, ref.digest.hex)
    commands = _pull_command([image_ref], cache_path, policy_secret, policy_key, adapters)
    meta = _pod_metadata(ref, name, namespace)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta,
        "spec": {
            "initContainers": [
                *(
                    [_cache_owner_container(modelpack_image, cache_path)]
                    if cache_volume == "hostPath"
                    else []
                ),
                {
                    "name": "modelpack-pull",
                    "image": modelpack_image,
                    "command": ["sh", "-c", literal(commands[0])],
                    "env": [*env, _env("MODELPACK_CACHE", cache_path), _start_id_env()],
                    "volumeMounts": [{"name": "modelpack-cache", "mountPath": cache_path}, *mounts],
                    "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True},
                },
            ],
            "containers": [
                {
                    "name": "server",
                    "image": image,
                    "env": [_env("MODELPACK_MODEL_DIR", snapshot), _start_id_env()],
                    "volumeMounts": [{"name": "modelpack-cache", "mountPath": cache_path, "readOnly": True}],
                }
            ],
            "volumes": [_cache_volume(cache_volume, host_path, size_limit), *volumes],
        },
    }


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
    env, mounts, volumes = _credential_env_and_mounts(registry_secret, policy_secret, policy_key)
    mounts, volumes = [*mounts, *pull.mounts()], [*volumes, *pull.volumes()]
    fills = [r for r in refs if parse_reference(r).digest is not None] if serve_port is not None else []
    serve_env, serve_mounts, _ = _credential_env_and_mounts(registry_secret, None, policy_key)
    serve_env = [*serve_env, *pull.env(with_mirrors=False)] if fills else []
    serve_mounts = [*serve_mounts, *pull.mounts()] if fills else []
    if serve_port is not None:
        assert peer_token_secret is not None
        serve_env.append(peer_token_env("MODELPACK_SERVE_TOKEN", peer_token_secret))
        env = [
            *env,
            *([_env("MODELPACK_PEER_ORDER", "blob")] if fills else []),
            *pull.env(mirrors_first=(peers_url(name, namespace, serve_port),)),
            peer_token_env("MODELPACK_PEER_TOKEN", peer_token_secret),
            {"name": "MODELPACK_NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
            {"name": "MODELPACK_NODE_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        ]
    else:
        env = [*env, *pull.env()]
    pulls = _pull_command(refs, cache_path, policy_secret, policy_key)
    loop = "".join(f"  {p} || echo 'prewarm failed: exit '$? >&2\n" for p in pulls)
    script = f"set -u\nwhile true; do\n{loop}  sleep {int(interval_s)}\ndone\n"
    labels = {"app.kubernetes.io/name": name, "app.kubernetes.io/component": "modelpack-prewarm"}
    meta: dict[str, Any] = {"name": name, "labels": dict(labels)}
    if namespace:
        meta["namespace"] = namespace
    pod_spec: dict[str, Any] = {
        "nodeSelector": dict(node_selector),
        "initContainers": [_cache_owner_container(modelpack_image, cache_path)],
        "containers": [
            {
                "name": "prewarm",
                "image": modelpack_image,
                "command": ["sh", "-c", literal(script)],
                "env": [*env, _env("MODELPACK_CACHE", cache_path)],
                "volumeMounts": [{"name": "modelpack-cache", "mountPath": cache_path}, *mounts],
                "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}},
                "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True},
            }
        ],
        "volumes": [_cache_volume("hostPath", host_path, None), *volumes],
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


def as_deployment(pod: Mapping[str, Any], replicas: int) -> dict[str, Any]:
    """``pod`` as the template of a Deployment of ``replicas``.

    Serving replicas want a controller that restarts and rolls them; the template is exactly the
    pod (same spec, labels and digest annotation), so the model stays pinned by digest and a
    rollout to another model is a change of that digest, never a moved tag.
    """
    if replicas < 1:
        raise K8sError(f"a Deployment needs at least one replica, got {replicas}")
    meta = pod["metadata"]
    labels = dict(meta["labels"])
    template_meta: dict[str, Any] = {"labels": labels}
    if meta.get("annotations"):
        template_meta["annotations"] = dict(meta["annotations"])
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": dict(meta),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": dict(labels)},
            "template": {"metadata": template_meta, "spec": pod["spec"]},
        },
    }


_MODEL_CLASSES = {
    ("v1", "Pod"): "V1Pod",
    ("apps/v1", "DaemonSet"): "V1DaemonSet",
    ("apps/v1", "Deployment"): "V1Deployment",
    ("v1", "Service"): "V1Service",
}


def validate(obj: Mapping[str, Any]) -> Any:
    """Load ``obj`` into the ``kubernetes`` client model and check nothing was dropped.

    The client ignores unknown keys when deserialising, so the object is serialised back and
    compared: a misspelt field shows up as a difference. Returns the model object.
    """
    from kubernetes.client import ApiClient

    cls = _MODEL_CLASSES.get((str(obj.get("apiVersion")), str(obj.get("kind"))))
    if cls is None:
        raise K8sError(f"no client model for {obj.get('apiVersion')}/{obj.get('kind')}")
    client = ApiClient()
    try:
        model = client._ApiClient__deserialize(dict(obj), cls)  # type: ignore[attr-defined]
    except (ValueError, TypeError) as exc:
        raise K8sError(f"{obj.get('kind')} does not load into {cls}: {exc}") from exc
    back = client.sanitize_for_serialization(model)
    if back != obj:
        raise K8sError(f"{obj.get('kind')} has fields the {cls} model does not know: {_diff(obj, back)}")
    return model


def _diff(a: Any, b: Any, path: str = "") -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in a:
            if k not in b:
                return f"{path}.{k}"
            d = _diff(a[k], b[k], f"{path}.{k}")
            if d:
                return d
        return ""
    if isinstance(a, list) and isinstance(b, list):
        for i, (x, y) in enumerate(zip(a, b, strict=False)):
            d = _diff(x, y, f"{path}[{i}]")
            if d:
                return d
        return "" if len(a) == len(b) else f"{path} (length)"
    return "" if a == b else f"{path} ({a!r} != {b!r})"


def _str_representer(dumper: Any, value: str) -> Any:
    style = "|" if "\n" in value else None  # scripts stay readable as literal blocks
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


@functools.cache
def _dumper() -> Any:
    """A SafeDumper writing multi-line strings as literal blocks; built on first use so that
    importing this module (``modelpack pull`` does) does not import yaml."""
    import yaml

    class Dumper(yaml.SafeDumper):
        pass

    Dumper.add_representer(str, _str_representer)
    return Dumper


def to_yaml(obj: Mapping[str, Any], notes: Sequence[str] = ()) -> str:
    """YAML with the notes as leading comments (kubectl ignores them)."""
    import yaml

    header = "".join(f"# {n}\n" for n in notes)
    return header + yaml.dump(dict(obj), Dumper=_dumper(), sort_keys=False, default_flow_style=False)
