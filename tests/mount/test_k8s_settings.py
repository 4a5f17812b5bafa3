"""Generated Kubernetes objects carry every setting the user gave, or refuse it with a message.

The modelpack image and the serving image are the user's (a flag or ``MODELPACK_IMAGE``; no
default in anyone's namespace). Every pull setting (mirrors, plain HTTP, a CA bundle, the retry
budget, the timeout, the policy, credentials) reaches each container that pulls, as the settings
``modelpack pull`` reads (checked by reading the container's environment back through
``TargetOptions.from_environ``, and by running the generated pull against a TLS registry). vLLM
serves the model under its repository's name. Peer serving needs a token Secret.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner
from modelpack.mount import k8s

from modelpack.api import transfer
from modelpack.cli import main
from modelpack.targets.options import TargetOptions
from tests.fixtures.registry import RegistryServer
from tests.mount.test_k8s import kubelet_view

DIGEST = "sha256:" + "ab" * 32
REF = f"registry.example.com/team-a/llama@{DIGEST}"
IMAGE = "registry.example.com/tools/modelpack@sha256:" + "cd" * 32
SERVING = "registry.example.com/tools/vllm-modelpack@sha256:" + "ef" * 32
PIN = ["--modelpack-image", IMAGE]


def _run(args: list[str], env: dict[str, str] | None = None) -> Any:
    return CliRunner().invoke(main, args, env={"MODELPACK_IMAGE": None, **(env or {})})


def _docs(output: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(output) if d]


def _container(objs: list[dict[str, Any]], name: str) -> dict[str, Any]:
    for obj in objs:
        spec = obj["spec"].get("template", {}).get("spec") or obj["spec"]
        spec = spec.get("predictor", spec)
        for c in [*spec.get("initContainers", []), *spec.get("containers", [])]:
            if c["name"] == name:
                return dict(c)
        if obj["kind"] == "ClusterStorageContainer" and obj["metadata"]["name"] == name:
            return dict(obj["spec"]["container"])
    raise AssertionError(f"no container {name}")


# ------------------------------------------------------------------------------ the images
@pytest.mark.parametrize(
    "argv",
    [
        ["k8s", "init-container", REF, "--image", SERVING],
        ["k8s", "prewarm", REF, "--node-selector", "gpu=yes"],
        ["k8s", "kserve", "storage-containers"],
    ],
    ids=["init-container", "prewarm", "kserve-storage-containers"],
)
def test_no_modelpack_image_is_a_usage_error_naming_the_flag_and_setting(argv: list[str]) -> None:
    """Without ``--modelpack-image`` or ``MODELPACK_IMAGE`` the command refuses (exit 2): no
    default image in someone else's namespace ever lands in a pod."""
    res = _run(argv)
    assert res.exit_code == 2, res.output
    assert "--modelpack-image" in res.output and "MODELPACK_IMAGE" in res.output
    assert not hasattr(k8s, "DEFAULT_MODELPACK_IMAGE")
    for module in Path(k8s.__file__).parent.glob("k8s*.py"):
        assert "ghcr.io" not in module.read_text(), module


def test_modelpack_image_from_the_setting_and_a_tag_is_accepted_with_a_warning() -> None:
    """``MODELPACK_IMAGE`` is used when the flag is absent; a digest is taken silently, a tag
    with a warning on stderr (two nodes could run different code)."""
    res = _run(["k8s", "prewarm", REF, "--node-selector", "gpu=yes"], env={"MODELPACK_IMAGE": IMAGE})
    assert res.exit_code == 0, res.output
    assert _container(_docs(res.stdout), "prewarm")["image"] == IMAGE and "warning" not in res.stderr
    tagged = "registry.example.com/tools/modelpack:1.0"
    res = _run(["k8s", "init-container", REF, "--image", SERVING, "--modelpack-image", tagged])
    assert res.exit_code == 0, res.output
    assert _container(_docs(res.stdout), "modelpack-pull")["image"] == tagged
    assert "warning" in res.stderr and "digest" in res.stderr
    bad = _run(["k8s", "prewarm", REF, "--node-selector", "a=b", "--modelpack-image", "not an image"])
    assert bad.exit_code == 2, bad.output


