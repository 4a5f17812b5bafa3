"""Kubernetes manifests: each loads into the ``kubernetes`` client models with nothing dropped."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner
from modelpack.mount import k8s

from modelpack.cli import main
from modelpack.errors import InvalidReferenceError
from tests.mount.k8s_images import IMAGE, SERVING, with_images

DIGEST = "sha256:" + "ab" * 32
REF = f"registry.example.com/models/llama-3@{DIGEST}"


@pytest.fixture(autouse=True)
def _modelpack_image(monkeypatch: pytest.MonkeyPatch) -> None:
    """The modelpack image is the user's setting: these tests give it through MODELPACK_IMAGE."""
    monkeypatch.setenv("MODELPACK_IMAGE", IMAGE)


def test_image_volume_pod_is_pinned_and_loads_into_v1pod() -> None:
    obj = k8s.image_volume_pod(REF, mount_path="/models", pull_policy="IfNotPresent", image=SERVING)
    pod = k8s.validate(obj)
    vol = pod.spec.volumes[0]
    assert vol.image.reference == REF and vol.image.pull_policy == "IfNotPresent"
    mount = pod.spec.containers[0].volume_mounts[0]
    assert mount.mount_path == "/models" and mount.read_only is True and mount.name == vol.name
    with pytest.raises(InvalidReferenceError, match="not pinned by digest"):
        k8s.image_volume_pod("registry.example.com/models/llama-3:v1", image=SERVING)
    with pytest.raises(InvalidReferenceError):
        k8s.image_volume_pod(f"oci:/tmp/layout@{DIGEST}", image=SERVING)


