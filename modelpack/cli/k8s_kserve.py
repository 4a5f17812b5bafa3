"""``k8s kserve storage-containers|inferenceservice|localmodelcache``: KServe YAML on stdout.

The objects are built by ``modelpack.serving.kserve.manifests``; this module maps flags onto it
and prints them as one YAML stream (``---`` between objects) or a JSON list.
"""

from __future__ import annotations

from typing import Any

import click

from modelpack.cli.k8s_options import (
    SERVING_IMAGE_HELP,
    ca_options,
    mirror_retry_options,
    modelpack_image,
    modelpack_image_option,
    pod_pull_settings,
    served_model_name_option,
    serving_image,
)
from modelpack.cli.options import build_target_options, emit_json, handle_errors, json_option, target_options
from modelpack.mount.k8s import DEFAULT_CACHE_HOST_PATH, to_yaml


def _print(objects: list[dict[str, Any]], notes: list[str], as_json: bool) -> None:
    if as_json:
        emit_json(objects)
        return
    click.echo("---\n".join(to_yaml(obj, notes if i == 0 else ()) for i, obj in enumerate(objects)), nl=False)


def _pin(reference: str, resolve: bool, kwargs: dict[str, Any]) -> str:
    """``reference`` pinned by digest: as given, or (``--resolve``) the tag's digest now."""
    topts = build_target_options(kwargs)
    from modelpack.oci.reference import parse_reference

    ref = parse_reference(reference.removeprefix("modelpack://"))
    if ref.digest or not resolve:
        return str(ref)
    from modelpack.targets.opener import open_readable

    desc = open_readable(ref, topts).resolve(ref.identifier)
    return str(ref.with_tag(None).with_digest(desc.digest))


@click.group("kserve")
def kserve_group() -> None:
    """KServe objects serving ModelPack artifacts through 'modelpack storage-initializer'.

    \b
    Examples:
      modelpack k8s kserve storage-containers --policy-secret --modelpack-image IMAGE | kubectl apply -f -
      modelpack k8s kserve inferenceservice reg.example/models/llama:v1 --resolve --name llama --image IMAGE
      modelpack k8s kserve localmodelcache reg.example/models/llama@sha256:… --name llama \\
          --node-group gpu-nodes --model-size 20Gi --node-selector nvidia.com/gpu.present=true
    """


@kserve_group.command("storage-containers")
@click.option("--name", default="modelpack", show_default=True, help="Name of the initContainer CSC.")
@modelpack_image_option("--image")
@click.option("--prefix", default="modelpack://", show_default=True, help="storageUri prefix they serve.")
@click.option("--policy-secret", is_flag=True, help="Mount the trust policy Secret the pods declare.")
@click.option("--registry-secret", is_flag=True, help="Mount the registry pull Secret the pods declare.")
@click.option(
    "--job-policy-configmap", default=None, help="ConfigMap (download-job namespace) with the policy text."
)
@click.option("--policy-key", default="policy.yaml", show_default=True)
@mirror_retry_options
@ca_options
@json_option
@handle_errors
def kserve_storage_containers(as_json: bool, **kwargs: Any) -> None:
    """The two ClusterStorageContainers (initContainer, localModelDownloadJob) for the prefix.

    \b
    Example:
      modelpack k8s kserve storage-containers --policy-secret --registry-secret --modelpack-image IMAGE > csc.yaml
    """
    from modelpack.serving.kserve.manifests import storage_containers

    pull = pod_pull_settings(kwargs, registry_secret=None)  # no -u here: the Secret is declared by pods
    for key in ("mirrors", "plain_http", "retry_for"):
        kwargs.pop(key)
    kwargs["image"] = modelpack_image(kwargs.pop("modelpack_image"))
    notes = []
    if pull.ca_configmap:
        notes.append(
            f"Pods must declare the ConfigMap volume 'registry-ca' ({pull.ca_configmap}): 'k8s kserve "
            "inferenceservice --ca-configmap' does. The localModelDownloadJob gets no volumes of ours: "
            "give it the CA through KServe's storage CA bundle."
        )
    _print(
        storage_containers(pull=pull, **kwargs),
        [
            "ClusterStorageContainers: KServe runs 'modelpack storage-initializer SRC_URI DEST …' for "
            f"storageUris starting {kwargs['prefix']}.",
            "The initContainer one mounts volumes every pod must declare ('k8s kserve inferenceservice' does).",
            *notes,
        ],
        as_json,
    )