@pytest.mark.parametrize(
    "argv",
    [
        ["k8s", "pod", "--image-volume", REF],
        ["k8s", "init-container", REF, *PIN],
        ["k8s", "kserve", "inferenceservice", REF, "--name", "llama"],
    ],
    ids=["image-volume", "init-container", "inferenceservice"],
)
def test_the_serving_image_is_required(argv: list[str]) -> None:
    """The serving container's image is the user's (stock vllm/vllm-openai cannot run the
    ``modelpack`` load format): without ``--image`` the command refuses, with it the image is used."""
    res = _run(argv)
    assert res.exit_code == 2 and "--image" in res.output, res.output
    res = _run([*argv, "--image", SERVING])
    assert res.exit_code == 0, res.output
    assert SERVING in res.stdout and "vllm/vllm-openai" not in res.stdout


# ------------------------------------------------------------------------------ pull settings
SETTINGS_ARGS = [
    "--mirror",
    "http://mirror-a:5000",
    "--mirror",
    "https://mirror-b",
    "--plain-http",
    "--retry-for",
    "2m",
    "--ca-configmap",
    "registry-ca",
]


def _pulls_with(container: dict[str, Any], *, mirrors: list[str]) -> None:
    """The container's environment, as ``modelpack pull`` reads it, holds every setting."""
    env, _ = kubelet_view(container)
    opts = TargetOptions.from_environ(env)
    assert opts.mirrors == mirrors
    assert opts.plain_http is True
    assert opts.retry_for == 120.0
    assert opts.timeout == 7.0
    assert opts.ca_file == "/etc/modelpack/ca/ca.crt"
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == "/etc/modelpack/ca")
    assert mount["readOnly"] is True


def _ca_volume(objs: list[dict[str, Any]]) -> dict[str, Any]:
    for obj in objs:
        spec = obj["spec"].get("template", {}).get("spec") or obj["spec"]
        spec = spec.get("predictor", spec)
        for v in spec.get("volumes", []):
            if "configMap" in v:
                return dict(v)
    raise AssertionError("no CA volume")


def test_init_container_carries_every_pull_setting() -> None:
    """``--mirror``, ``--plain-http``, ``--ca-configmap``, ``--retry-for`` and ``--timeout`` reach
    the init container (they were accepted and dropped); the policy and credentials still do."""
    args = ["--timeout", "7", "k8s", "init-container", REF, *PIN, "--image", SERVING, *SETTINGS_ARGS]
    res = _run([*args, "--policy-secret", "trust", "--registry-secret", "regcred", "--vllm"])
    assert res.exit_code == 0, res.output
    objs = _docs(res.stdout)
    init = _container(objs, "modelpack-pull")
    _pulls_with(init, mirrors=["http://mirror-a:5000", "https://mirror-b"])
    assert _ca_volume(objs)["configMap"]["name"] == "registry-ca"
    env, cmd = kubelet_view(init)
    assert "--policy /etc/modelpack/policy/policy.yaml" in cmd[2]
    assert env["DOCKER_CONFIG"] == "/etc/modelpack/docker"
    k8s.validate(objs[0])


def test_prewarm_carries_every_pull_setting_to_its_pulls_and_its_fills() -> None:
    """``k8s prewarm`` takes the pull settings (it had no such flags): the pulling container gets
    them all (the peers first among its mirrors), the filling ``cache serve`` the origin's."""
    args = ["--timeout", "7", "k8s", "prewarm", REF, "--node-selector", "gpu=yes", *PIN, *SETTINGS_ARGS]
    res = _run([*args, "--serve-peers", "5050", "--peer-token-secret", "peer-token"])
    assert res.exit_code == 0, res.output
    objs = _docs(res.stdout)
    peers = "dns+http://modelpack-prewarm-peers:5050"
    _pulls_with(_container(objs, "prewarm"), mirrors=[peers, "http://mirror-a:5000", "https://mirror-b"])
    serve = _container(objs, "peer-serve")
    env, _ = kubelet_view(serve)
    opts = TargetOptions.from_environ(env)
    assert (opts.plain_http, opts.ca_file, opts.timeout) == (True, "/etc/modelpack/ca/ca.crt", 7.0)
    assert opts.mirrors == []  # a fill asks the origin, never the peers that ask it
    for obj in objs:
        k8s.validate(obj)


