"""The generated Kubernetes objects, run by a real runtime that reads Kubernetes YAML: ``podman kube
play`` (Debian's podman 4.3), with the image ``make image`` builds, pushed to a loopback registry
by ``modelpack cp`` itself, signed by ``modelpack sign`` and named by digest in every object.

What podman 4.3 cannot read is replaced by its nearest equivalent, each in one helper (the list
is also in docs/kubernetes.md): ``secret`` volumes become ``configMap`` volumes of the same items
and ``secretKeyRef`` env its value (kube play 4.3 has no Secret kind); the downward API's
``spec.nodeName`` and ``status.podIP`` become the values the kubelet would give (kube play refuses
those paths), and ``$(VAR)``/``$$`` are expanded as the kubelet does (``kubelet_expansion``); the
peers' ``dns+http://`` Service name becomes the other "node's" loopback address (no cluster DNS)
and ``cache serve`` listens on 127.0.0.1 with a port per "node" (one host network); ``ports`` are
dropped (kube play maps them to host ports, refused on the host network) and so are annotation
values over 63 characters (the model digest's: kube play 4.3 applies the label limit to
annotations). Commands, arguments, images, users, mounts and read-only roots are the generated
ones. Where podman cannot run a container at all, the tests skip saying why.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.registry import RegistryServer, free_port
from tests.podman_helpers import (
    KubePlay,
    PublishedImage,
    build_image,
    inspect,
    kube_play,
    logs,
    modelpack_cli,
    podman,
    podman_missing,
    publish_image,
    wait_exit,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


def list_files(directory: str) -> list[str]:
    """What the main containers run: every file under ``directory`` (a shell word), with its sha256
    (e.g. ``"$MODELPACK_MODEL_DIR"``, which the shell expands)."""
    return ["sh", "-c", f"cd {directory} && find . -type f | sort | xargs -r sha256sum"]


def files_under(root: Path) -> dict[str, str]:
    """{"./relative/path": sha256} of every file under ``root`` (what ``list_files`` prints)."""
    return {
        f"./{p.relative_to(root)}": hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@dataclass(frozen=True)
class BuiltImage:
    local: str
    build_seconds: float


@pytest.fixture(scope="session")
def modelpack_image() -> BuiltImage:
    """``make image``'s image: built once per session, reused when its inputs are unchanged."""
    missing = podman_missing()
    if missing:
        pytest.skip(missing)
    local, seconds = build_image()
    probe = podman("run", "--rm", "--read-only", local, "--version", check=False)
    if probe.returncode != 0:
        reason = (probe.stderr.strip().splitlines() or [f"exit {probe.returncode}"])[-1]
        pytest.skip(f"podman cannot run a container here: {reason}")
    return BuiltImage(local, seconds)


@pytest.fixture(scope="session")
def published_image(
    modelpack_image: BuiltImage, registry: RegistryServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[PublishedImage]:
    """The image in the session registry, pushed and signed by modelpack, pinned by digest (the
    name podman pulled it under is removed afterwards; the local image stays for reuse)."""
    published = publish_image(
        modelpack_image.local, registry.host, "modelpack/modelpack", tmp_path_factory.mktemp("image")
    )
    yield published
    podman("rmi", published.reference, check=False)


@dataclass(frozen=True)
class SignedModel:
    reference: str  # host/repo@sha256:…
    digest: str
    policy_yaml: str
    files: dict[str, str]  # relative path -> sha256 of the checkpoint's files


def push_signed_model(checkpoint: Path, registry: RegistryServer, repository: str, work: Path) -> SignedModel:
    """Push ``checkpoint`` signed with a fresh key; the policy trusts that key for that repository
    only and requires a signature everywhere."""
    key = work / "model-signing"
    modelpack_cli("keygen", "--out", str(key))
    out = json.loads(
        modelpack_cli(
            "push", str(checkpoint), registry.ref(repository, "v1"), "--sign-key", f"{key}.key", "--json"
        )
    )
    digest = out["digest"]
    pem = Path(f"{key}.pub").read_text()
    policy = {
        "version": 1,
        "default": {"require_signature": True},
        "rules": [
            {
                "match": [f"{registry.host}/{repository}"],
                "require_signature": True,
                "keys": [{"pem": pem}],
            }
        ],
    }
    return SignedModel(
        f"{registry.host}/{repository}@{digest}", digest, json.dumps(policy), files_under(checkpoint)
    )


# ------------------------------------------------------------------ podman 4.3 equivalents
def policy_config_map(name: str, key: str, text: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}, "data": {key: text}}


