"""benchmarks/gpu_load.py checks correctness before it measures, and says so in its JSON.

The script is what a CUDA machine runs when one is lent; here it runs ``--dry`` (``--device cpu``,
16 MiB, TP=2), the same code path except the copy ceilings (host memcpys instead of pinned and
pageable H2D). A real generated checkpoint, real safetensors reference, real loader in rank
processes, a real loopback registry and node cache, the real peers.
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
    tmp_path: Path, *extra: str, out_env: bool = False, env_extra: dict[str, str] | None = None
) -> tuple[subprocess.CompletedProcess[str], Path]:
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    env.update(env_extra or {})
    argv = [sys.executable, str(SCRIPT), "--dry", "--dir", str(tmp_path / "ckpt"), *extra]
    if out_env:
        env["OUT"] = str(tmp_path / "out")
        result = tmp_path / "out" / "gpu_load.json"
    else:
        result = tmp_path / "result.json"
        argv += ["--json-out", str(result)]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=240)
    return proc, result


def test_dry_run_checks_every_rank_then_measures_ceilings_groups_and_delivery_rows(tmp_path: Path) -> None:
    """--dry (CPU, 16 MiB, TP=2): correctness before any timing, the pinned and pageable copy
    ceilings, the TP group as concurrent processes, then the node-cache hit, the chunk-verified
    stream from a loopback registry and the peers on the same files, each compared on the device;
    a peer that cannot be imported is a skipped row with the reason, never a number."""
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "runai_model_streamer.py").write_text('raise ImportError("hidden by the test")\n')
    proc, result = run_script(
        tmp_path, out_env=True, env_extra={"PYTHONPATH": f"{shadow}{os.pathsep}{ROOT}"}
    )  # default JSON path: $OUT/gpu_load.json
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc: dict[str, Any] = json.loads(result.read_text())
    assert doc["passed"] is True and doc["device"] == "cpu"
    assert 14 << 20 <= doc["size_bytes"] <= 18 << 20
    corr = doc["correctness"]
    for tp in (1, 2):
        entry = corr[f"tp{tp}"]
        assert entry["passed"] is True
        assert [r["rank"] for r in entry["ranks"]] == list(range(tp))
        assert {r["tensors"] for r in entry["ranks"]} == {corr["tp1"]["ranks"][0]["tensors"]}
    full = corr["tp1"]["ranks"][0]["bytes_checked"]
    per_rank = [r["bytes_checked"] for r in corr["tp2"]["ranks"]]
    assert len(set(per_rank)) == 1 and full / 2 <= per_rank[0] < full / 2 * 1.05
    assert set(corr["tp2"]["split_kinds"]) == {"dim0", "dim1", "replicate"}
    # the machine: no GPU in a CPU run, and the JSON says why
    machine = doc["machine"]
    assert machine["gpus"] == 0 and "cpu" in machine["torch_props"]["skipped"]
    assert isinstance(machine["nvidia_smi"], list) or machine["nvidia_smi"]["skipped"]
    ceilings = doc["ceilings"]
    assert ceilings["pinned_h2d_gbps"] > 0 and ceilings["pageable_h2d_gbps"] > 0
    assert "host memcpy" in ceilings["copy_kind"] and "host memcpy" in ceilings["pageable_kind"]
    for key in ("tp1", "tp1_out", "tp2_slowest_rank"):
        m = doc["load"][key]
        assert m["gbps"] > 0 and m["seconds"] > 0 and m["vs_copy_ceiling"] > 0
    group = doc["load"]["tp2_group"]
    assert group["processes"] == 2 and group["concurrent"] is True
    assert len({r["pid"] for r in group["ranks"]}) == 2 and os.getpid() not in {
        r["pid"] for r in group["ranks"]
    }
    assert group["wall_seconds"] >= max(r["seconds"] for r in group["ranks"])
    # delivery: the same files through the cache, the registry and the peers, checked on the device
    delivery = doc["delivery"]
    assert delivery["stream_source"] == "loopback docker-registry"
    rows = delivery["rows"]
    hit = rows["modelpack hit (verified node cache)"]
    assert hit["state"] == "hit" and hit["checked_on_device"] is True
    stream = rows["modelpack stream (chunk-verified, loopback docker-registry)"]
    assert stream["state"] == "streamed" and stream["verification"] == ["chunks"]
    assert stream["bytes_read"] >= doc["size_bytes"]
    # a standalone TP=2 rank, checked against torch's own halves (what it reads of this tiny
    # model, whose tensors share chunks, is about all of it: the number is for a GPU run's sizes)
    share = rows["modelpack stream, standalone TP=2 rank 0 (column reads, OCI layout)"]
    assert share["checked_on_device"] is True and share["verification"] == ["chunks"]
    assert share["read_vs_model"] > 0 and share["bytes"] < hit["bytes"]
    # a first start through a fresh node cache: on the host the cache's verdict vouches
    cold = rows["modelpack stream + node cache (first start, publish in background)"]
    assert cold["checked_on_device"] is True and cold["cache"] == "filled"
    assert cold["verification"] == ["committed"] and cold["publish_after_s"] >= 0
    for label in ("safetensors load_file", "fastsafetensors (nogds)"):
        assert rows[label]["checked_on_device"] is True
    for label, row in rows.items():
        if "skipped" not in row:
            assert row["gbps"] > 0 and row["vs_pinned_h2d"] > 0 and row["vs_pageable_h2d"] > 0, label
    runai = rows["runai-model-streamer (concurrency 16)"]
    assert set(runai) == {"skipped"} and "hidden by the test" in runai["skipped"]
    assert "runai-model-streamer (concurrency 16)" in proc.stdout and "skipped" in proc.stdout
    assert not (tmp_path / "ckpt").exists()  # generated data removed unless --keep
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("mp-gpu-delivery-")]


def test_a_corrupted_tensor_fails_before_anything_is_measured(tmp_path: Path) -> None:
    proc, result = run_script(tmp_path, "--self-test-corrupt")
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    doc = json.loads(result.read_text())
    assert doc["passed"] is False
    name = doc["self_test_corrupted"]
    assert name.endswith("down_proj.weight")
    assert name in doc["correctness"]["error"] and "bytes differ" in doc["correctness"]["error"]
    assert "MISMATCH" in proc.stderr and name in proc.stderr
    assert "load" not in doc and "ceilings" not in doc and "delivery" not in doc  # nothing timed
    assert "GB/s" not in proc.stdout
