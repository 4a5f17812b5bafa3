"""Podman for the tests that run generated Kubernetes objects (not a test module).

Everything goes through ``images/podman.sh`` (the one place that knows what this machine's podman
needs: ``images/containers.conf``), and the image is the one ``make image`` builds
(``images/build.sh``, which reuses an image of the same inputs). ``kube play`` runs with the host's
network, so pods reach the tests' loopback registries, and without TLS verification towards them
(they speak plain HTTP on 127.0.0.1).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tests.paths import REPO_ROOT

REPO = REPO_ROOT
PODMAN_SH = REPO / "images" / "podman.sh"
BUILD_SH = REPO / "images" / "build.sh"
MODELPACK = str(Path(sys.executable).with_name("modelpack"))
KEEP_INIT = {"io.podman.annotations.init.container.type": "always"}


def podman_missing() -> str | None:
    """Why podman cannot run containers here (None when it can): the test skips with it."""
    if shutil.which("podman") is None:
        return "podman is not installed (Debian package 'podman'; .ci/bootstrap.sh installs it)"
    return None


def podman(*args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(
        ["bash", str(PODMAN_SH), *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    if check and r.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)} exited {r.returncode}:\n{r.stdout}\n{r.stderr}")
    return r


def build_image() -> tuple[str, float]:
    """``make image``'s image (built now, or reused when its inputs are unchanged) and the seconds
    it took."""
    start = time.monotonic()
    env = {**os.environ, "PY": sys.executable}
    r = subprocess.run(
        ["bash", str(BUILD_SH)], capture_output=True, text=True, timeout=1800, env=env, cwd=REPO, check=False
    )
    if r.returncode != 0:
        raise AssertionError(f"images/build.sh exited {r.returncode}:\n{r.stderr[-6000:]}")
    return r.stdout.strip().splitlines()[-1], time.monotonic() - start


def modelpack_cli(*args: str, stdin: str | None = None, timeout: float = 300) -> str:
    """Run the ``modelpack`` CLI of this venv; its stdout (asserts exit 0)."""
    r = subprocess.run(
        [MODELPACK, *args], capture_output=True, text=True, input=stdin, timeout=timeout, check=False
    )
    assert r.returncode == 0, f"modelpack {' '.join(args)} exited {r.returncode}:\n{r.stderr}"
    return r.stdout


@dataclass(frozen=True)
class PublishedImage:
    """The modelpack image in a registry: pinned reference, signed by ``public_key``'s pair."""

    reference: str  # host/repo@sha256:…
    digest: str
    public_key: Path


def publish_image(local: str, registry_host: str, repository: str, work: Path) -> PublishedImage:
    """Push the local image with modelpack itself (podman writes an OCI layout, ``modelpack cp``
    uploads it, digests unchanged), sign it with a fresh key and check the signature."""
    layout = work / "image-layout"
    shutil.rmtree(layout, ignore_errors=True)
    podman("push", "--quiet", local, f"oci:{layout}:image")
    target = f"{registry_host}/{repository}:{local.rsplit(':', 1)[-1]}"
    out = json.loads(modelpack_cli("cp", f"oci:{layout}:image", target, "--json"))
    digest = out["digest"]
    pinned = f"{registry_host}/{repository}@{digest}"
    key = work / "image-signing"
    modelpack_cli("keygen", "--out", str(key))
    modelpack_cli("sign", pinned, "--key", f"{key}.key", "--no-chunk-table", "--no-directory-signature")
    modelpack_cli("verify", pinned, "--key", f"{key}.pub")
    return PublishedImage(pinned, digest, Path(f"{key}.pub"))


def dump_all(objects: list[dict[str, Any]]) -> str:
    return yaml.safe_dump_all(objects, sort_keys=False)


_KUBELET_REFERENCE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def kubelet_expansion(pod_spec: dict[str, Any]) -> None:
    """What the kubelet does to ``command``, ``args`` and env values before a process starts, and
    kube play 4.3 does not: ``$$`` becomes ``$`` and ``$(NAME)`` the value of an env var defined
    before it (a reference to anything else stays as written)."""
    for container in [*pod_spec.get("initContainers", []), *pod_spec.get("containers", [])]:
        defined: dict[str, str] = {}

        def expand(text: str, defined: dict[str, str] = defined) -> str:
            def one(m: re.Match[str]) -> str:
                if m.group(0) == "$$":
                    return "$"
                return defined.get(m.group(1), m.group(0))

            return _KUBELET_REFERENCE.sub(one, text)

        for env in container.get("env", []):
            if "value" in env:
                env["value"] = expand(env["value"])
                defined[env["name"]] = env["value"]
        for key in ("command", "args"):
            if key in container:
                container[key] = [expand(a) for a in container[key]]


@dataclass
class KubePlay:
    """One ``podman kube play`` of a YAML file; ``down`` removes its pods (and emptyDirs)."""

    path: Path
    result: subprocess.CompletedProcess[str]
    seconds: float

    def down(self) -> None:
        podman("kube", "down", str(self.path), check=False, timeout=120)


def kube_play(objects: list[dict[str, Any]], path: Path, *, timeout: float = 300) -> KubePlay:
    """Play ``objects`` (host network, plain HTTP to the loopback registries); does not assert
    success: an init container that refuses makes ``result`` non-zero, as a pod stuck in Init.
    Pods get the kubelet's ``$(VAR)``/``$$`` expansion first (``kubelet_expansion``), and their init
    containers are kept after they ran (podman's ``always`` type: their logs stay readable, and
    4.3's ``once`` type races removing a container that has not quite exited)."""
    objects = [dict(o) for o in objects]
    for obj in objects:
        if obj.get("kind") == "Pod":
            kubelet_expansion(obj["spec"])
            obj["metadata"].setdefault("annotations", {}).update(KEEP_INIT)
    path.write_text(dump_all(objects))
    start = time.monotonic()
    r = podman(
        "kube", "play", "--network", "host", "--tls-verify=false", "--quiet", str(path),
        timeout=timeout, check=False,
    )  # fmt: skip
    return KubePlay(path, r, time.monotonic() - start)


def wait_exit(container: str, timeout: float = 120) -> int:
    """Wait for ``container`` to exit; its exit code."""
    r = podman("wait", container, timeout=timeout)
    return int(r.stdout.strip().splitlines()[-1])


def logs(container: str) -> str:
    r = podman("logs", container, check=False)
    return r.stdout + r.stderr


def inspect(container: str) -> dict[str, Any]:
    result: dict[str, Any] = json.loads(podman("inspect", container).stdout)[0]
    return result
