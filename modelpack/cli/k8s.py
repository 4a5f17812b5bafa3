"""``k8s pod|init-container|prewarm``: Kubernetes YAML that mounts, pulls or pre-warms a model.

The manifests are built by ``modelpack.mount.k8s``; this module only maps flags onto it and
prints YAML (or JSON), after validating the object so a typo never reaches ``kubectl apply``.
"""

from __future__ import annotations

from typing import Any

import click

from modelpack.cli.k8s_kserve import kserve_group
from modelpack.cli.k8s_options import (
    SERVING_IMAGE_HELP,
    ca_options,
    modelpack_image,
    modelpack_image_option,
    pod_pull_settings,
    served_model_name_option,
    serving_image,
)
from modelpack.cli.options import build_target_options, emit_json, handle_errors, json_option, target_options
from modelpack.mount import k8s


def parse_reference(text: str) -> Any:
    from modelpack.oci.reference import parse_reference as parse

    return parse(text)


def _resolve_if_asked(reference: str, resolve: bool, kwargs: dict[str, Any]) -> str:
    topts = build_target_options(kwargs)
    if not resolve:
        return reference
    from modelpack.oci.reference import parse_reference
    from modelpack.targets.opener import open_readable

    ref = parse_reference(reference)
    if ref.digest:
        return reference
    desc = open_readable(ref, topts).resolve(ref.identifier)
    return str(ref.with_tag(None).with_digest(desc.digest))


def vllm_options(f: Any) -> Any:
    """``--vllm`` (the serving container runs vLLM with the ``modelpack`` load format) and its TP size."""
    f = click.option(
        "--tensor-parallel-size",
        "tp_size",
        type=click.IntRange(1, 1024),
        default=1,
        show_default=True,
        help="vLLM tensor parallelism (with --vllm); each rank reads only its share.",
    )(f)
    return click.option(
        "--vllm",
        is_flag=True,
        help="Run vLLM in the serving container, weights through the 'modelpack' load format (pinned digest).",
    )(f)


def _as_vllm(
    obj: dict[str, Any],
    notes: list[str],
    model_dir: str,
    annotations: dict[str, str],
    trust: str,
    tp: int,
    served_name: str,
    extra_args: list[str] | None = None,
) -> tuple[dict[str, Any], list[str]]:
    from modelpack.serving.k8s_vllm import VLLM_POD_NOTES, vllm_server_pod

    digest = annotations["modelpack.dev/model-digest"]
    pod = vllm_server_pod(
        obj,
        model_dir=model_dir,
        digest=digest,
        trust=trust,
        tp_size=tp,
        served_model_name=served_name,
        extra_args=extra_args or (),
    )
    return pod, [*notes, *VLLM_POD_NOTES]


def replicas_option(f: Any) -> Any:
    return click.option(
        "--replicas",
        type=click.IntRange(1, 10000),
        default=None,
        help="Print a Deployment of this many replicas whose template is the Pod.",
    )(f)


def _emit(obj: dict[str, Any], notes: list[str], as_json: bool, replicas: int | None = None) -> None:
    if replicas is not None:
        obj = k8s.as_deployment(obj, replicas)
    k8s.validate(obj)
    if as_json:
        emit_json(obj)
    else:
        click.echo(k8s.to_yaml(obj, notes), nl=False)


@click.group("k8s")
def k8s_group() -> None:
    """Kubernetes YAML (stdout) for image volumes, init-container pulls and pre-warming.

    \b
    Example:
      export MODELPACK_IMAGE=reg.example/platform/modelpack@sha256:…   # yours; no default
      modelpack k8s pod --image-volume localhost:5000/models/llama:v1 --resolve --image IMAGE | kubectl apply -f -
    """


k8s_group.add_command(kserve_group)


@k8s_group.command("pod")
@click.option("--image-volume", "reference", required=True, help="Model reference, pinned by digest.")
@click.option("--mount-path", default="/models", show_default=True)
@click.option(
    "--pull-policy", type=click.Choice(k8s.PULL_POLICIES), default="IfNotPresent", show_default=True
)
@click.option("--image", required=True, metavar="IMAGE", help=SERVING_IMAGE_HELP)
@click.option("--name", default=None, help="Pod name (default: from the repository).")
@click.option("--namespace", default=None)
@click.option("--resolve", is_flag=True, help="Resolve a tag to its digest now (needs registry access).")
@vllm_options
@served_model_name_option
@replicas_option
@target_options
@json_option
@handle_errors
def k8s_pod(
    reference: str,
    mount_path: str,
    pull_policy: str,
    image: str,
    name: str | None,
    namespace: str | None,
    resolve: bool,
    vllm: bool,
    tp_size: int,
    served_model_name: str | None,
    replicas: int | None,
    as_json: bool,
    **kwargs: Any,
) -> None:
    """A Pod that mounts the model as an image volume (kubelet pulls it read-only).

    \b
    Runtime needs: CRI-O >= 1.33 mounts the raw ModelPack artifact;
    containerd >= 2.1 needs the image-shaped variant (modelpack push --format image).

    \b
    Example:
      modelpack k8s pod --image-volume localhost:5000/models/llama:v1 --resolve --image IMAGE > pod.yaml
      modelpack k8s pod --image-volume reg.example/models/llama@sha256:… --vllm --image IMAGE --replicas 2
    """
    if kwargs.get("mirrors") or kwargs.get("hosts_dir"):
        raise click.UsageError(
            "--mirror/--hosts-dir: the kubelet and the container runtime pull an image volume; "
            "configure mirrors in the runtime (containerd hosts.toml, CRI-O registries.conf)"
        )
    image = serving_image(image)
    ref = _resolve_if_asked(reference, resolve, kwargs)
    obj = k8s.image_volume_pod(
        ref, mount_path=mount_path, pull_policy=pull_policy, image=image, name=name, namespace=namespace
    )
    notes = list(k8s.IMAGE_VOLUME_NOTES)
    if vllm:
        served = served_model_name or k8s.served_model_name(parse_reference(ref))
        obj, notes = _as_vllm(
            obj, notes, mount_path, obj["metadata"]["annotations"], "runtime", tp_size, served
        )
    _emit(obj, notes, as_json, replicas)


