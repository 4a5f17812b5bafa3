"""Kubernetes manifests: each loads into the ``kubernetes`` client models with nothing dropped."""

from __future__ import annotations

import shlex

import pytest
import yaml
from click.testing import CliRunner
from modelpack.mount import k8s

from modelpack.cli import main
from modelpack.errors import InvalidReferenceError

DIGEST = "sha256:" + "ab" * 32
REF = f"registry.example.com/models/llama-3@{DIGEST}"


def test_image_volume_pod_is_pinned_and_loads_into_v1pod() -> None:
    obj = k8s.image_volume_pod(REF, mount_path="/models", pull_policy="IfNotPresent")
    pod = k8s.validate(obj)
    vol = pod.spec.volumes[0]
    assert vol.image.reference == REF and vol.image.pull_policy == "IfNotPresent"
    mount = pod.spec.containers[0].volume_mounts[0]
    assert mount.mount_path == "/models" and mount.read_only is True and mount.name == vol.name
    with pytest.raises(InvalidReferenceError, match="not pinned by digest"):
        k8s.image_volume_pod("registry.example.com/models/llama-3:v1")
    with pytest.raises(InvalidReferenceError):
        k8s.image_volume_pod(f"oci:/tmp/layout@{DIGEST}")


def test_init_container_pulls_into_the_cache_with_policy_and_credentials() -> None:
    obj = k8s.init_container_pod(
        REF, cache_volume="hostPath", policy_secret="model-trust", registry_secret="regcred"
    )
    pod = k8s.validate(obj)
    init = pod.spec.init_containers[0]
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
    empty = k8s.validate(k8s.init_container_pod(REF, cache_volume="emptyDir", size_limit="100Gi"))
    assert empty.spec.volumes[0].empty_dir.size_limit == "100Gi"


def test_prewarm_daemonset_selects_nodes_and_pulls_every_reference() -> None:
    refs = [REF, "registry.example.com/models/qwen:v2"]
    obj = k8s.prewarm_daemonset(refs, node_selector={"nvidia.com/gpu.product": "H100"}, interval_s=120)
    ds = k8s.validate(obj)
    spec = ds.spec.template.spec
    assert spec.node_selector == {"nvidia.com/gpu.product": "H100"}
    assert ds.spec.selector.match_labels == ds.spec.template.metadata.labels
    script = spec.containers[0].command[2]
    for r in refs:
        assert shlex.join(["modelpack", "pull", r, "--cache", "/var/cache/modelpack", "--json"]) in script
    assert "sleep 120" in script
    with pytest.raises(k8s.K8sError):
        k8s.prewarm_daemonset(refs, node_selector={})


def test_validate_catches_a_misspelt_field() -> None:
    obj = k8s.image_volume_pod(REF)
    obj["spec"]["volumes"][0]["image"]["pulPolicy"] = "Always"
    with pytest.raises(k8s.K8sError, match="pulPolicy"):
        k8s.validate(obj)


def test_cli_emits_yaml_that_loads() -> None:
    runner = CliRunner()
    out = runner.invoke(main, ["k8s", "pod", "--image-volume", REF, "--mount-path", "/m"])
    assert out.exit_code == 0, out.output
    assert "containerd >= 2.1" in out.output and "CRI-O >= 1.33" in out.output
    k8s.validate(yaml.safe_load(out.output))
    out = runner.invoke(main, ["k8s", "init-container", REF, "--cache-volume", "emptyDir", "--json"])
    assert out.exit_code == 0, out.output
    out = runner.invoke(main, ["k8s", "prewarm", REF, "--node-selector", "pool=gpu"])
    assert out.exit_code == 0, out.output
    assert yaml.safe_load(out.output)["kind"] == "DaemonSet"
    bad = runner.invoke(main, ["k8s", "pod", "--image-volume", "registry.example.com/m:v1"])
    assert bad.exit_code == 2 and "pinned by digest" in bad.output