def test_kserve_objects_carry_every_pull_setting() -> None:
    """The storage initializer (ClusterStorageContainer) and a streaming vLLM get the settings."""
    res = _run(["--timeout", "7", "k8s", "kserve", "storage-containers", *PIN, *SETTINGS_ARGS])
    assert res.exit_code == 0, res.output
    objs = _docs(res.stdout)
    _pulls_with(_container(objs, "modelpack"), mirrors=["http://mirror-a:5000", "https://mirror-b"])
    args = ["--timeout", "7", "k8s", "kserve", "inferenceservice", REF, "--name", "llama"]
    args += ["--image", SERVING, "--weights", "stream", *SETTINGS_ARGS, "--registry-secret", "regcred"]
    res = _run(args)
    assert res.exit_code == 0, res.output
    [isvc] = _docs(res.stdout)
    server = _container([isvc], "kserve-container")
    _pulls_with(server, mirrors=["http://mirror-a:5000", "https://mirror-b"])
    env, cmd = kubelet_view(server)
    extra = cmd[cmd.index("--model-loader-extra-config") + 1]
    assert '"ca_file": "/etc/modelpack/ca/ca.crt"' in extra and '"plain_http": true' in extra
    assert env["DOCKER_CONFIG"]  # streaming vLLM reads the registry with the pod's credentials


@pytest.mark.parametrize(
    ("extra", "names"),
    [
        (["--ca-file", __file__], "--ca-configmap"),
        (["--hosts-dir", "/etc/containerd/certs.d"], "--hosts-dir"),
        (["-u", "bot"], "--registry-secret"),
        (["--policy", __file__], "--policy-secret"),
        (["--mirror", "http://a b,c"], "--mirror"),
        (["--ca-configmap", "ca", "--ca-key", "../../etc/shadow"], "--ca-key"),
    ],
    ids=[
        "ca-file-without-configmap",
        "hosts-dir",
        "username",
        "policy-file",
        "hostile-mirror",
        "ca-key-path",
    ],
)
def test_settings_a_pod_cannot_carry_are_refused_naming_what_to_use(extra: list[str], names: str) -> None:
    """A setting that cannot reach the pod as given is a usage error that says what to use."""
    for argv in (
        ["k8s", "init-container", REF, *PIN, "--image", SERVING],
        ["k8s", "prewarm", REF, "--node-selector", "a=b", *PIN],
    ):
        res = CliRunner().invoke(main, [*argv, *extra], input="pw\n")
        assert res.exit_code == 2, res.output
        assert names in res.output