@k8s_group.command("init-container")
@click.argument("reference")
@click.option(
    "--cache-path", default=k8s.DEFAULT_CACHE_MOUNT, show_default=True, help="Cache mount in the pod."
)
@click.option(
    "--cache-volume", type=click.Choice(["hostPath", "emptyDir"]), default="hostPath", show_default=True
)
@click.option("--host-path", default=k8s.DEFAULT_CACHE_HOST_PATH, show_default=True, help="Node directory.")
@click.option("--size-limit", default=None, help="emptyDir sizeLimit (e.g. 200Gi).")
@click.option("--policy-secret", default=None, help="Secret holding the trust policy (and keys).")
@click.option(
    "--policy-key", default="policy.yaml", show_default=True, help="Policy file name in that Secret."
)
@click.option(
    "--registry-secret", default=None, help="kubernetes.io/dockerconfigjson Secret for the registry."
)
@modelpack_image_option()
@click.option("--image", required=True, metavar="IMAGE", help=SERVING_IMAGE_HELP)
@click.option("--name", default=None)
@click.option("--namespace", default=None)
@click.option("--resolve", is_flag=True, help="Resolve a tag to its digest now (needs registry access).")
@click.option(
    "--adapter",
    "adapter_refs",
    multiple=True,
    metavar="REF",
    help="With --vllm: also pull the LoRA adapter REF (its subject must be this model; checked now, "
    "pinned) and serve it (--enable-lora --lora-modules NAME=its snapshot). Needs registry access.",
)
@vllm_options
@served_model_name_option
@replicas_option
@ca_options
@target_options
@json_option
@handle_errors
def k8s_init_container(
    reference: str,
    resolve: bool,
    vllm: bool,
    tp_size: int,
    served_model_name: str | None,
    replicas: int | None,
    as_json: bool,
    **kwargs: Any,
) -> None:
    """A Pod whose init container runs 'modelpack pull --cache' (verified, signature-checked).

    \b
    Example:
      modelpack k8s init-container localhost:5000/models/llama:v1 --resolve --size-limit 20Gi --image IMAGE
      modelpack k8s init-container reg.example/models/llama@sha256:… --vllm --image IMAGE --replicas 4 \\
          --mirror http://mirror:5000 --ca-configmap registry-ca --retry-for 5m
      modelpack k8s init-container reg.example/models/llama@sha256:… --vllm --image IMAGE --adapter reg.example/models/llama:sql-lora
    """
    adapter_refs = kwargs.pop("adapter_refs", ())
    if adapter_refs and not vllm:
        raise click.UsageError("--adapter serves LoRA adapters with vLLM: add --vllm")
    opts = {
        k: kwargs.pop(k)
        for k in (
            "cache_path",
            "cache_volume",
            "host_path",
            "size_limit",
            "policy_secret",
            "policy_key",
            "registry_secret",
            "modelpack_image",
            "image",
            "name",
            "namespace",
        )
    }
    opts["modelpack_image"] = modelpack_image(opts["modelpack_image"])
    opts["image"] = serving_image(opts["image"])
    pull = pod_pull_settings(kwargs, registry_secret=opts["registry_secret"])
    lora_args: list[str] = []
    if adapter_refs:
        from modelpack.serving.lora_adapters import adapters_for_pod, vllm_lora_args

        topts = build_target_options(dict(kwargs))
        ref = _resolve_if_asked(reference, True, kwargs)
        pinned, served = adapters_for_pod(ref, adapter_refs, opts["cache_path"], topts)
        lora_args = vllm_lora_args(served)
        obj = k8s.init_container_pod(ref, adapters=pinned, pull=pull, **opts)
    else:
        ref = _resolve_if_asked(reference, resolve, kwargs)
        obj = k8s.init_container_pod(ref, pull=pull, **opts)
    notes = [
        "Init container: pulls, verifies digests (and signatures with --policy-secret), publishes a snapshot.",
        "The serving container reads $MODELPACK_MODEL_DIR (read-only); hostPath caches are shared per node.",
    ]
    if vllm:
        digest_hex = obj["metadata"]["annotations"]["modelpack.dev/model-digest"].split(":", 1)[1]
        snapshot = k8s.snapshot_path(opts["cache_path"], digest_hex)  # not the escaped env value
        served_name = served_model_name or k8s.served_model_name(parse_reference(ref))
        obj, notes = _as_vllm(
            obj, notes, snapshot, obj["metadata"]["annotations"], "snapshot", tp_size, served_name, lora_args
        )
    _emit(obj, notes, as_json, replicas)