def secret_volumes_as_config_maps(spec: dict[str, Any]) -> None:
    """kube play (4.3) mounts no Secret; a configMap volume of the same name and items does."""
    for volume in spec.get("volumes", []):
        if "secret" in volume:
            src = volume.pop("secret")
            volume["configMap"] = {
                "name": src["secretName"],
                **({"items": src["items"]} if "items" in src else {}),
            }


def secret_env_values(container: dict[str, Any], secrets: dict[str, dict[str, str]]) -> None:
    """``secretKeyRef`` env, as the kubelet would fill it in from the Secret's data."""
    for env in container.get("env", []):
        ref = env.get("valueFrom", {}).get("secretKeyRef")
        if ref is not None:
            env.pop("valueFrom")
            env["value"] = secrets[ref["name"]][ref["key"]]


def short_annotations(metadata: dict[str, Any]) -> None:
    """kube play (4.3) refuses an annotation value over 63 characters (a label's limit)."""
    annotations = metadata.get("annotations", {})
    for key in [k for k, v in annotations.items() if len(v) > 63]:
        del annotations[key]


def downward_api_values(container: dict[str, Any], values: dict[str, str]) -> None:
    """``spec.nodeName`` / ``status.podIP`` field refs, as the kubelet would fill them in."""
    for env in container.get("env", []):
        field = env.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
        if field in values:
            env.pop("valueFrom")
            env["value"] = values[field]


def listing(output: str) -> dict[str, str]:
    """``sha256sum`` lines as {path: digest}."""
    out = {}
    for line in output.splitlines():
        digest, _, path = line.partition("  ")
        if len(digest) == 64:
            out[path] = digest
    return out


@pytest.fixture
def pods() -> Iterator[list[KubePlay]]:
    """Plays to tear down (``kube down``) when the test ends."""
    played: list[KubePlay] = []
    yield played
    for play in played:
        play.down()


def unique(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(3)}"


def secrets_token() -> str:
    return secrets.token_urlsafe(24)


def init_container_pod(
    model: SignedModel, image: PublishedImage, name: str, *, policy_name: str
) -> list[dict[str, Any]]:
    pod = json.loads(
        modelpack_cli(
            "k8s", "init-container", model.reference, "--cache-volume", "emptyDir",
            "--policy-secret", policy_name, "--modelpack-image", image.reference,
            "--image", image.reference, "--name", name, "--json",
        )
    )  # fmt: skip
    short_annotations(pod["metadata"])
    spec = pod["spec"]
    spec["restartPolicy"] = "Never"
    secret_volumes_as_config_maps(spec)
    server = spec["containers"][0]
    # the serving container is the modelpack image itself, listing what it was given
    server["command"] = list_files('"$MODELPACK_MODEL_DIR"')
    return [policy_config_map(policy_name, "policy.yaml", model.policy_yaml), pod]


# ------------------------------------------------------------------ the tests
def test_image_pinned_by_digest_runs_as_uid_1000_without_compilers(
    modelpack_image: BuiltImage, published_image: PublishedImage
) -> None:
    """The image modelpack pushed and signed runs by its digest as uid 1000 on a read-only root,
    with the CLI's entry points and no compiler or pip; its size and build time are reported."""
    ref = published_image.reference
    podman("pull", "--quiet", "--tls-verify=false", ref)
    script = (
        "id -u; id -g; modelpack --version; modelpack storage-initializer --help >/dev/null && echo si; "
        "modelpack cache serve --help >/dev/null && echo serve; "
        "for c in cc gcc g++ clang make pip pip3; do command -v $c; done; "
        "touch /opt/x 2>/dev/null || echo read-only"
    )
    r = podman(
        "run", "--rm", "--read-only", "--read-only-tmpfs=false", "--entrypoint", "sh", ref, "-c", script
    )
    assert r.stdout.split() == ["1000", "1000", "modelpack,", "version", "0.1.0", "si", "serve", "read-only"]
    size = int(podman("image", "inspect", "--format", "{{.Size}}", ref).stdout.strip())
    print(
        f"\nimage {modelpack_image.local}: {size / 1e6:.0f} MB, build/reuse {modelpack_image.build_seconds:.0f} s"
    )
    assert size < 400e6