def test_the_generated_pull_honours_the_ca_bundle_against_a_tls_registry(
    tls_registry: RegistryServer, checkpoint: Path, tmp_path: Path
) -> None:
    """The init container's command, run with its environment (the CA path pointed at the
    registry's CA), pulls from a TLS registry whose CA no trust store holds; without the CA
    setting the same command fails on TLS."""
    assert tls_registry.ca_file is not None
    ref = tls_registry.ref("k8s/model", "v1")
    pushed = transfer.push(
        str(checkpoint), ref, target_options=TargetOptions(ca_file=str(tls_registry.ca_file)), progress="off"
    )
    pinned = f"{tls_registry.ref('k8s/model', None)}@{pushed.digest}"
    cache = tmp_path / "cache"
    args = ["k8s", "init-container", pinned, *PIN, "--image", SERVING, "--cache-path", str(cache)]
    res = _run([*args, "--ca-configmap", "registry-ca", "--retry-for", "0", "--json"])
    assert res.exit_code == 0, res.output
    import json

    init = next(c for c in json.loads(res.stdout)["spec"]["initContainers"] if c["name"] == "modelpack-pull")
    env, cmd = kubelet_view(init)
    env["MODELPACK_CA_FILE"] = str(tls_registry.ca_file)
    bindir = Path(sys.executable).parent
    base = {"PATH": f"{bindir}:/usr/bin:/bin", "HOME": str(tmp_path), "XDG_CACHE_HOME": str(tmp_path / "x")}
    without = {k: v for k, v in env.items() if k != "MODELPACK_CA_FILE"}
    failed = subprocess.run(cmd, env={**base, **without}, capture_output=True, text=True, timeout=120)
    assert failed.returncode == 1 and "--ca-file" in failed.stderr, failed.stderr
    shutil.rmtree(cache, ignore_errors=True)
    ok = subprocess.run(cmd, env={**base, **env}, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert (cache / "snapshots" / pushed.digest.split(":", 1)[1]).is_dir()
    assert oct(os.stat(cache).st_mode & 0o777) == "0o750"


# ------------------------------------------------------------------------------ vLLM model name
@pytest.mark.parametrize(
    "argv",
    [
        ["k8s", "pod", "--image-volume", REF, "--image", SERVING, "--vllm"],
        ["k8s", "init-container", REF, *PIN, "--image", SERVING, "--vllm"],
        ["k8s", "kserve", "inferenceservice", REF, "--name", "x", "--image", SERVING],
        ["k8s", "kserve", "inferenceservice", REF, "--name", "x", "--image", SERVING, "--weights", "stream"],
    ],
    ids=["image-volume", "init-container", "kserve", "kserve-stream"],
)
def test_vllm_serves_the_model_under_its_repository_name(argv: list[str]) -> None:
    """``--served-model-name`` is the reference's repository, so the API model id stays the same
    from one version (digest) to the next; ``--served-model-name`` on the command overrides it."""
    res = _run([*argv, "--json"])
    assert res.exit_code == 0, res.output
    assert '"--served-model-name",\n' in res.stdout
    assert res.stdout.count('"team-a/llama"') >= 1
    res = _run([*argv, "--served-model-name", "llama-prod", "--json"])
    assert res.exit_code == 0, res.output
    assert '"llama-prod"' in res.stdout and '"team-a/llama"' not in res.stdout


# ------------------------------------------------------------------------------ peer token
def test_serve_peers_needs_a_token_secret() -> None:
    """``--serve-peers`` without ``--peer-token-secret`` is a usage error naming the flag."""
    res = _run(["k8s", "prewarm", REF, "--node-selector", "a=b", *PIN, "--serve-peers", "5050"])
    assert res.exit_code == 2 and "--peer-token-secret" in res.output, res.output


def test_peer_token_reaches_the_server_and_the_pulls_from_one_secret() -> None:
    """The ``cache serve`` container requires the Secret's ``token`` (MODELPACK_SERVE_TOKEN), the
    pulling container presents it (MODELPACK_PEER_TOKEN); the YAML says what the port serves."""
    args = ["k8s", "prewarm", REF, "--node-selector", "a=b", *PIN, "--serve-peers", "5050"]
    res = _run([*args, "--peer-token-secret", "peer-token"])
    assert res.exit_code == 0, res.output
    objs = _docs(res.stdout)
    ref = {"secretKeyRef": {"name": "peer-token", "key": "token"}}
    serve = {e["name"]: e for e in _container(objs, "peer-serve")["env"]}
    pull = {e["name"]: e for e in _container(objs, "prewarm")["env"]}
    assert serve["MODELPACK_SERVE_TOKEN"]["valueFrom"] == ref
    assert pull["MODELPACK_PEER_TOKEN"]["valueFrom"] == ref
    assert "MODELPACK_PEER_TOKEN" not in serve and "MODELPACK_SERVE_TOKEN" not in pull
    notes = [line for line in res.stdout.splitlines() if line.startswith("#")]
    assert any("verified blobs" in n and "peer-token" in n and "5050" in n for n in notes), notes


def test_pull_settings_no_container_of_the_object_would_use_are_refused() -> None:
    """An image volume is pulled by the runtime, and with ``--weights initializer`` KServe's
    storage initializer pulls with its ClusterStorageContainer's settings: a ``--mirror`` given
    there would be dropped, so it is refused naming where it belongs."""
    res = _run(["k8s", "pod", "--image-volume", REF, "--image", SERVING, "--mirror", "http://m:5000"])
    assert res.exit_code == 2 and "hosts.toml" in res.output, res.output
    args = ["k8s", "kserve", "inferenceservice", REF, "--name", "x", "--image", SERVING]
    res = _run([*args, "--mirror", "http://m:5000"])
    assert res.exit_code == 2 and "storage-containers" in res.output, res.output
    res = _run([*args, "--weights", "stream", "--mirror", "http://m:5000"])
    assert res.exit_code == 0, res.output