@k8s_group.command("prewarm")
@click.argument("references", nargs=-1, required=True)
@click.option("--node-selector", "selectors", multiple=True, required=True, metavar="KEY=VALUE")
@click.option("--host-path", default=k8s.DEFAULT_CACHE_HOST_PATH, show_default=True)
@click.option(
    "--interval", "interval_s", type=click.IntRange(10), default=300, show_default=True, help="Seconds."
)
@click.option("--policy-secret", default=None)
@click.option("--policy-key", default="policy.yaml", show_default=True)
@click.option("--registry-secret", default=None)
@modelpack_image_option()
@click.option("--name", default="modelpack-prewarm", show_default=True)
@click.option("--namespace", default=None)
@click.option("--tolerate-all", is_flag=True, help="Also run on tainted (e.g. GPU) nodes.")
@click.option(
    "--serve-peers",
    "serve_port",
    type=click.IntRange(1, 65535),
    default=None,
    metavar="PORT",
    help="Also run 'cache serve' on PORT in each pod and pull from the other nodes first "
    "(a headless Service NAME-peers is emitted too, before the DaemonSet). Needs --peer-token-secret.",
)
@click.option(
    "--peer-token-secret",
    default=None,
    metavar="NAME",
    help="With --serve-peers: a Secret whose key 'token' the peer servers require "
    "(MODELPACK_SERVE_TOKEN) and the pulls present (MODELPACK_PEER_TOKEN).",
)
@ca_options
@target_options
@json_option
@handle_errors
def k8s_prewarm(
    references: tuple[str, ...], selectors: tuple[str, ...], as_json: bool, **kwargs: Any
) -> None:
    """A DaemonSet that keeps REFERENCES pulled in the node cache of the selected nodes.

    \b
    Example:
      modelpack k8s prewarm localhost:5000/models/llama@sha256:… --node-selector gpu=h20 \\
          --serve-peers 5050 --peer-token-secret modelpack-peer-token
    """
    node_selector: dict[str, str] = {}
    for s in selectors:
        key, sep, value = s.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{s!r}: expected KEY=VALUE", param_hint="--node-selector")
        node_selector[key] = value
    port = kwargs.get("serve_port")
    if port is not None and not kwargs.get("peer_token_secret"):
        raise click.UsageError(
            "--serve-peers needs --peer-token-secret NAME: a Secret with key 'token' "
            "(kubectl create secret generic NAME --from-literal=token=$(openssl rand -hex 32)); "
            "the peers serve the cached models to holders of that token only"
        )
    if kwargs.get("peer_token_secret") and port is None:
        raise click.UsageError("--peer-token-secret goes with --serve-peers PORT")
    pull = pod_pull_settings(kwargs, registry_secret=kwargs.get("registry_secret"))
    build_target_options(kwargs)  # the connection flags are carried by ``pull``; nothing is resolved
    kwargs["modelpack_image"] = modelpack_image(kwargs["modelpack_image"])
    obj = k8s.prewarm_daemonset(list(references), node_selector=node_selector, pull=pull, **kwargs)
    notes = ["Pre-warm: re-pulls every interval; a cached digest is a hit (no transfer, no hashing)."]
    if port is None:
        _emit(obj, notes, as_json)
        return
    service = k8s.peers_service(kwargs["name"], kwargs.get("namespace"), port)
    k8s.validate(service)
    k8s.validate(obj)
    notes.append(
        f"Port {port} serves the verified blobs of this node's cached models (by digest, read-only; "
        f"fills only the pinned ones) to holders of the token in Secret {kwargs['peer_token_secret']} "
        "(key 'token'); keep it inside the cluster network."
    )
    notes.append(
        f"Peers: each pod serves its node's cache on port {port} (read-only, digests only) and pulls "
        f"ask the other nodes first ({k8s.peers_url(kwargs['name'], kwargs.get('namespace'), port)}), the "
        "origin last. For containerd, list peers in /etc/containerd/certs.d/<registry>/hosts.toml with "
        'capabilities = ["pull"] (see docs/distribution.md).'
    )
    if as_json:
        emit_json({"apiVersion": "v1", "kind": "List", "items": [service, obj]})
    else:
        click.echo(k8s.to_yaml(service) + "---\n" + k8s.to_yaml(obj, notes), nl=False)
