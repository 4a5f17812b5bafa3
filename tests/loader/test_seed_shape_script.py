"""benchmarks/seed_shape.py end to end at --tiny: the seed's structure (141 shards, 256 routed + 1
shared expert per MoE layer, FP8 block scales) through pack → push → pull --cache → load as 8 gloo
rank processes at TP=8 + EP=8, and the byte accounting its JSON reports.

A real generated checkpoint, a real loopback registry, real rank processes; the script's own
correctness check compares every rank with safetensors' cut of the same files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.paths import REPO_ROOT

SCRIPT = REPO_ROOT / "benchmarks" / "seed_shape.py"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("seed")
    out = tmp / "seed.json"
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--tiny",
            "--layouts",
            "tp8_ep8",
            "--rows",
            "modelpack-stream-group,modelpack-hit,safetensors",
            "--workdir",
            str(tmp),
            "--json-out",
            str(out),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp,
        timeout=540,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc: dict[str, Any] = json.loads(out.read_text())
    doc["_stdout"] = proc.stdout
    doc["_tmp"] = tmp
    return doc


def test_the_checkpoint_has_the_seeds_structure_and_every_rank_matches_safetensors(
    tiny: dict[str, Any],
) -> None:
    """141 shards, 256 routed + 1 shared expert, FP8 blocks; every rank of every row hashed equal
    to safetensors' share of the same files, so the run passed."""
    model = tiny["model"]
    assert model["files"] == 141
    assert (model["routed_experts"], model["shared_experts"]) == (256, 1)
    assert model["weight_block_size"] >= 1 and model["tensors"] > 256 * 6
    assert tiny["passed"] is True and tiny["correctness"]["passed"] is True
    assert tiny["correctness"]["mismatches"] == []
    rows = tiny["loads"]["tp8_ep8"]
    for row in ("modelpack-stream-group", "modelpack-hit", "safetensors"):
        ranks = rows[row]["runs"][0]["ranks"]
        assert [r["rank"] for r in ranks] == list(range(8))
        assert len({r["pid"] for r in ranks}) == 8  # one process per rank
        assert len({r["digest"] for r in ranks}) == 8  # ranks hold different shares
    assert not any(tmp.name.startswith("mp-seed-") for tmp in Path(tiny["_tmp"]).iterdir())  # cleaned up


def test_an_ep8_rank_reads_its_experts_replicated_and_tp_share_within_5_percent(tiny: dict[str, Any]) -> None:
    """From the node cache, each EP=8 rank's tensor reads are at most what it holds (its 32
    experts whole, the replicated tensors, its TP=8 share of the rest; verified equal to
    safetensors' cut) + 5 %; of the routed experts it reads exactly its own. The safetensors
    headers are counted apart."""
    hit = tiny["loads"]["tp8_ep8"]["modelpack-hit"]
    model = tiny["model_bytes"]
    for r in hit["per_rank"]:
        held = r["bytes_delivered"]
        assert r["bytes_needed"] == held, r["rank"]
        assert r["tensor_bytes_read"] <= held * 1.05, (r["rank"], r["tensor_bytes_read"], held)
        assert r["within_needed_plus_5pct"] is True
        expert = r["bytes_by_split"]["expert"]
        assert expert["read"] == expert["planned"] > 0
        assert expert["planned"] <= expert["tensorBytes"] / 8 * 1.05  # its 32 of 256 experts
        assert held < 0.25 * model  # far less than the model
    assert hit["node_bytes_read"] - sum(r["header_bytes_read"] for r in hit["per_rank"]) <= 1.05 * model


def test_a_group_of_streamed_ranks_reads_the_model_once_and_the_second_pull_is_a_hit(
    tiny: dict[str, Any],
) -> None:
    """Streamed from the registry with the ranks sharing chunk reads over the gloo group, the node
    fetches ≤ 1.05× the model; the second pull --cache downloads nothing; the timeline has
    t4−t3 and t5−t3 for the streamed and the hit starts."""
    group = tiny["loads"]["tp8_ep8"]["modelpack-stream-group"]
    assert group["node_over_model"] <= 1.05
    assert all(r["bytes_read"] > 0 for r in group["per_rank"])
    assert tiny["pull_again"]["bytesDownloaded"] == 0
    assert tiny["pull"]["bytesDownloaded"] >= tiny["model_bytes"]
    for state in ("streamed", "hit"):
        spans = tiny["timeline"][state]
        for span in ("t4-t3", "t5-t3"):
            assert spans[span]["count"] >= 1 and spans[span]["p50_ms"] >= 0
    assert "| tp8_ep8 | modelpack-hit |" in tiny["table_markdown"]