def test_init_container_pod_main_container_sees_exactly_the_signed_files(
    published_image: PublishedImage,
    registry: RegistryServer,
    checkpoint: Path,
    tmp_path: Path,
    pods: list[KubePlay],
) -> None:
    """``k8s init-container``'s pod: the init container (the image, uid 1000, read-only root) pulls
    and verifies under the policy into an emptyDir; the main container then lists exactly the
    signed files, byte for byte."""
    model = push_signed_model(checkpoint, registry, unique("podman/init"), tmp_path)
    name = unique("init-pod")
    objects = init_container_pod(model, published_image, name, policy_name=unique("model-trust"))
    start = time.monotonic()
    play = kube_play(objects, tmp_path / "pod.yaml")
    pods.append(play)
    assert play.result.returncode == 0, play.result.stderr
    assert wait_exit(f"{name}-server") == 0, logs(f"{name}-server")
    seconds = time.monotonic() - start
    assert listing(logs(f"{name}-server")) == model.files
    init = inspect(f"{name}-modelpack-pull")
    assert init["State"]["ExitCode"] == 0
    assert init["HostConfig"]["ReadonlyRootfs"] is True
    assert init["Config"]["User"] in ("1000", "1000:1000")
    print(f"\nkube play -> main container read verified files: {seconds:.1f} s")


def test_init_container_pod_fails_on_a_tampered_blob_with_the_refusal_in_its_log(
    published_image: PublishedImage,
    registry_factory: Any,
    checkpoint: Path,
    tmp_path: Path,
    pods: list[KubePlay],
) -> None:
    """A blob changed in the registry's storage after signing: the init container refuses it
    (its log names the mismatch), the pod fails and the main container never runs."""
    own = registry_factory.start()
    model = push_signed_model(checkpoint, own, "podman/tampered", tmp_path)
    layers = json.loads(modelpack_cli("inspect", model.reference, "--json"))["layers"]
    biggest = max(layers, key=lambda d: d["size"])
    blob = own.blob_data_path(biggest["digest"])
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))
    name = unique("tampered-pod")
    objects = init_container_pod(model, published_image, name, policy_name=unique("model-trust"))
    play = kube_play(objects, tmp_path / "pod.yaml")
    pods.append(play)
    assert play.result.returncode != 0 and "init container" in play.result.stderr, play.result
    assert wait_exit(f"{name}-modelpack-pull") == 1
    init_log = logs(f"{name}-modelpack-pull")
    assert f"expected {biggest['digest']}" in init_log and "refusing it" in init_log, init_log
    server = inspect(f"{name}-server")
    assert server["State"]["StartedAt"].startswith("0001-01-01"), "the main container ran"
    assert listing(logs(f"{name}-server")) == {}


def kserve_pod(
    csc: dict[str, Any], model: SignedModel, image: PublishedImage, name: str, cache: Path
) -> dict[str, Any]:
    """The pod KServe's webhook makes of an InferenceService whose storageUri is the model: the
    ClusterStorageContainer's container as the ``storage-initializer`` init container with
    ``SRC_URI DEST`` as its arguments and ``/mnt/models`` an emptyDir (``kserve-provision-location``)
    that the predictor mounts read-only; the volumes ``k8s kserve inferenceservice`` declares."""
    init = copy.deepcopy(csc["spec"]["container"])
    init["args"] = [f"modelpack://{model.reference}", "/mnt/models"]
    init["volumeMounts"] = [
        *init.get("volumeMounts", []),
        {"name": "kserve-provision-location", "mountPath": "/mnt/models"},
    ]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "restartPolicy": "Never",
            "initContainers": [init],
            "containers": [
                {
                    "name": "kserve-container",
                    "image": image.reference,
                    "command": list_files("/mnt/models"),
                    "volumeMounts": [
                        {"name": "kserve-provision-location", "mountPath": "/mnt/models", "readOnly": True}
                    ],
                }
            ],
            "volumes": [
                {"name": "modelpack-cache", "hostPath": {"path": str(cache), "type": "Directory"}},
                {"name": "modelpack-tmp", "emptyDir": {}},
                {"name": "modelpack-policy", "configMap": {"name": f"{name}-policy"}},
                {"name": "kserve-provision-location", "emptyDir": {}},
            ],
        },
    }


