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

Beside it: ``k8s_containers`` (the pieces every workload shares: mounts, literal strings, the
cache volume and owner container, the pull command), ``k8s_prewarm`` (the pre-warm DaemonSet and
its peers Service), ``k8s_settings`` (pull settings as container variables).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

from modelpack.mount.k8s_containers import (  # re-exported: where callers find them
    ADAPTER_POD_HOLD,
    CACHE_UID,
    DEFAULT_CACHE_HOST_PATH,
    DEFAULT_CACHE_MOUNT,
    DOCKER_CONFIG_MOUNT,
    POLICY_MOUNT,
    cache_owner_container,
    credential_env_and_mounts,
    env_var,
    literal,
    node_cache_volume,
    pull_command,
)
from modelpack.mount.k8s_prewarm import peers_service, peers_url, prewarm_daemonset  # re-exported
from modelpack.mount.k8s_settings import PodPullSettings

from modelpack.errors import InvalidReferenceError, K8sError
from modelpack.oci.reference import Reference, parse_reference

PULL_POLICIES = ("Always", "IfNotPresent", "Never")

IMAGE_VOLUME_NOTES = [
    "Image volumes need the ImageVolume feature gate: on by default from Kubernetes 1.35; on 1.31-1.34 "
    "(alpha 1.31-1.32, beta 1.33-1.34) enable it on the API server and every kubelet.",
    "CRI-O >= 1.33 mounts the raw ModelPack artifact: files appear under the mount path by title annotation.",
    "containerd >= 2.1 mounts only images: push with 'modelpack push --format image' and read <mount>/models/.",
    "The reference is pinned by digest; pullPolicy IfNotPresent then never re-pulls a changed tag.",
]


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
                    "env": [env_var("MODELPACK_MODEL_DIR", mount_path)],
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
    env, mounts, volumes = credential_env_and_mounts(registry_secret, policy_secret, policy_key)
    env, mounts, volumes = [*env, *pull.env()], [*mounts, *pull.mounts()], [*volumes, *pull.volumes()]
    snapshot = snapshot_path(cache_path, ref.digest.hex)
    commands = pull_command([image_ref], cache_path, policy_secret, policy_key, adapters)
    meta = _pod_metadata(ref, name, namespace)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta,
        "spec": {
            "initContainers": [
                *([cache_owner_container(modelpack_image, cache_path)] if cache_volume == "hostPath" else []),
                {
                    "name": "modelpack-pull",
                    "image": modelpack_image,
                    "command": ["sh", "-c", literal(commands[0])],
                    "env": [*env, env_var("MODELPACK_CACHE", cache_path), _start_id_env()],
                    "volumeMounts": [{"name": "modelpack-cache", "mountPath": cache_path}, *mounts],
                    "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True},
                },
            ],
            "containers": [
                {
                    "name": "server",
                    "image": image,
                    "env": [env_var("MODELPACK_MODEL_DIR", snapshot), _start_id_env()],
                    "volumeMounts": [{"name": "modelpack-cache", "mountPath": cache_path, "readOnly": True}],
                }
            ],
            "volumes": [node_cache_volume(cache_volume, host_path, size_limit), *volumes],
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


__all__ = [
    "ADAPTER_POD_HOLD",
    "CACHE_UID",
    "DEFAULT_CACHE_HOST_PATH",
    "DEFAULT_CACHE_MOUNT",
    "DOCKER_CONFIG_MOUNT",
    "IMAGE_VOLUME_NOTES",
    "POLICY_MOUNT",
    "PULL_POLICIES",
    "as_deployment",
    "image_volume_pod",
    "init_container_pod",
    "literal",
    "peers_service",
    "peers_url",
    "prewarm_daemonset",
    "served_model_name",
    "snapshot_path",
    "to_yaml",
    "validate",
]
