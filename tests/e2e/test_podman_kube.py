"""The generated Kubernetes objects, run by a real runtime that reads Kubernetes YAML: ``podman kube
play`` (Debian's podman 4.3), with the image ``make image`` builds, pushed to a loopback registry
by ``modelpack cp`` itself, signed by ``modelpack sign`` and named by digest in every object.

What podman 4.3 cannot read is replaced by its nearest equivalent, each in one helper below:
a ``secret`` volume becomes a ``configMap`` volume of the same items (kube play has no Secret
kind); the downward API's ``spec.nodeName`` and ``status.podIP`` become the values the kubelet
would give (kube play refuses those field paths); the peers' ``dns+http://`` Service name becomes
the other "node's" loopback address (no cluster DNS); ``cache serve`` listens on 127.0.0.1 (the
two "nodes" share the host's network, so each gets its own port); annotation values longer than 63
characters (the model digest's) are left out, since kube play 4.3 refuses them, applying the
limit of label values (Kubernetes limits annotations to 256 KiB in all). Commands, arguments, images,
users, mounts and read-only roots are the generated ones.
"""

from __future__ import annotations

import copy
import hashlib
import json
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.registry import RegistryServer, free_port
from tests.podman_helpers import (
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

# podman keeps an init container (and its log) after it ran only with this annotation
KEEP_INIT = {"io.podman.annotations.init.container.type": "always"}


def list_files(directory: str) -> list[str]:
    """What the main containers run: every file under ``directory`` (a shell word), with its sha256
    (the shell expands the variable: kube play 4.3 does not expand ``$(VAR)`` in arguments)."""
    return ["sh", "-c", f"cd {directory} && find . -type f | sort | xargs -r sha256sum"]


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
        pytest.skip(f"podman cannot run a container here: {probe.stderr.strip().splitlines()[-1:]}")
    return BuiltImage(local, seconds)


@pytest.fixture(scope="session")
def published_image(
    modelpack_image: BuiltImage, registry: RegistryServer, tmp_path_factory: pytest.TempPathFactory
) -> PublishedImage:
    """The image in the session registry, pushed and signed by modelpack, pinned by digest."""
    return publish_image(
        modelpack_image.local, registry.host, "modelpack/modelpack", tmp_path_factory.mktemp("image")
    )


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
    files = {
        f"./{p.relative_to(checkpoint)}": hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(checkpoint.rglob("*"))
        if p.is_file()
    }
    return SignedModel(f"{registry.host}/{repository}@{digest}", digest, json.dumps(policy), files)


# ------------------------------------------------------------------ podman 4.3 equivalents
def policy_config_map(name: str, key: str, text: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}, "data": {key: text}}


def secret_volumes_as_config_maps(spec: dict[str, Any]) -> None:
    """kube play (4.3) mounts no Secret; a configMap volume of the same name and items does."""
    for volume in spec.get("volumes", []):
        if "secret" in volume:
            src = volume.pop("secret")
            volume["configMap"] = {"name": src["secretName"], **({"items": src["items"]} if "items" in src else {})}


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
def pods() -> Iterator[list[Any]]:
    """Plays to tear down (``kube down``) when the test ends."""
    played: list[Any] = []
    yield played
    for play in played:
        play.down()


def unique(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(3)}"


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
    pod["metadata"].setdefault("annotations", {}).update(KEEP_INIT)
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
    r = podman("run", "--rm", "--read-only", "--read-only-tmpfs=false", "--entrypoint", "sh", ref, "-c", script)
    assert r.stdout.split() == ["1000", "1000", "modelpack,", "version", "0.1.0", "si", "serve", "read-only"]
    size = int(podman("image", "inspect", "--format", "{{.Size}}", ref).stdout.strip())
    print(f"\nimage {modelpack_image.local}: {size / 1e6:.0f} MB, build/reuse {modelpack_image.build_seconds:.0f} s")
    assert size < 400e6


def test_init_container_pod_main_container_sees_exactly_the_signed_files(
    published_image: PublishedImage,
    registry: RegistryServer,
    checkpoint: Path,
    tmp_path: Path,
    pods: list[Any],
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
    pods: list[Any],
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
