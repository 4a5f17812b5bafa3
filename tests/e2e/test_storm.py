"""The storm harness itself — counters measured, everything it made removed.

Runs ``benchmarks/storm.py`` for real (2 nodes, a tiny model, network namespaces, tc): the origin
egress it reports must be what the origin's veth counted (about 2 models direct, about 1 with
peers), every snapshot verified; and afterwards no namespace, ``/etc/netns`` entry or process of
the run is left — also when the run is stopped by SIGTERM half-way.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.paths import REPO_ROOT

ROOT = REPO_ROOT
STORM = [sys.executable, str(ROOT / "benchmarks" / "storm.py")]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def _netns() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _leftovers(pid: int) -> list[str]:
    tag = f"mpstorm-{pid}-"
    found = [ns for ns in _netns() if ns.startswith(tag)]
    etc = Path("/etc/netns")
    if etc.is_dir():
        found += [str(p) for p in etc.iterdir() if p.name.startswith(tag)]
    ps = subprocess.run(["ps", "-eo", "pid,ppid,args"], capture_output=True, text=True).stdout
    found += [line for line in ps.splitlines() if f"/mpstorm-{pid}" in line or tag in line]
    return found


def _skip_unless_possible() -> None:
    if os.geteuid() != 0:
        pytest.skip("the storm needs root to create network namespaces")
    if shutil.which("tc") is None or not Path("/usr/bin/docker-registry").exists():
        pytest.skip("tc or docker-registry is not installed")
    probe = f"mpstorm-probe-{os.getpid()}"
    res = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"ip netns add is not permitted here: {res.stderr.strip()}")
    subprocess.run(["ip", "netns", "del", probe], check=False)


def test_two_nodes_direct_and_peers_measure_the_origin_and_leave_nothing(tmp_path: Path) -> None:
    _skip_unless_possible()
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [*STORM, "--nodes", "2", "--size", "2MiB", "--shards", "2", "--modes", "direct,peers",
         "--no-faults", "--rate", "200", "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    stdout, stderr = proc.communicate(timeout=200)
    assert proc.returncode == 0, stderr[-3000:]
    assert _leftovers(proc.pid) == []
    doc = json.loads((out / "storm.json").read_text())
    model = doc["model_bytes"]
    rows = {r["mode"]: r for r in doc["rows"]}
    direct, peers = rows["direct"], rows["peers"]
    for r in (direct, peers):
        assert r["failed"] == 0 and r["verified"] == 2, r
        assert r["p95_s"] > 0 and r["node_rx_bytes"] >= 2 * model, r
    # the counters are the origin's veth: two copies (plus headers) direct, about one with peers
    assert 2 * model <= direct["origin_egress_bytes"] <= 2.3 * model, direct
    assert model <= peers["origin_egress_bytes"] <= 1.5 * model, peers
    assert (out / "storm.png").stat().st_size > 0
    assert "p95/direct" in stdout


def test_a_storm_stopped_half_way_removes_its_namespaces(tmp_path: Path) -> None:
    _skip_unless_possible()
    proc = subprocess.Popen(
        [*STORM, "--nodes", "2", "--size", "2MiB", "--shards", "2", "--modes", "peers", "--no-faults"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not any(ns.startswith(f"mpstorm-{proc.pid}-n1") for ns in _netns()):
        time.sleep(0.1)
    assert any(ns.startswith(f"mpstorm-{proc.pid}-") for ns in _netns()), "the storm made no namespace"
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    assert proc.returncode != 0
    assert _leftovers(proc.pid) == []