def test_kserve_storage_initializer_runs_as_the_cluster_storage_container_specifies(
    published_image: PublishedImage,
    registry: RegistryServer,
    checkpoint: Path,
    tmp_path: Path,
    pods: list[KubePlay],
) -> None:
    """``k8s kserve storage-containers``' initContainer spec, run as KServe runs it (its command
    and env, ``SRC_URI /mnt/models`` as arguments): uid 1000 on a read-only root, it verifies under
    the policy through the node cache and the predictor reads exactly the signed files."""
    model = push_signed_model(checkpoint, registry, unique("podman/kserve"), tmp_path)
    cscs = json.loads(
        modelpack_cli(
            "k8s", "kserve", "storage-containers", "--image", published_image.reference,
            "--policy-secret", "--plain-http", "--json",
        )
    )  # fmt: skip
    csc = next(c for c in cscs if c["spec"]["workloadType"] == "initContainer")
    assert csc["spec"]["container"]["image"] == published_image.reference
    name = unique("kserve-pod")
    cache = tmp_path / "node-cache"  # the node's cache, made by whoever set the node up
    cache.mkdir()
    os.chown(cache, 1000, 1000)
    objects = [
        policy_config_map(f"{name}-policy", "policy.yaml", model.policy_yaml),
        kserve_pod(csc, model, published_image, name, cache),
    ]
    start = time.monotonic()
    play = kube_play(objects, tmp_path / "pod.yaml")
    pods.append(play)
    assert play.result.returncode == 0, play.result.stderr + logs(f"{name}-storage-initializer")
    assert wait_exit(f"{name}-kserve-container") == 0
    seconds = time.monotonic() - start
    assert listing(logs(f"{name}-kserve-container")) == model.files
    init = inspect(f"{name}-storage-initializer")
    assert init["Config"]["User"] in ("1000", "1000:1000")
    assert init["HostConfig"]["ReadonlyRootfs"] is True
    spec = csc["spec"]["container"]
    assert [init["Path"], *init["Args"]] == [
        *spec["command"],
        f"modelpack://{model.reference}",
        "/mnt/models",
    ]
    assert {f"{e['name']}={e['value']}" for e in spec["env"]} <= set(init["Config"]["Env"])
    assert (cache / "snapshots" / model.digest.split(":", 1)[1]).is_dir()
    print(f"\nkube play -> predictor read verified files (KServe initializer): {seconds:.1f} s")


def prewarm_node_pod(
    daemonset: dict[str, Any],
    node: str,
    cache: Path,
    port: int,
    peer_port: int,
    secrets: dict[str, dict[str, str]],
) -> dict[str, Any]:
    """The DaemonSet's pod on ``node``: its cache at ``cache`` (the node's hostPath), ``cache serve``
    on 127.0.0.1:``port``, the other node's serve as its peer (the Service name, resolved)."""
    template = copy.deepcopy(daemonset["spec"]["template"])
    spec = template["spec"]
    spec.pop("nodeSelector", None)  # one machine plays every node
    secret_volumes_as_config_maps(spec)
    for volume in spec["volumes"]:
        if volume["name"] == "modelpack-cache":
            volume["hostPath"]["path"] = str(cache)
    generated_port = None
    for container in spec["containers"]:
        downward_api_values(container, {"spec.nodeName": node, "status.podIP": "127.0.0.1"})
        secret_env_values(container, secrets)
        for env in container.get("env", []):
            if env["name"] == "MODELPACK_MIRRORS":
                env["value"] = f"http://127.0.0.1:{peer_port}"
        if container["name"] == "peer-serve":
            listen = container["command"].index("--listen") + 1
            generated_port = int(container["command"][listen].rsplit(":", 1)[1])
            container["command"][listen] = f"127.0.0.1:{port}"
            del container["ports"]  # kube play 4.3 maps them to host ports, refused on the host network
            for check in ("httpGet", "tcpSocket"):
                if check in container.get("readinessProbe", {}):
                    container["readinessProbe"][check]["port"] = port
    assert generated_port is not None, "no peer-serve container"
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"{daemonset['metadata']['name']}-{node}",
            "labels": template["metadata"]["labels"],
        },
        "spec": spec,
    }