@kserve_group.command("inferenceservice")
@click.argument("reference")
@click.option("--name", required=True, help="InferenceService name.")
@click.option("--namespace", default=None)
@click.option(
    "--weights",
    type=click.Choice(["initializer", "stream"]),
    default="initializer",
    show_default=True,
    help="initializer: files at /mnt/models; stream: vLLM reads the weights from the registry.",
)
@click.option("--image", required=True, metavar="IMAGE", help=SERVING_IMAGE_HELP)
@click.option("--tensor-parallel-size", "tp_size", type=click.IntRange(1, 1024), default=1, show_default=True)
@click.option("--host-path", default=DEFAULT_CACHE_HOST_PATH, show_default=True, help="Node cache directory.")
@click.option("--policy-secret", default=None, help="Secret holding the trust policy (and keys).")
@click.option("--registry-secret", default=None, help="kubernetes.io/dockerconfigjson Secret.")
@click.option("--policy-key", default="policy.yaml", show_default=True)
@click.option("--resolve", is_flag=True, help="Resolve a tag to its digest now (needs registry access).")
@served_model_name_option
@ca_options
@target_options
@json_option
@handle_errors
def kserve_inferenceservice(reference: str, resolve: bool, as_json: bool, **kwargs: Any) -> None:
    """An InferenceService running vLLM on REFERENCE, pinned by digest.

    \b
    Example:
      modelpack k8s kserve inferenceservice reg.example/models/llama@sha256:… --name llama --image IMAGE
    """
    opts = {k: kwargs.pop(k) for k in ("name", "namespace", "weights", "image", "tp_size", "host_path")}
    opts.update(
        {k: kwargs.pop(k) for k in ("policy_secret", "registry_secret", "policy_key", "served_model_name")}
    )
    opts["image"] = serving_image(opts["image"])
    pull = pod_pull_settings(kwargs, registry_secret=opts["registry_secret"])
    if opts["weights"] == "initializer" and (pull.mirrors or pull.retry_for is not None):
        raise click.UsageError(
            "--mirror/--retry-for: with --weights initializer the storage initializer pulls, and its "
            "settings are the ClusterStorageContainer's: give them to 'k8s kserve storage-containers'"
        )
    ref = _pin(reference, resolve, kwargs)
    from modelpack.serving.kserve.manifests import inference_service

    obj = inference_service(ref, pull=pull, **opts)
    _print(
        [obj], ["InferenceService: the storage initializer verifies every file before vLLM starts."], as_json
    )


@kserve_group.command("localmodelcache")
@click.argument("reference")
@click.option("--name", required=True, help="LocalModelCache name.")
@click.option("--node-group", required=True, help="LocalModelNodeGroup name.")
@click.option("--model-size", required=True, help="Size of the model (e.g. 20Gi): the PV and PVC size.")
@click.option("--node-selector", "selectors", multiple=True, required=True, metavar="KEY=VALUE")
@click.option("--local-path", default="/var/lib/kserve/models", show_default=True, help="Node directory.")
@click.option("--storage-class", default="local-storage", show_default=True)
@click.option("--resolve", is_flag=True, help="Resolve a tag to its digest now (needs registry access).")
@target_options
@json_option
@handle_errors
def kserve_localmodelcache(
    reference: str, selectors: tuple[str, ...], resolve: bool, as_json: bool, **kwargs: Any
) -> None:
    """A LocalModelNodeGroup and a LocalModelCache that pre-warm REFERENCE on its nodes.

    \b
    Example:
      modelpack k8s kserve localmodelcache reg.example/m@sha256:… --name m --node-group gpu \\
          --model-size 20Gi --node-selector gpu=h100
    """
    node_selector: dict[str, str] = {}
    for s in selectors:
        key, sep, value = s.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{s!r}: expected KEY=VALUE", param_hint="--node-selector")
        node_selector[key] = value
    opts = {k: kwargs.pop(k) for k in ("name", "node_group", "model_size", "local_path", "storage_class")}
    ref = _pin(reference, resolve, kwargs)
    from modelpack.serving.kserve.manifests import local_model_cache

    _print(
        local_model_cache(ref, node_selector=node_selector, **opts),
        [
            "LocalModelCache: the LocalModelNode agent runs the localModelDownloadJob storage container on each node.",
            "InferenceServices use the cache only when their storageUri is this exact (digest-pinned) URI.",
        ],
        as_json,
    )