def _cache_owner(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [c for c in spec.get("initContainers", []) if c["name"] == "modelpack-cache-owner"]


def test_host_path_caches_are_handed_to_the_image_user_before_anything_writes_them() -> None:
    """The kubelet creates a missing hostPath directory as root (0755), where the image's uid 1000
    cannot write: pods with a hostPath cache first run a chown of that directory alone, as root
    with CAP_CHOWN only; emptyDir pods (writable by the pod) have no such container."""
    image = f"registry.example.com/modelpack/modelpack@{DIGEST}"
    pod = k8s.init_container_pod(
        REF, cache_volume="hostPath", cache_path="/cache", modelpack_image=image, image=SERVING
    )
    prewarm = k8s.prewarm_daemonset([REF], node_selector={"gpu": "yes"}, modelpack_image=image)
    for spec in (pod["spec"], prewarm["spec"]["template"]["spec"]):
        (owner,) = _cache_owner(spec)
        assert spec["initContainers"][0] is owner  # before the pull
        cache = next(m["mountPath"] for m in owner["volumeMounts"] if m["name"] == "modelpack-cache")
        assert owner["command"] == ["chown", "1000:1000", cache]
        assert owner["image"] == image
        ctx = owner["securityContext"]
        assert ctx["runAsUser"] == 0 and ctx["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}
        assert ctx["allowPrivilegeEscalation"] is False and ctx["readOnlyRootFilesystem"] is True
    k8s.validate(pod)
    k8s.validate(prewarm)
    empty = k8s.init_container_pod(REF, cache_volume="emptyDir", modelpack_image=image, image=SERVING)
    assert _cache_owner(empty["spec"]) == []


def test_init_container_pulls_into_the_cache_with_policy_and_credentials() -> None:
    obj = k8s.init_container_pod(
        REF,
        cache_volume="hostPath",
        policy_secret="model-trust",
        registry_secret="regcred",
        modelpack_image=IMAGE,
        image=SERVING,
    )
    pod = k8s.validate(obj)
    (init,) = (c for c in pod.spec.init_containers if c.name == "modelpack-pull")
    argv = shlex.split(init.command[2])
    assert argv[:3] == ["modelpack", "pull", REF]
    assert argv[argv.index("--cache") + 1] == "/var/cache/modelpack"
    assert argv[argv.index("--policy") + 1] == "/etc/modelpack/policy/policy.yaml"
    env = {e.name: e.value for e in init.env}
    assert env["DOCKER_CONFIG"] == "/etc/modelpack/docker"
    vols = {v.name: v for v in pod.spec.volumes}
    assert vols["modelpack-cache"].host_path.path == "/var/cache/modelpack"
    assert vols["registry-credentials"].secret.items[0].key == ".dockerconfigjson"
    assert vols["trust-policy"].secret.secret_name == "model-trust"
    server = pod.spec.containers[0]
    assert {e.name: e.value for e in server.env}["MODELPACK_MODEL_DIR"] == (
        "/var/cache/modelpack/snapshots/" + DIGEST[7:]
    )
    assert server.volume_mounts[0].read_only is True
    for c in (init, server):  # one start_id (the pod UID) joins both containers' events
        sid = next(e for e in c.env if e.name == "MODELPACK_START_ID")
        assert sid.value_from.field_ref.field_path == "metadata.uid"
    empty = k8s.validate(
        k8s.init_container_pod(
            REF, cache_volume="emptyDir", size_limit="100Gi", modelpack_image=IMAGE, image=SERVING
        )
    )
    assert empty.spec.volumes[0].empty_dir.size_limit == "100Gi"


def test_prewarm_daemonset_selects_nodes_and_pulls_every_reference() -> None:
    refs = [REF, "registry.example.com/models/qwen:v2"]
    obj = k8s.prewarm_daemonset(
        refs, node_selector={"nvidia.com/gpu.product": "H100"}, interval_s=120, modelpack_image=IMAGE
    )
    ds = k8s.validate(obj)
    spec = ds.spec.template.spec
    assert spec.node_selector == {"nvidia.com/gpu.product": "H100"}
    assert ds.spec.selector.match_labels == ds.spec.template.metadata.labels
    script = spec.containers[0].command[2]
    for r in refs:
        assert shlex.join(["modelpack", "pull", r, "--cache", "/var/cache/modelpack", "--json"]) in script
    assert "sleep 120" in script
    with pytest.raises(k8s.K8sError):
        k8s.prewarm_daemonset(refs, node_selector={}, modelpack_image=IMAGE)


def test_validate_catches_a_misspelt_field() -> None:
    obj = k8s.image_volume_pod(REF, image=SERVING)
    obj["spec"]["volumes"][0]["image"]["pulPolicy"] = "Always"
    with pytest.raises(k8s.K8sError, match="pulPolicy"):
        k8s.validate(obj)


def test_cli_emits_yaml_that_loads() -> None:
    runner = CliRunner()
    out = runner.invoke(main, with_images(["k8s", "pod", "--image-volume", REF, "--mount-path", "/m"]))
    assert out.exit_code == 0, out.output
    assert "containerd >= 2.1" in out.output and "CRI-O >= 1.33" in out.output
    k8s.validate(yaml.safe_load(out.output))
    out = runner.invoke(
        main, with_images(["k8s", "init-container", REF, "--cache-volume", "emptyDir", "--json"])
    )
    assert out.exit_code == 0, out.output
    out = runner.invoke(main, ["k8s", "prewarm", REF, "--node-selector", "pool=gpu"])
    assert out.exit_code == 0, out.output
    assert yaml.safe_load(out.output)["kind"] == "DaemonSet"
    bad = runner.invoke(main, with_images(["k8s", "pod", "--image-volume", "registry.example.com/m:v1"]))
    assert bad.exit_code == 2 and "pinned by digest" in bad.output


# --------------------------------------------------------------------------- $(VAR) expansion
def kubelet_expand(text: str, env: dict[str, str]) -> str:
    """What the kubelet does to ``command``, ``args`` and ``env[].value`` before the container
    starts (Kubernetes docs, "Define a Command and Arguments" / "Dependent Environment
    Variables"; the code is k8s.io/kubernetes third_party/forked/golang/expansion): ``$(NAME)``
    of a variable defined earlier is replaced by its value, an unknown one is left as written,
    and ``$$`` is an escaped ``$``."""
    out: list[str] = []
    i = 0
    while i < len(text):
        if text[i] != "$" or i + 1 == len(text):
            out.append(text[i])
            i += 1
            continue
        nxt = text[i + 1]
        if nxt == "$":
            out.append("$")
            i += 2
        elif nxt == "(":
            end = text.find(")", i + 2)
            if end < 0:
                out.append("$(")
                i += 2
                continue
            name = text[i + 2 : end]
            out.append(env.get(name, f"$({name})"))
            i = end + 1
        else:
            out.append("$" + nxt)
            i += 2
    return "".join(out)


def kubelet_view(container: dict[str, Any]) -> tuple[dict[str, str], list[str]]:
    """The container's environment (each value expanded with the ones before it) and command as
    the process receives them."""
    env: dict[str, str] = {}
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = kubelet_expand(e["value"], env)
    command = [kubelet_expand(a, env) for a in [*container.get("command", []), *container.get("args", [])]]
    return env, command


def test_kubelet_expansion_model_follows_the_documented_rules() -> None:
    env = {"A": "x"}
    assert kubelet_expand("$(A)/$(B)/$$(A)/$$$(A)/$x/$", env) == "x/$(B)/$(A)/$x/$x/$"
    assert kubelet_expand("$(A", env) == "$(A"


EVIL_CACHE = "/var/cache/$(MODELPACK_CACHE)/$(HOME)/$$(X)/mp$"


def _sh_argv(tmp_path: Path, script: str, env: dict[str, str]) -> list[list[str]]:
    """Run ``sh -c script`` for real with a ``modelpack`` on PATH that records its argv."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    log = tmp_path / "argv.jsonl"
    fake = bindir / "modelpack"
    fake.write_text(
        f"#!{sys.executable}\nimport json, sys\n"
        f"open({str(log)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n"
    )
    fake.chmod(0o755)
    subprocess.run(
        ["sh", "-c", script.replace("while true", "for _ in 1").replace("sleep", ": sleep")],
        env={**env, "PATH": f"{bindir}:/usr/bin:/bin", "HOME": "/root"},
        check=True,
        timeout=60,
    )
    return [json.loads(line) for line in log.read_text().splitlines()]


def test_cache_path_reaches_the_init_container_literally(tmp_path: Path) -> None:
    """A ``--cache-path`` holding ``$(MODELPACK_CACHE)`` was expanded by the
    kubelet before ``sh -c`` ran; every generated command, argument and env value is literal."""
    args = ["init-container", REF, "--cache-path", EVIL_CACHE, "--policy-secret", "trust"]
    args += ["--policy-key", "p$(HOME).yaml", "--vllm", "--json", "--image", SERVING]
    proc = subprocess.run(
        [sys.executable, "-m", "modelpack.cli", "k8s", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    pod = json.loads(proc.stdout)
    (pull,) = (c for c in pod["spec"]["initContainers"] if c["name"] == "modelpack-pull")
    init_env, init_cmd = kubelet_view(pull)
    assert init_env["MODELPACK_CACHE"] == EVIL_CACHE
    assert init_cmd[:2] == ["sh", "-c"]
    [argv] = _sh_argv(tmp_path, init_cmd[2], init_env)
    assert argv[argv.index("--cache") + 1] == EVIL_CACHE
    assert argv[argv.index("--policy") + 1] == "/etc/modelpack/policy/p$(HOME).yaml"
    server_env, server_cmd = kubelet_view(pod["spec"]["containers"][0])
    snapshot = f"{EVIL_CACHE}/snapshots/{DIGEST[7:]}"
    assert server_env["MODELPACK_MODEL_DIR"] == snapshot
    assert server_cmd[server_cmd.index("--model") + 1] == snapshot


def test_prewarm_and_image_volume_commands_are_literal(tmp_path: Path) -> None:
    ds = k8s.prewarm_daemonset(
        [REF],
        node_selector={"gpu": "yes"},
        cache_path=EVIL_CACHE,
        policy_secret="t",
        policy_key="$(X)",
        modelpack_image=IMAGE,
    )
    env, cmd = kubelet_view(ds["spec"]["template"]["spec"]["containers"][0])
    assert env["MODELPACK_CACHE"] == EVIL_CACHE
    [argv] = _sh_argv(tmp_path, cmd[2], env)
    assert argv[argv.index("--cache") + 1] == EVIL_CACHE
    assert argv[argv.index("--policy") + 1] == "/etc/modelpack/policy/$(X)"
    from modelpack.serving.k8s_vllm import vllm_server_pod

    mount = "/models/$(MODELPACK_MODEL_DIR)$(HOME)"
    pod = k8s.image_volume_pod(REF, mount_path=mount, image=SERVING)
    served = vllm_server_pod(pod, model_dir=mount, digest=DIGEST, trust="runtime", extra_args=["--x=$(HOME)"])
    env, cmd = kubelet_view(served["spec"]["containers"][0])
    assert env["MODELPACK_MODEL_DIR"] == mount
    assert cmd[cmd.index("--model") + 1] == mount and cmd[-1] == "--x=$(HOME)"
    k8s.validate(served)


@pytest.mark.parametrize(
    "argv",
    [
        ["k8s", "pod", "--image-volume", REF, "--vllm", "--tensor-parallel-size", "2"],
        ["k8s", "init-container", REF, "--vllm", "--policy-secret", "p"],
    ],
    ids=["image-volume", "init-container"],
)
def test_replicas_make_a_deployment_whose_template_is_the_pod(argv: list[str]) -> None:
    """Serving replicas are a Deployment: the pod printed without --replicas is its template,
    the model still pinned by digest, the selector the pod's labels."""
    runner = CliRunner()
    argv = with_images(argv)
    pod = json.loads(runner.invoke(main, [*argv, "--json"]).output)
    res = runner.invoke(main, [*argv, "--replicas", "3", "--json"])
    assert res.exit_code == 0, res.output
    dep = json.loads(res.output)
    assert (dep["apiVersion"], dep["kind"], dep["spec"]["replicas"]) == ("apps/v1", "Deployment", 3)
    template = dep["spec"]["template"]
    assert template["spec"] == pod["spec"]
    assert (
        template["metadata"]["labels"] == pod["metadata"]["labels"] == dep["spec"]["selector"]["matchLabels"]
    )
    assert template["metadata"]["annotations"]["modelpack.dev/model-digest"] == REF.split("@")[1]
    assert dep["metadata"]["name"] == pod["metadata"]["name"]
    k8s.validate(dep)
    assert runner.invoke(main, [*argv, "--replicas", "0"]).exit_code == 2
