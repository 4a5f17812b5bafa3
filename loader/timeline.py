"""Model start-up timelines from event logs (docs/loader.md#events-and-modelpack-timeline): p50/p95 per stage, per cache state.

Stages: t2 version confirmed (manifest digest resolved and verified) → t3 read start → t4 read
done → t5 device load done → t6 compile done (JIT/autotune) → t8 serving engine healthy (its
health endpoint answers) → t9 first deterministic check passed. Events of one model start share a
``start_id`` (the node cache, the loader and the serving engine write into the same or separate
logs; all files given are merged). For each start:

- t0 is its earliest event; a ``stage: t0`` event (the serving engine's process start, or the
  pod's creation when given) puts the origin where the start really began. A stage's time is
  measured from t0 (``at``) and from the previous stage present (``interval``);
- the seed's spans (``SPANS``: t4−t3 read, t5−t3 read and device copy, t8−t0 to healthy, t9−t0
  to a correct answer) are reported on their own, over the starts that reached both ends;
- start points (t2, t3) take the stage's FIRST event, completion points (t4, t5, t6, t9) its LAST:
  on a cold start the cache's download is the first read and the loader's copy the last, so
  t3 → t4 spans both;
- the state is the first ``cold`` / ``hit`` / ``streamed`` seen (the cache states it at t2,
  before the loader does), else ``unknown``;
- the runtime-asset state (``asset_state``: none | hit | refused, ``modelpack.assets``) says
  whether t6 compiled from a shipped cache; t6 is also summarised per asset state.

Percentiles use the nearest-rank method on the starts that reached the stage.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from modelpack import boundedjson
from modelpack.errors import DocumentError, TimelineError

STAGES = ("t2", "t3", "t4", "t5", "t6", "t8", "t9")
STAGE_NAMES = {
    "t2": "version confirmed",
    "t3": "read start",
    "t4": "read done",
    "t5": "device load done",
    "t6": "compile done",
    "t8": "engine healthy",
    "t9": "check passed",
}
# (end, begin) pairs reported with their own p50/p95 (the seed's §6.2); "t0" is the start's origin
SPANS = (("t4", "t3"), ("t5", "t3"), ("t8", "t0"), ("t9", "t0"))
_FIRST = {"t2", "t3"}
STATES = ("cold", "hit", "streamed")
ASSET_STATES = ("none", "hit", "refused")  # of the compile cache, reported with t6
MAX_LINE_BYTES = 1024 * 1024
MAX_FILE_BYTES = 1024 * 1024 * 1024


def read_event_file(path: str) -> list[dict[str, Any]]:
    """Events of one JSON-lines file; bounded (1 MiB per line, 1 GiB per file)."""
    out: list[dict[str, Any]] = []
    total = 0
    try:
        with open(path, "rb") as f:
            for n, raw in enumerate(f, 1):
                total += len(raw)
                if total > MAX_FILE_BYTES:
                    raise TimelineError(f"{path}: larger than {MAX_FILE_BYTES} bytes")
                if len(raw) > MAX_LINE_BYTES:
                    raise TimelineError(f"{path}:{n}: line longer than {MAX_LINE_BYTES} bytes")
                line = raw.strip()
                if not line:
                    continue
                try:
                    doc = boundedjson.loads(line, what=f"{path}:{n}", max_bytes=MAX_LINE_BYTES)
                except DocumentError as exc:
                    raise TimelineError(f"{path}:{n}: not a JSON line: {exc.reason}") from exc
                if isinstance(doc, dict) and isinstance(doc.get("event"), str):
                    out.append(doc)
    except OSError as exc:
        raise TimelineError(f"{path}: cannot read: {exc.strerror}") from exc
    return out


@dataclass
class Start:
    start_id: str
    state: str
    t0: float
    stages: dict[str, float] = field(default_factory=dict)  # stage → absolute ts
    digest: str | None = None
    asset_state: str | None = None

    def at_ms(self, stage: str) -> float | None:
        ts = self.stages.get(stage)
        return None if ts is None else (ts - self.t0) * 1000.0

    def span_ms(self, end: str, begin: str) -> float | None:
        """``end`` − ``begin`` (either may be ``t0``), or None when the start lacks one of them."""
        te = self.t0 if end == "t0" else self.stages.get(end)
        tb = self.t0 if begin == "t0" else self.stages.get(begin)
        if te is None or tb is None:
            return None
        return (te - tb) * 1000.0

    def interval_ms(self, stage: str) -> float | None:
        """From the previous stage this start reached (or t0) to ``stage``."""
        ts = self.stages.get(stage)
        if ts is None:
            return None
        prev = self.t0
        for s in STAGES:
            if s == stage:
                break
            if s in self.stages:
                prev = self.stages[s]
        return (ts - prev) * 1000.0


def group_starts(events: Iterable[Mapping[str, Any]]) -> list[Start]:
    by_id: dict[str, list[Mapping[str, Any]]] = {}
    for e in events:
        sid = e.get("start_id")
        ts = e.get("ts")
        if not isinstance(sid, str) or not sid or not isinstance(ts, (int, float)):
            continue
        by_id.setdefault(sid, []).append(e)
    starts = []
    for sid, evs in by_id.items():
        evs = sorted(evs, key=lambda e: float(e["ts"]))
        state = next((e["state"] for e in evs if e.get("state") in STATES), "unknown")
        digest = next((e["digest"] for e in evs if isinstance(e.get("digest"), str)), None)
        asset_state = next((e["asset_state"] for e in evs if e.get("asset_state") in ASSET_STATES), None)
        st = Start(sid, state, float(evs[0]["ts"]), digest=digest, asset_state=asset_state)
        for e in evs:
            stage = e.get("stage")
            if stage not in STAGES:
                continue
            if stage == "t9" and e.get("passed") is False:
                continue
            ts = float(e["ts"])
            if stage in _FIRST:
                st.stages.setdefault(stage, ts)
            else:
                st.stages[stage] = ts
        starts.append(st)
    starts.sort(key=lambda s: s.t0)
    return starts


def percentile(values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile (p in 0..100) of a non-empty sequence."""
    ordered = sorted(values)
    rank = max(1, math.ceil(p / 100.0 * len(ordered)))
    return ordered[rank - 1]


