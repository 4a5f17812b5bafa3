"""The test set-up (`.ci/bootstrap.sh`, run by `make test`) is complete, or the suite fails.

A few tests skip when a tool they need is absent, so that one file can still be run on a machine
set up by hand. Under `make test` an absent tool means the set-up is broken, and a skip would hide
it: this test names every piece the set-up installs and fails on the first one missing. The only
piece that may be left out is the one the README lets you leave out (`MODELPACK_SKIP_VLLM=1`).
"""

from __future__ import annotations

import importlib
import os
import shutil
from pathlib import Path

import pytest

from tests.paths import REPO_ROOT

ROOT = REPO_ROOT

# Debian packages .ci/bootstrap.sh installs, by the command each provides
COMMANDS = [
    "docker-registry", "skopeo", "htpasswd", "containerd", "ctr", "strace", "setpriv", "node",
    "podman", "mmdebstrap", "newuidmap",
]  # fmt: skip

# declared in the `test` extra (pyproject.toml); import names
MODULES = ["kubernetes_validate", "oras.client", "moto", "model_signing", "boto3", "zstandard", "safetensors"]


@pytest.mark.parametrize("command", COMMANDS)
def test_the_setup_installed_the_command(command: str) -> None:
    found = shutil.which(command) or (Path("/usr/bin") / command).exists()
    assert found, f"{command} is missing: run .ci/bootstrap.sh (make test does)"


@pytest.mark.parametrize("module", MODULES)
def test_the_setup_installed_the_test_dependency(module: str) -> None:
    importlib.import_module(module)


def test_the_peer_client_venv_exists() -> None:
    python = ROOT / ".venv-peers" / "bin" / "python"
    assert python.exists(), f"{python} is missing: run .ci/peers-venv.sh (make test's set-up does)"


def test_the_vllm_venv_exists_unless_left_out_on_purpose() -> None:
    if os.environ.get("MODELPACK_SKIP_VLLM") == "1":
        pytest.skip("MODELPACK_SKIP_VLLM=1: the vLLM tests were left out on purpose")
    stamp = ROOT / ".venv-vllm" / ".modelpack-vllm-installed"
    assert stamp.exists(), f"{stamp} is missing: run .ci/vllm-venv.sh (make test's set-up does)"


def test_sigstore_js_is_installed() -> None:
    package = ROOT / ".node" / "sigstore-js" / "node_modules" / "@sigstore" / "verify" / "package.json"
    assert package.exists(), f"{package} is missing: run .ci/sigstore-js.sh (make test's set-up does)"
