"""benchmarks/gpu_load.py checks correctness before it measures, and says so in its JSON.

The script is what a CUDA machine runs when one is lent; here it runs with ``--device cpu``, the
same code path except the copy ceiling (host memcpy instead of pinned H2D). A real generated
checkpoint, real safetensors reference, real loader in a child process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.paths import REPO_ROOT

ROOT = REPO_ROOT
SCRIPT = ROOT / "benchmarks" / "gpu_load.py"


def run_script(
    tmp_path: Path, *extra: str, out_env: bool = False
) -> tuple[subprocess.CompletedProcess[str], Path]:
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    argv = [
        sys.executable,
        str(SCRIPT),
        "--device",
        "cpu",
        "--size",
        "32MiB",
        "--workers",
        "2",
        "--repeat",
        "1",
        "--dir",
        str(tmp_path / "ckpt"),
        *extra,
    ]
    if out_env:
        env["OUT"] = str(tmp_path / "out")
        result = tmp_path / "out" / "gpu_load.json"
    else:
        result = tmp_path / "result.json"
        argv += ["--json-out", str(result)]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=240)
    return proc, result


def test_cpu_run_checks_tp_1_2_8_then_measures(tmp_path: Path) -> None:
    proc, result = run_script(tmp_path, out_env=True)  # default JSON path: $OUT/gpu_load.json
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc: dict[str, Any] = json.loads(result.read_text())
    assert doc["passed"] is True and doc["device"] == "cpu"
    assert 28 << 20 <= doc["size_bytes"] <= 36 << 20
    corr = doc["correctness"]
    for tp in (1, 2, 8):
        entry = corr[f"tp{tp}"]
        assert entry["passed"] is True
        assert [r["rank"] for r in entry["ranks"]] == list(range(tp))
        # every rank got every tensor, and the bytes checked are this rank's share of the model
        assert {r["tensors"] for r in entry["ranks"]} == {corr["tp1"]["ranks"][0]["tensors"]}
    full = corr["tp1"]["ranks"][0]["bytes_checked"]
    assert full >= 28 << 20
    for tp in (2, 8):
        per_rank = [r["bytes_checked"] for r in corr[f"tp{tp}"]["ranks"]]
        assert len(set(per_rank)) == 1
        assert full / tp <= per_rank[0] < full / tp * 1.05  # only norms are replicated
        assert set(corr[f"tp{tp}"]["split_kinds"]) == {"dim0", "dim1", "replicate"}
    # the numbers are there and positive
    assert doc["ceilings"]["copy_gbps"] > 0 and doc["ceilings"]["host_read_gbps"] > 0
    for key in ("tp1", "tp1_out", "tp8_slowest_rank"):
        m = doc["load"][key]
        assert m["gbps"] > 0 and m["seconds"] > 0 and m["vs_copy_ceiling"] > 0
    assert len(doc["load"]["tp_ranks"]) == 8
    # the TP groups ran as an engine runs them: one process per rank, all at once
    for tp in (2, 8):
        group = doc["load"][f"tp{tp}_group"]
        assert group["processes"] == tp and group["concurrent"] is True
        assert sorted(r["rank"] for r in group["ranks"]) == list(range(tp))
        assert len({r["pid"] for r in group["ranks"]}) == tp  # distinct processes
        assert all(r["bytes_to_read"] > 0 and r["seconds"] > 0 for r in group["ranks"])
        assert group["wall_seconds"] >= max(r["seconds"] for r in group["ranks"])
    assert doc["ratio_tp1_vs_copy_ceiling"] == doc["load"]["tp1"]["vs_copy_ceiling"]
    assert not (tmp_path / "ckpt").exists()  # generated data removed unless --keep


def test_a_corrupted_tensor_fails_before_anything_is_measured(tmp_path: Path) -> None:
    proc, result = run_script(tmp_path, "--self-test-corrupt")
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    doc = json.loads(result.read_text())
    assert doc["passed"] is False
    name = doc["self_test_corrupted"]
    assert name.endswith("down_proj.weight")
    assert name in doc["correctness"]["error"] and "bytes differ" in doc["correctness"]["error"]
    assert "MISMATCH" in proc.stderr and name in proc.stderr
    assert "load" not in doc and "ceilings" not in doc  # nothing timed
    assert "GB/s" not in proc.stdout
