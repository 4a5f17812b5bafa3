"""Every Kubernetes object modelpack emits validates against the published
Kubernetes OpenAPI schemas of 1.33 and of the newest release, in strict mode (unknown fields are
errors), with ``kubernetes-validate`` — not only against the Python client's models, which accept
whatever their version happens to know.
"""

from __future__ import annotations

from typing import Any

import kubernetes_validate as kv  # declared test dependency: missing is a failure, not a skip
import pytest
import yaml
from click.testing import CliRunner

from modelpack.cli import main
from tests.mount.k8s_images import IMAGE, with_images

DIGEST = "sha256:" + "a" * 64
REF = f"registry.example.com/models/llama-3@{DIGEST}"
VERSIONS = ["1.33.0", kv.latest_version()]

COMMANDS: dict[str, list[str]] = {
    "pod": ["k8s", "pod", "--image-volume", REF, "--mount-path", "/m", "--namespace", "ml"],
    "pod-vllm": ["k8s", "pod", "--image-volume", REF, "--vllm", "--tensor-parallel-size", "2"],
    "init-container-hostpath": [
        "k8s",
        "init-container",
        REF,
        "--policy-secret",
        "trust",
        "--registry-secret",
        "regcred",
    ],
    "init-container-emptydir": [
        "k8s",
        "init-container",
        REF,
        "--cache-volume",
        "emptyDir",
        "--size-limit",
        "200Gi",
    ],
    "init-container-vllm": ["k8s", "init-container", REF, "--vllm"],
    "prewarm": [
        "k8s",
        "prewarm",
        REF,
        f"registry.example.com/models/other@{DIGEST}",
        "--node-selector",
        "pool=gpu",
        "--tolerate-all",
        "--policy-secret",
        "trust",
        "--registry-secret",
        "regcred",
    ],
}


@pytest.fixture(autouse=True)
def _modelpack_image(monkeypatch: pytest.MonkeyPatch) -> None:
    """The modelpack image is the user's setting: these tests give it through MODELPACK_IMAGE."""
    monkeypatch.setenv("MODELPACK_IMAGE", IMAGE)


def _emitted(args: list[str]) -> list[dict[str, Any]]:
    out = CliRunner().invoke(main, with_images(args))
    assert out.exit_code == 0, out.output
    docs = [d for d in yaml.safe_load_all(out.output) if d]
    assert docs
    return docs


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("case", sorted(COMMANDS))
def test_emitted_yaml_validates_strictly_against_the_published_schema(case: str, version: str) -> None:
    for doc in _emitted(COMMANDS[case]):
        kv.validate(doc, version, strict=True)


def test_the_validator_is_strict_enough_to_fail() -> None:
    """A misspelt field and a wrong type are refused, so the test above can fail."""
    pod = _emitted(COMMANDS["pod"])[0]
    pod["spec"]["volumes"][0]["image"]["pullPolcy"] = "IfNotPresent"
    with pytest.raises(kv.ValidationError):
        kv.validate(pod, VERSIONS[-1], strict=True)
    pod = _emitted(COMMANDS["pod"])[0]
    pod["spec"]["containers"][0]["volumeMounts"][0]["readOnly"] = "yes"
    with pytest.raises(kv.ValidationError):
        kv.validate(pod, "1.33.0", strict=True)


def test_image_volume_notes_say_when_the_feature_gate_is_on() -> None:
    out = CliRunner().invoke(main, with_images(COMMANDS["pod"]))
    notes = [line for line in out.output.splitlines() if line.startswith("#")]
    gate = next(n for n in notes if "ImageVolume" in n)
    assert "1.35" in gate and "on by default" in gate and "1.33" in gate
    assert "on by default in 1.33" not in gate
