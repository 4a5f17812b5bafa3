"""Ctrl-C stops a pull as fast as SIGTERM does and keeps what it fetched for the rerun.

A person who presses Ctrl-C on a slow ``pull --cache`` expects the prompt back at once, and a
rerun that continues where the first run stopped. Each case is a real ``modelpack`` process
pulling through a FaultProxy slowed to 1 MiB/s from a real registry, signalled once blobs flow;
the rerun goes through the same proxy (no longer slowed) so the bytes it fetched are counted.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from modelpack.exit_codes import ExitCode
from modelpack.testdata.synthetic import SyntheticSpec, write_checkpoint
from tests.fixtures.faultproxy import FaultProxy
from tests.fixtures.registry import RegistryServer
from tests.mount.test_cache_support import push_model

pytestmark = pytest.mark.timeout(240)

MODELPACK = str(Path(sys.executable).with_name("modelpack"))


def _blob_total(registry: RegistryServer, repo: str) -> int:
    """Bytes of every blob the pull fetches (layers and config), read from the manifest."""
    resp = requests.get(
        f"http://{registry.host}/v2/{repo}/manifests/v1",
        headers={"Accept": "application/vnd.oci.image.manifest.v1+json"},
        timeout=10,
    )
    resp.raise_for_status()
    doc = resp.json()
    return int(doc["config"]["size"]) + sum(int(layer["size"]) for layer in doc["layers"])


def _pull(proxy: FaultProxy, repo: str, tmp_path: Path, into: str) -> list[str]:
    ref = f"{proxy.host}/{repo}:v1"
    if into == "cache":
        return [MODELPACK, "pull", ref, "--cache", str(tmp_path / "cache"), "--progress", "off"]
    return [MODELPACK, "pull", ref, str(tmp_path / "dest"), "--progress", "off"]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
@pytest.mark.parametrize("into", ["cache", "directory"])
def test_a_signalled_pull_stops_at_once_and_its_rerun_resumes(
    registry: RegistryServer, tmp_path: Path, sig: signal.Signals, into: str
) -> None:
    """SIGINT (Ctrl-C) and SIGTERM stop a pull within a second with 128 + the signal, and the
    rerun fetches less than the model's blobs: the partials the first run wrote were kept."""
    ckpt = tmp_path / "ckpt"
    write_checkpoint(str(ckpt), SyntheticSpec(hidden=512, intermediate=1376, layers=4, vocab=4096))
    repo = f"interrupt/{into}-{sig.name.lower()}"
    push_model(ckpt, registry.host, repo)
    total = _blob_total(registry, repo)
    proxy = FaultProxy(registry.host, rate=1024 * 1024)
    try:
        proc = subprocess.Popen(
            _pull(proxy, repo, tmp_path, into),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "CI": "1"},
        )
        deadline = time.monotonic() + 60
        while proxy.blob_bytes_now() < 2 * 1024 * 1024:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        signalled = time.monotonic()
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
        took = time.monotonic() - signalled
        assert proc.returncode == 128 + sig, (proc.returncode, err)
        assert took < 1.0, f"{sig.name} took {took:.2f} s to stop the pull"
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        proxy.wait_idle()
        proxy.rate = None
        proxy.clear()
        rerun = subprocess.run(
            _pull(proxy, repo, tmp_path, into), capture_output=True, text=True, timeout=120
        )
        assert rerun.returncode == ExitCode.OK, rerun.stderr
        fetched = proxy.total_blob_bytes()
    finally:
        proxy.close()
    assert fetched < total - 1024 * 1024, f"the rerun fetched {fetched} of {total} bytes: nothing was resumed"