def wait_for_snapshot(cache: Path, digest: str, container: str, timeout: float = 180) -> Path:
    snapshot = cache / "snapshots" / digest.split(":", 1)[1]
    deadline = time.monotonic() + timeout
    while not snapshot.is_dir():
        assert time.monotonic() < deadline, f"no snapshot in {cache} after {timeout} s:\n{logs(container)}"
        time.sleep(0.5)
    return snapshot


def test_prewarm_daemonset_on_two_empty_nodes_second_fills_from_first_with_origin_stopped(
    published_image: PublishedImage,
    registry_factory: Any,
    checkpoint: Path,
    tmp_path: Path,
    pods: list[KubePlay],
) -> None:
    """``k8s prewarm --serve-peers``' pod template on two nodes with no cache yet: both pods start
    (pre-warm loop and ``cache serve --fill``, neither restarting); the first fills its node from
    the origin, the origin stops, and the second node fills from the first node's peer, verified
    under the policy, to the same files."""
    origin = registry_factory.start()
    model = push_signed_model(checkpoint, origin, "podman/prewarm", tmp_path)
    name = unique("prewarm")
    policy = unique("model-trust")
    secrets: dict[str, dict[str, str]] = {}
    token_args: list[str] = []
    if "--peer-token-secret" in modelpack_cli("k8s", "prewarm", "--help"):  # peers that require a token
        secrets[f"{name}-peers"] = {"token": secrets_token()}
        token_args = ["--peer-token-secret", f"{name}-peers"]
    listed = json.loads(
        modelpack_cli(
            "k8s", "prewarm", model.reference, "--node-selector", "modelpack.dev/node=test",
            "--serve-peers", "5050", "--interval", "10", "--policy-secret", policy,
            "--modelpack-image", published_image.reference, "--name", name, "--json", *token_args,
        )
    )  # fmt: skip
    daemonset = next(o for o in listed["items"] if o["kind"] == "DaemonSet")
    port_a, port_b = free_port(), free_port()
    nodes = {
        "node-a": (tmp_path / "node-a" / "cache", port_a, port_b),
        "node-b": (tmp_path / "node-b" / "cache", port_b, port_a),
    }
    config_map = policy_config_map(policy, "policy.yaml", model.policy_yaml)

    def play(node: str) -> None:
        cache, port, peer = nodes[node]
        result = kube_play(
            [config_map, prewarm_node_pod(daemonset, node, cache, port, peer, secrets)],
            tmp_path / f"{node}.yaml",
        )
        pods.append(result)
        assert result.result.returncode == 0, result.result.stderr

    play("node-a")
    snap_a = wait_for_snapshot(nodes["node-a"][0], model.digest, f"{name}-node-a-prewarm")
    assert files_under(snap_a) == model.files
    origin.stop()
    play("node-b")
    snap_b = wait_for_snapshot(nodes["node-b"][0], model.digest, f"{name}-node-b-prewarm")
    assert files_under(snap_b) == model.files
    assert origin.process.poll() is not None, "the origin is still up"
    for node in nodes:
        for container in ("prewarm", "peer-serve"):
            state = inspect(f"{name}-{node}-{container}")
            assert state["State"]["Running"], f"{node}/{container}:\n{logs(f'{name}-{node}-{container}')}"
            assert state["RestartCount"] == 0, (
                f"{node}/{container} restarted:\n{logs(f'{name}-{node}-{container}')}"
            )