def _summary(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"count": 0, "p50Ms": None, "p95Ms": None}
    return {
        "count": len(values),
        "p50Ms": round(percentile(values, 50), 3),
        "p95Ms": round(percentile(values, 95), 3),
    }


def summarize(starts: Sequence[Start]) -> dict[str, Any]:
    """{"starts": N, "states": {state: {"starts", "stages": {t: {at, interval}}}}} incl. "all"."""
    groups: dict[str, list[Start]] = {"all": list(starts)}
    for s in starts:
        groups.setdefault(s.state, []).append(s)
    out: dict[str, Any] = {"starts": len(starts), "states": {}}
    for state, members in groups.items():
        stages = {}
        for stage in STAGES:
            at = [v for v in (s.at_ms(stage) for s in members) if v is not None]
            iv = [v for v in (s.interval_ms(stage) for s in members) if v is not None]
            stages[stage] = {"name": STAGE_NAMES[stage], "at": _summary(at), "interval": _summary(iv)}
        spans = {
            f"{end}-{begin}": _summary([v for v in (s.span_ms(end, begin) for s in members) if v is not None])
            for end, begin in SPANS
        }
        out["states"][state] = {"starts": len(members), "stages": stages, "spans": spans}
    out["assets"] = {}
    for asset_state in ASSET_STATES:
        members = [s for s in starts if s.asset_state == asset_state]
        if members:
            at = [v for v in (s.at_ms("t6") for s in members) if v is not None]
            iv = [v for v in (s.interval_ms("t6") for s in members) if v is not None]
            out["assets"][asset_state] = {
                "starts": len(members),
                "t6": {"at": _summary(at), "interval": _summary(iv)},
            }
    return out


def timeline(paths: Sequence[str]) -> dict[str, Any]:
    events: list[dict[str, Any]] = []
    for p in paths:
        events.extend(read_event_file(p))
    return summarize(group_starts(events))


def format_table(summary: Mapping[str, Any]) -> str:
    lines = [f"{summary['starts']} model starts"]
    order = ["all", *STATES, "unknown"]
    for state in order:
        doc = summary["states"].get(state)
        if not doc or (state != "all" and not doc["starts"]):
            continue
        lines.append("")
        lines.append(f"state {state} ({doc['starts']} starts)")
        lines.append(
            f"  {'stage':<22} {'n':>5} {'p50 since t0':>14} {'p95 since t0':>14} {'p50 step':>10} {'p95 step':>10}"
        )
        for stage in STAGES:
            s = doc["stages"][stage]
            at, iv = s["at"], s["interval"]

            def ms(v: float | None) -> str:
                return "-" if v is None else f"{v:.1f} ms"

            lines.append(
                f"  {stage + ' ' + s['name']:<22} {at['count']:>5} {ms(at['p50Ms']):>14} {ms(at['p95Ms']):>14} "
                f"{ms(iv['p50Ms']):>10} {ms(iv['p95Ms']):>10}"
            )
        for span, sm in doc.get("spans", {}).items():
            if sm["count"]:
                end, begin = span.split("-")
                lines.append(
                    f"  {'span ' + end + '−' + begin:<22} {sm['count']:>5} {ms(sm['p50Ms']):>14} "
                    f"{ms(sm['p95Ms']):>14}"
                )
    for asset_state, doc in summary.get("assets", {}).items():
        iv = doc["t6"]["interval"]
        p50 = "-" if iv["p50Ms"] is None else f"{iv['p50Ms']:.1f} ms"
        p95 = "-" if iv["p95Ms"] is None else f"{iv['p95Ms']:.1f} ms"
        lines.append(
            f"compile (t6) with runtime assets {asset_state}: {doc['starts']} starts, step p50 {p50}, p95 {p95}"
        )
    return "\n".join(lines)
