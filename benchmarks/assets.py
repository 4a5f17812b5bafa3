"""Start-up compile time (t6) cold vs warm from the registry: runtime assets on CPU (issue 15).

A small transformer-style block (LayerNorm → Linear → GELU → Linear with a residual, several
layers) is compiled with ``torch.compile`` (Inductor's CPU backend: the machine's C++ compiler)
in fresh processes, interleaved so both contenders see the same machine load:

  cold       empty TORCHINDUCTOR_CACHE_DIR, no asset stored: Inductor compiles from scratch
  registry   empty TORCHINDUCTOR_CACHE_DIR; the engine hook (``fetch_before_compile``) pulls the
             matching, signed asset from a local registry (verified, materialised atomically),
             then Inductor compiles from its cache — t6 excludes the fetch, the total includes it
  local      the ceiling: the same cache already on the local disk (no fetch at all)

The asset is pushed once (``push_asset``, signed) from the first cold run's cache. Each run
writes t6 through ``compile_stage``; ``modelpack timeline`` over the events file reports the
same numbers per asset state. Every process also prints Inductor's own counters (FX graph
cache hits/misses) so a "warm" run that silently compiled is caught.

    .venv/bin/python benchmarks/assets.py [--repeat 3] [--layers 4] [--hidden 256] [--workdir /tmp]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from modelpack.loader.timeline import format_table, timeline  # noqa: E402
from modelpack.signing.keys import generate_key, write_keypair  # noqa: E402

from modelpack import api  # noqa: E402
from modelpack.assets import push_asset  # noqa: E402
from modelpack.testdata.synthetic import SyntheticSpec, write_checkpoint  # noqa: E402
from tests.fixtures.registry import start_registry  # noqa: E402

RUN = r"""
import contextlib, json, os, sys, time
t_start = time.perf_counter()
args = json.loads(sys.argv[1])
# An engine has torch loaded and its model built (weights in place) before it asks for assets:
# keep those out of both the fetch and t6, so t6 is the compile and the fetch is the fetch.
import torch
from torch._dynamo.utils import counters
from modelpack.assets import compile_stage, fetch_before_compile
from modelpack.events import EventLog
from modelpack.signing.keys import load_public_key
torch.manual_seed(0)

class Block(torch.nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.norm = torch.nn.LayerNorm(hidden)
        self.up = torch.nn.Linear(hidden, 4 * hidden)
        self.down = torch.nn.Linear(4 * hidden, hidden)
    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))

model = torch.nn.Sequential(*[Block(args["hidden"]) for _ in range(args["layers"])]).eval()
compiled = torch.compile(model)
x = torch.randn(8, 64, args["hidden"])
events = EventLog(args["events"])
state, fetch_ms = "none", 0.0
if args["fetch"]:
    t = time.perf_counter()
    res = fetch_before_compile(args["model"], os.environ["TORCHINDUCTOR_CACHE_DIR"], "inductor",
                               policy=[load_public_key(args["key"])], events=events, start_id=args["start_id"])
    fetch_ms, state = (time.perf_counter() - t) * 1000, res.state
elif args["local"]:
    state = "hit"
with torch.no_grad(), compile_stage(events, asset_state=state, start_id=args["start_id"]) as info:
    y = compiled(x)
print(json.dumps({"t6_ms": info["duration_ms"], "fetch_ms": fetch_ms, "state": state,
                  "inductor": dict(counters["inductor"]), "checksum": float(y.double().sum()),
                  "process_s": time.perf_counter() - t_start}))
"""


def run(cache_dir: Path, **args: Any) -> dict[str, Any]:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir), "TORCHINDUCTOR_FX_GRAPH_CACHE": "1"}
    t = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", RUN, json.dumps(args)], env=env, capture_output=True, text=True
    )
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        raise SystemExit(f"compile run failed:\n{proc.stderr[-4000:]}")
    doc: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    doc["wall_s"] = wall
    return doc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3, help="rounds of cold / registry / local (default 3)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument(
        "--workdir", default=None, help="where to put the registry and caches (default: a temp dir)"
    )
    opts = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench-assets-", dir=opts.workdir))
    os.environ.setdefault("MODELPACK_UPLOAD_STATE_DIR", str(work / "upload-state"))
    server = start_registry(work / "registry")
    try:
        write_checkpoint(str(work / "ckpt"), SyntheticSpec(shards=2))
        digest = str(api.push(str(work / "ckpt"), server.ref("bench/assets", "v1")).digest)
        model = f"{server.host}/bench/assets@{digest}"
        priv, pub = write_keypair(str(work / "ci"), generate_key())
        events = work / "events.jsonl"
        common = {
            "model": model,
            "key": pub,
            "events": str(events),
            "layers": opts.layers,
            "hidden": opts.hidden,
        }
        rows: dict[str, list[dict[str, Any]]] = {"cold": [], "registry": [], "local": []}
        local_cache = work / "local-cache"
        for r in range(opts.repeat):
            cold_dir = work / f"cold-{r}"
            rows["cold"].append(run(cold_dir, fetch=False, local=False, start_id=f"cold-{r}", **common))
            if r == 0:
                t = time.perf_counter()
                pushed = push_asset(model, cold_dir, "inductor", sign_key=priv)
                print(
                    f"asset pushed in {time.perf_counter() - t:.2f} s: {pushed.files} files, "
                    f"{pushed.bytes / 1e6:.2f} MB ({pushed.compressed_bytes / 1e6:.2f} MB compressed), "
                    f"{pushed.asset.digest}"
                )
                shutil.copytree(cold_dir, local_cache)
            rows["registry"].append(
                run(work / f"registry-{r}", fetch=True, local=False, start_id=f"registry-{r}", **common)
            )
            local_args = {**common, "events": str(work / "events-local.jsonl")}  # not a registry start
            rows["local"].append(
                run(local_cache, fetch=False, local=True, start_id=f"local-{r}", **local_args)
            )
        checksums = {round(d["checksum"], 6) for rs in rows.values() for d in rs}
        assert len(checksums) == 1, f"compiled results differ: {checksums}"
        for name, rs in rows.items():
            for d in rs:
                hits, misses = (
                    d["inductor"].get("fxgraph_cache_hit", 0),
                    d["inductor"].get("fxgraph_cache_miss", 0),
                )
                expected = (hits == 0 and misses > 0) if name == "cold" else (hits > 0 and misses == 0)
                if not expected or d["state"] != ("none" if name == "cold" else "hit"):
                    raise SystemExit(
                        f"{name} run: state {d['state']}, {hits} FX graph hits, {misses} misses: {d}"
                    )

        def med(name: str, key: str) -> float:
            return statistics.median(d[key] for d in rows[name])

        cold_t6 = med("cold", "t6_ms")
        print(
            f"\nt6 (first compiled call), median of {opts.repeat} fresh processes, {opts.layers} blocks x {opts.hidden}:"
        )
        print(f"{'contender':<44} {'t6 ms':>10} {'fetch ms':>10} {'t6+fetch ms':>12} {'vs cold':>9}")
        for name, label in (
            ("cold", "cold (empty cache, no asset)"),
            ("registry", "warm from registry (fetch_before_compile)"),
            ("local", "warm, cache already on disk (ceiling)"),
        ):
            t6, fetch = med(name, "t6_ms"), med(name, "fetch_ms")
            print(
                f"{label:<44} {t6:>10.0f} {fetch:>10.0f} {t6 + fetch:>12.0f} {cold_t6 / (t6 + fetch):>8.1f}x"
            )
        print("\nmodelpack timeline over the cold and registry runs:")
        print(format_table(timeline([str(events)])))
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
