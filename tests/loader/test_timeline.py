"""``modelpack timeline``: per-stage p50/p95 per cache state, from real and synthetic event logs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from modelpack.loader import emit_check, load_state_dict
from modelpack.loader.timeline import group_starts, percentile, summarize, timeline

from modelpack.cli import main
from modelpack.errors import TimelineError
from modelpack.events import EventLog
from modelpack.testdata.synthetic import SyntheticSpec, write_checkpoint
from tests.loader_helpers import pack_layout, reference_tensors


def _write(path: Path, events: list[dict[str, object]]) -> None:
    with open(path, "a") as f:
        for e in events:
            f.write(json.dumps(e) + "\n")


def _start(
    sid: str, state: str, t0: float, steps: dict[str, float]
) -> tuple[list[dict[str, object]], list[dict[str, object]]]:
    """Cache events (t2, and for cold a download t3/t4) and loader events (t3, t4, t5, t9)."""
    cache = [{"ts": t0, "event": "cache.pull_start", "start_id": sid}]
    cache.append(
        {"ts": t0 + steps["t2"], "event": "cache.resolved", "stage": "t2", "state": state, "start_id": sid}
    )
    if state == "cold":
        cache.append(
            {
                "ts": t0 + steps["t2"] + 0.001,
                "event": "cache.download_start",
                "stage": "t3",
                "state": "cold",
                "start_id": sid,
            }
        )
    loader = [
        {
            "ts": t0 + steps["t3"],
            "event": "loader.read_start",
            "stage": "t3",
            "state": "hit",
            "start_id": sid,
        },
        {"ts": t0 + steps["t4"], "event": "loader.read_done", "stage": "t4", "state": "hit", "start_id": sid},
        {
            "ts": t0 + steps["t5"],
            "event": "loader.device_done",
            "stage": "t5",
            "state": "hit",
            "start_id": sid,
        },
        {"ts": t0 + steps["t9"], "event": "loader.check", "stage": "t9", "passed": True, "start_id": sid},
    ]
    return cache, loader


def test_percentiles_and_states_from_merged_logs(tmp_path: Path) -> None:
    cache_log, loader_log = tmp_path / "cache.jsonl", tmp_path / "loader.jsonl"
    # 20 hit starts whose read takes 10..200 ms, 5 cold starts, 3 streamed (no cache events)
    for i in range(20):
        c, ld = _start(
            f"h{i}",
            "hit",
            1000.0 + i,
            {"t2": 0.002, "t3": 0.005, "t4": 0.005 + 0.01 * (i + 1), "t5": 0.3, "t9": 0.4},
        )
        _write(cache_log, c)
        _write(loader_log, ld)
    for i in range(5):
        c, ld = _start(f"c{i}", "cold", 2000.0 + i, {"t2": 0.05, "t3": 2.0, "t4": 3.0, "t5": 3.1, "t9": 3.2})
        _write(cache_log, c)
        _write(loader_log, ld)
    for i in range(3):
        _, ld = _start(
            f"s{i}", "streamed", 3000.0 + i, {"t2": 0, "t3": 0.01, "t4": 1.0, "t5": 1.5, "t9": 1.6}
        )
        for e in ld:
            e["state"] = "streamed"
        _write(loader_log, ld)
    _write(loader_log, [{"ts": 5.0, "event": "unrelated"}])  # no start_id: ignored
    s = timeline([str(cache_log), str(loader_log)])
    assert s["starts"] == 28
    hit, cold, streamed = (s["states"][k] for k in ("hit", "cold", "streamed"))
    assert (hit["starts"], cold["starts"], streamed["starts"]) == (20, 5, 3)
    # t4 since t0 for hits: 15, 25, …, 205 ms → nearest-rank p50 = 10th = 105, p95 = 19th = 195
    assert hit["stages"]["t4"]["at"] == {
        "count": 20,
        "p50Ms": pytest.approx(105, abs=0.01),
        "p95Ms": pytest.approx(195, abs=0.01),
    }
    assert hit["stages"]["t3"]["interval"]["p50Ms"] == pytest.approx(3, abs=0.01)
    # cold: the cache's download start is the first t3 (first event wins for start points)
    assert cold["stages"]["t3"]["at"]["p50Ms"] == pytest.approx(51, abs=0.01)
    assert cold["stages"]["t4"]["at"]["p50Ms"] == pytest.approx(3000, abs=0.01)
    # streamed starts never confirmed a version through the cache
    assert streamed["stages"]["t2"]["at"]["count"] == 0
    # their t0 is the loader's read start (no pull events): t9 comes 1.59 s later
    assert streamed["stages"]["t9"]["at"]["p95Ms"] == pytest.approx(1590, abs=0.01)
    assert s["states"]["all"]["stages"]["t9"]["at"]["count"] == 28
    runner = CliRunner()
    res = runner.invoke(main, ["timeline", str(cache_log), str(loader_log), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output) == json.loads(json.dumps(s))
    res = runner.invoke(main, ["timeline", str(cache_log), str(loader_log)])
    assert (
        res.exit_code == 0 and "state cold (5 starts)" in res.output and "t5 device load done" in res.output
    )


def test_failed_checks_do_not_count_and_bad_logs_are_refused(tmp_path: Path) -> None:
    log = tmp_path / "e.jsonl"
    _write(
        log,
        [
            {"ts": 1.0, "event": "loader.read_start", "stage": "t3", "start_id": "x"},
            {"ts": 2.0, "event": "loader.check", "stage": "t9", "passed": False, "start_id": "x"},
        ],
    )
    starts = group_starts(json.loads(line) for line in log.read_text().splitlines())
    assert starts[0].state == "unknown" and "t9" not in starts[0].stages
    assert summarize(starts)["states"]["all"]["stages"]["t9"]["at"]["count"] == 0
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"ts": 1, "event": "a"}\nnot json\n')
    with pytest.raises(TimelineError, match=r"bad.jsonl:2"):
        timeline([str(bad)])
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0 and percentile([1.0], 95) == 1.0


def test_real_cache_pull_and_load_make_a_timeline(tmp_path: Path) -> None:
    from modelpack.mount.cache import NodeCache

    ckpt = tmp_path / "ckpt"
    write_checkpoint(str(ckpt), SyntheticSpec(shards=2))
    ref_tensors = reference_tensors(ckpt)
    layout = pack_layout(ckpt, tmp_path / "layout")
    events = tmp_path / "events.jsonl"
    cache = NodeCache(str(tmp_path / "cache"), events=str(events))
    log = EventLog(str(events))
    for sid in ("cold-1", "hit-1", "hit-2"):
        result = cache.pull(f"oci:{layout.path}@{layout.digest}", start_id=sid)
        sd = load_state_dict(result.path, expected_digest=layout.digest, events=log, start_id=sid)
        assert all(torch.equal(sd[k], v) for k, v in ref_tensors.items())
        emit_check(log, start_id=sid, digest=layout.digest, passed=True)
    s = timeline([str(events)])
    assert s["states"]["cold"]["starts"] == 1 and s["states"]["hit"]["starts"] == 2
    for state in ("cold", "hit"):
        for stage in ("t2", "t3", "t4", "t5", "t9"):
            assert s["states"][state]["stages"][stage]["at"]["count"] == s["states"][state]["starts"], (
                state,
                stage,
            )


def test_a_streamed_start_records_its_own_version_confirmed_point(checkpoint: Path, tmp_path: Path) -> None:
    from modelpack.loader import load_state_dict

    from modelpack import api
    from modelpack.events import read_events

    digest = str(api.pack(str(checkpoint), f"oci:{tmp_path / 'l'}:v1").artifact.digest)
    log = tmp_path / "events.jsonl"
    load_state_dict(f"oci:{tmp_path / 'l'}@{digest}", events=str(log), start_id="s1")
    stages = [(e["stage"], e.get("state")) for e in read_events(str(log)) if e.get("stage")]
    assert stages[:2] == [("t2", "streamed"), ("t3", "streamed")]
    assert next(e for e in read_events(str(log)) if e.get("stage") == "t2")["digest"] == digest
