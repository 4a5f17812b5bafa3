"""KServe objects that serve ModelPack artifacts through ``modelpack storage-initializer``.

- ``storage_containers``: the two ClusterStorageContainers for one URI prefix, one per
  workload type. ``initContainer`` (InferenceServices) mounts the node cache (hostPath), a
  ``$TMPDIR`` and, when given, the trust policy and the registry pull secret — volumes the pod
  must declare, which ``inference_service`` does. ``localModelDownloadJob`` (the LocalModelNode
  agent's Jobs) gets no volumes but its PVC (the agent replaces the container's volumeMounts),
  so its policy comes as text from a ConfigMap key (``MODELPACK_POLICY_YAML``).
- ``inference_service``: vLLM in ``kserve-container``, weights either put at ``/mnt/models`` by
  the initializer or streamed from the registry by vLLM's ``modelpack`` load format (then the
  initializer fetches only the config files), always pinned by digest;
- ``local_model_cache``: a LocalModelNodeGroup (a local PV per node) and a LocalModelCache
  that pre-warms it. KServe keys its node cache by a hash of the URI, so the cache and the
  InferenceService must name the same digest-pinned URI.

Every container runs as uid 1000, read-only root filesystem, no privilege escalation, no
capabilities. Nothing here talks to a cluster; the tests validate each object against KServe's
CRD schemas and the core ones with kubernetes-validate.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from modelpack.errors import K8sError
from modelpack.mount.k8s import DEFAULT_CACHE_HOST_PATH, DEFAULT_CACHE_MOUNT, literal
from modelpack.mount.k8s_settings import PodPullSettings
from modelpack.oci.reference import Reference, parse_reference
from modelpack.serving.kserve.uri import MODELPACK_SCHEME
from modelpack.serving.vllm_command import vllm_server_args

KSERVE_GROUP = "serving.kserve.io"
MODEL_DIR = "/mnt/models"  # KServe's DefaultModelLocalMountPath
KSERVE_UID = 1000
POLICY_MOUNT = "/etc/modelpack/policy"
REGISTRY_AUTH_MOUNT = "/var/run/modelpack/registry"
TMP_MOUNT = "/tmp"
CACHE_VOLUME = "modelpack-cache"
POLICY_VOLUME = "modelpack-policy"
REGISTRY_AUTH_VOLUME = "modelpack-registry-auth"
TMP_VOLUME = "modelpack-tmp"
WEIGHTS_MODES = ("initializer", "stream")
DIGEST_ANNOTATION = "modelpack.dev/model-digest"

SECURITY_CONTEXT: dict[str, Any] = {
    "runAsUser": KSERVE_UID,
    "runAsGroup": KSERVE_UID,
    "runAsNonRoot": True,
    "readOnlyRootFilesystem": True,
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}


def pinned(reference: str) -> Reference:
    """The registry reference, which must carry its digest (KServe keys caches by the URI)."""
    ref = parse_reference(reference.removeprefix(MODELPACK_SCHEME))
    if ref.scheme != "registry":
        raise K8sError(f"{reference}: a KServe storage URI names a registry repository (HOST/REPO@sha256:…)")
    if not ref.digest:
        raise K8sError(
            f"{reference}: pin it by digest (HOST/REPO@sha256:… or --resolve): KServe keys its node "
            "cache by the URI, and a tag lets two replicas serve different weights"
        )
    return dataclasses.replace(ref, tag=None)  # the digest names it; a tag would only mislead


def storage_uri(ref: Reference, *, exclude: tuple[str, ...] = ()) -> str:
    query = "&".join(f"exclude={glob}" for glob in exclude)
    return f"{MODELPACK_SCHEME}{ref}" + (f"?{query}" if query else "")


def _env(name: str, value: str) -> dict[str, str]:
    return {"name": name, "value": literal(value)}


def _resources() -> dict[str, Any]:
    return {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"cpu": "2", "memory": "1Gi"}}


def storage_containers(
    *,
    name: str = "modelpack",
    image: str,
    prefix: str = MODELPACK_SCHEME,
    cache_mount: str = DEFAULT_CACHE_MOUNT,
    policy_secret: bool = False,
    registry_secret: bool = False,
    job_policy_configmap: str | None = None,
    policy_key: str = "policy.yaml",
    pull: PodPullSettings | None = None,
) -> list[dict[str, Any]]:
    """The ``initContainer`` and ``localModelDownloadJob`` ClusterStorageContainers for ``prefix``.

    ``pull`` (mirrors, plain HTTP, CA bundle, retry budget, timeout) reaches both as the
    ``MODELPACK_*`` settings the initializer reads; the CA ConfigMap is mounted only into the
    ``initContainer`` one (KServe replaces the download job's volumeMounts with its PVC), whose
    pods must declare the volume (``inference_service`` does, given the same ``pull``)."""
    if not prefix:
        raise K8sError("the URI prefix must not be empty (it would take every storageUri)")
    pull = pull or PodPullSettings()
    pull.check()
    common_env = pull.env()
    init_env = [*common_env, _env("MODELPACK_CACHE", cache_mount), _env("TMPDIR", TMP_MOUNT)]
    mounts: list[dict[str, Any]] = [
        {"name": CACHE_VOLUME, "mountPath": cache_mount},
        {"name": TMP_VOLUME, "mountPath": TMP_MOUNT},
        *pull.mounts(),
    ]
    if policy_secret:
        init_env.append(_env("MODELPACK_POLICY", f"{POLICY_MOUNT}/{policy_key}"))
        mounts.append({"name": POLICY_VOLUME, "mountPath": POLICY_MOUNT, "readOnly": True})
    if registry_secret:
        init_env.append(_env("KSERVE_OCI_DOCKER_CONFIG", f"{REGISTRY_AUTH_MOUNT}/config.json"))
        mounts.append({"name": REGISTRY_AUTH_VOLUME, "mountPath": REGISTRY_AUTH_MOUNT, "readOnly": True})
    job_env = [e for e in common_env if e["name"] != "MODELPACK_CA_FILE"]  # no volume of ours there
    if job_policy_configmap:
        job_env.append(
            {
                "name": "MODELPACK_POLICY_YAML",
                "valueFrom": {"configMapKeyRef": {"name": job_policy_configmap, "key": policy_key}},
            }
        )

    def container(env: list[dict[str, Any]], volume_mounts: list[dict[str, Any]] | None) -> dict[str, Any]:
        # no args: KServe supplies them (SRC_URI DEST pairs); a CSC's args would replace KServe's
        out: dict[str, Any] = {
            "name": "storage-initializer",
            "image": image,
            "command": ["modelpack", "storage-initializer"],
            "env": env,
            "resources": _resources(),
            "securityContext": dict(SECURITY_CONTEXT),
        }
        if volume_mounts:
            out["volumeMounts"] = volume_mounts
        return out

    def csc(csc_name: str, workload: str, spec_container: dict[str, Any]) -> dict[str, Any]:
        return {
            "apiVersion": f"{KSERVE_GROUP}/v1alpha1",
            "kind": "ClusterStorageContainer",
            "metadata": {"name": csc_name, "labels": {"app.kubernetes.io/managed-by": "modelpack"}},
            "spec": {
                "container": spec_container,
                "supportedUriFormats": [{"prefix": prefix}],
                "workloadType": workload,
                "supportsMultiModelDownload": True,
            },
        }

    return [
        csc(name, "initContainer", container(init_env, mounts)),
        csc(f"{name}-localmodel", "localModelDownloadJob", container(job_env, None)),
    ]


def inference_service(
    reference: str,
    *,
    name: str,
    namespace: str | None = None,
    weights: str = "initializer",
    image: str,
    tp_size: int = 1,
    host_path: str = DEFAULT_CACHE_HOST_PATH,
    cache_mount: str = DEFAULT_CACHE_MOUNT,
    policy_secret: str | None = None,
    registry_secret: str | None = None,
    policy_key: str = "policy.yaml",
    pull: PodPullSettings | None = None,
    served_model_name: str | None = None,
) -> dict[str, Any]:
    """An InferenceService running vLLM on the pinned model (``weights``: initializer | stream).

    vLLM serves it as ``served_model_name`` (default: the repository, the same for every
    version). With ``stream``, vLLM reads the registry itself: ``pull`` reaches it as the
    ``MODELPACK_*`` settings (``plain_http`` and ``ca_file`` in its extra config too) and the
    registry Secret is mounted for it (``DOCKER_CONFIG``). The CA ConfigMap volume is declared
    either way (the ``initContainer`` storage container mounts it)."""
    pull = pull or PodPullSettings()
    pull.check()
    if weights not in WEIGHTS_MODES:
        raise K8sError(f"weights {weights!r}: expected one of {', '.join(WEIGHTS_MODES)}")
    if tp_size < 1:
        raise K8sError(f"--tensor-parallel-size must be at least 1, got {tp_size}")
    ref = pinned(reference)
    digest = str(ref.digest)
    extra: dict[str, Any] = {"expected_digest": digest}
    mounts: list[dict[str, Any]] = []
    env: list[dict[str, Any]] = []
    if weights == "stream":
        extra["source"] = str(ref)
        if pull.plain_http:
            extra["plain_http"] = True
        if pull.ca_file:
            extra["ca_file"] = pull.ca_file
        env = pull.env()
        mounts += pull.mounts()
        if registry_secret:
            mounts.append({"name": REGISTRY_AUTH_VOLUME, "mountPath": REGISTRY_AUTH_MOUNT, "readOnly": True})
            env.append(_env("DOCKER_CONFIG", REGISTRY_AUTH_MOUNT))
        if policy_secret:
            extra["policy"] = f"{POLICY_MOUNT}/{policy_key}"
            mounts.append({"name": POLICY_VOLUME, "mountPath": POLICY_MOUNT, "readOnly": True})
        uri = storage_uri(ref, exclude=("*.safetensors",))
    else:
        extra["trust"] = "runtime"  # the initializer verified every file against the pinned digest
        uri = storage_uri(ref)
    argv = vllm_server_args(
        MODEL_DIR,
        extra_config=extra,
        tp_size=tp_size,
        host="0.0.0.0",
        port=8080,
        served_model_name=served_model_name or ref.repository,
    )
    server: dict[str, Any] = {
        "name": "kserve-container",
        "image": image,
        "command": [literal(a) for a in argv],
        # KServe's webhook reads STORAGE_URI of a custom container, injects the storage
        # initializer (the ClusterStorageContainer matching the prefix) and mounts /mnt/models
        "env": [_env("STORAGE_URI", uri), _env("HOME", "/tmp"), *env],
        "ports": [{"containerPort": 8080, "protocol": "TCP"}],
        "resources": {
            "limits": {"nvidia.com/gpu": str(tp_size)},
            "requests": {"nvidia.com/gpu": str(tp_size)},
        },
        "securityContext": {"runAsUser": KSERVE_UID, "runAsNonRoot": True, "allowPrivilegeEscalation": False},
    }
    if mounts:
        server["volumeMounts"] = mounts
    volumes: list[dict[str, Any]] = [
        # "Directory": the node directory must exist, owned by uid 1000 (a created one is root's)
        {"name": CACHE_VOLUME, "hostPath": {"path": host_path, "type": "Directory"}},
        {"name": TMP_VOLUME, "emptyDir": {}},
    ]
    volumes += pull.volumes()
    if policy_secret:
        volumes.append({"name": POLICY_VOLUME, "secret": {"secretName": policy_secret, "defaultMode": 0o444}})
    if registry_secret:
        volumes.append(
            {
                "name": REGISTRY_AUTH_VOLUME,
                "secret": {
                    "secretName": registry_secret,
                    "defaultMode": 0o400,
                    "items": [{"key": ".dockerconfigjson", "path": "config.json"}],
                },
            }
        )
    metadata: dict[str, Any] = {"name": name, "annotations": {DIGEST_ANNOTATION: digest}}
    if namespace:
        metadata["namespace"] = namespace
    return {
        "apiVersion": f"{KSERVE_GROUP}/v1beta1",
        "kind": "InferenceService",
        "metadata": metadata,
        "spec": {"predictor": {"containers": [server], "volumes": volumes}},
    }


def local_model_cache(
    reference: str,
    *,
    name: str,
    node_group: str,
    model_size: str,
    node_selector: Mapping[str, str],
    local_path: str = "/var/lib/kserve/models",
    storage_class: str = "local-storage",
) -> list[dict[str, Any]]:
    """A LocalModelNodeGroup (a local PV on the selected nodes) and a LocalModelCache on it."""
    if not node_selector:
        raise K8sError("a node group needs at least one --node-selector KEY=VALUE")
    ref = pinned(reference)
    terms = [{"key": k, "operator": "In", "values": [v]} for k, v in sorted(node_selector.items())]
    group = {
        "apiVersion": f"{KSERVE_GROUP}/v1alpha1",
        "kind": "LocalModelNodeGroup",
        "metadata": {"name": node_group},
        "spec": {
            "storageLimit": model_size,
            "persistentVolumeSpec": {
                "accessModes": ["ReadWriteOnce"],
                "storageClassName": storage_class,
                "capacity": {"storage": model_size},
                "local": {"path": local_path},
                "persistentVolumeReclaimPolicy": "Delete",
                "nodeAffinity": {"required": {"nodeSelectorTerms": [{"matchExpressions": terms}]}},
            },
            "persistentVolumeClaimSpec": {
                "accessModes": ["ReadWriteOnce"],
                "resources": {"requests": {"storage": model_size}},
                "storageClassName": storage_class,
            },
        },
    }
    cache = {
        "apiVersion": f"{KSERVE_GROUP}/v1alpha1",
        "kind": "LocalModelCache",
        "metadata": {"name": name, "annotations": {DIGEST_ANNOTATION: str(ref.digest)}},
        "spec": {"sourceModelUri": storage_uri(ref), "modelSize": model_size, "nodeGroups": [node_group]},
    }
    return [group, cache]
