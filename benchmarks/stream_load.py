"""Streamed loads from a loopback registry, loader only (no engine): where the time goes (issue 25 item 1).

The model of ``vllm_start.py --weights-only`` (a generated 422 MiB float32 Llama, one file) is
pushed twice to a loopback registry, signed (``--sign-key``: chunk table) and unsigned. Rounds,
interleaved:

- ``streamed, chunk table``: ``iter_tensors(REF@sha256, trusted_keys=[key])``, every tensor then
  copied into a preallocated, pre-faulted parameter (what vLLM's ``weight_loader`` does);
- ``streamed, whole layers``: the same from the unsigned push (each layer hashed before use);
- ``transfer, raw`` / ``transfer, verified``: the weight blob as ``remote_inflight`` parallel
  ``curl -r`` ranges to ``/dev/null`` / through ``openssl sha256`` (the peer: the bytes alone).

Per load: wall seconds, CPU seconds of this process (all threads: reads, hashing, copies — the
number that barely moves when other work shares the cores; for the transfer rows, of the curl and
openssl processes), bytes copied through staging, and the summed worker-thread time inside range
reads and inside chunk hashing. The registry's own CPU is in neither.

    .venv/bin/python benchmarks/stream_load.py [--repeat 3] [--hidden 1024 --layers 4 --vocab 32000]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import modelpack.loader.chunked as chunked  # noqa: E402
import modelpack.loader.whole_layer as whole_layer  # noqa: E402
import torch  # noqa: E402
from modelpack.loader import LoaderOptions, LoadStats, iter_tensors  # noqa: E402
from modelpack.signing.keys import generate_key  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from benchmarks.vllm_weights import Blob, transfer  # noqa: E402
from modelpack import api  # noqa: E402
from tests.fixtures.registry import start_registry  # noqa: E402
from tests.vllm_helpers import write_tiny_llama  # noqa: E402


class WorkerClock:
    """Summed seconds worker threads spend in the loader's range reads and chunk hashing."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seconds = {"read": 0.0, "hash": 0.0}

    def wrap(self, fn: Callable[..., Any], key: str) -> Callable[..., Any]:
        def timed(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                with self.lock:
                    self.seconds[key] += time.perf_counter() - t

        return timed

    def install(self) -> None:
        for mod in (chunked, whole_layer):
            if hasattr(mod, "read_scatter"):
                mod.read_scatter = self.wrap(mod.read_scatter, "read")  # type: ignore[attr-defined]
        if hasattr(chunked, "verify_chunk_parts"):
            chunked.verify_chunk_parts = self.wrap(chunked.verify_chunk_parts, "hash")  # type: ignore[attr-defined]
        if hasattr(whole_layer, "_update"):
            whole_layer._update = self.wrap(whole_layer._update, "hash")  # type: ignore[attr-defined]

    def take(self) -> dict[str, float]:
        with self.lock:
            out = dict(self.seconds)
            self.seconds = {"read": 0.0, "hash": 0.0}
        return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="stream-load-", dir=args.workdir))
    try:
        return run(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(args: argparse.Namespace, work: Path) -> int:
    config = {
        "hidden_size": args.hidden,
        "intermediate_size": (int(args.hidden * 2.75) + 63) // 64 * 64,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.hidden // 32,
        "num_key_value_heads": max(1, args.hidden // 128),
        "vocab_size": args.vocab,
    }
    ckpt = write_tiny_llama(work / "checkpoint", config=config)
    files = sorted(ckpt.glob("*.safetensors"))
    size = sum(f.stat().st_size for f in files)
    params: dict[str, torch.Tensor] = {}
    for f in files:
        params.update({k: torch.zeros_like(v) for k, v in load_file(str(f)).items()})
    registry = start_registry(work / "registry")
    try:
        key = generate_key()
        signed = api.push(str(ckpt), registry.ref("bench/signed", "v1"), sign_key=key, progress="off")
        plain = api.push(str(ckpt), registry.ref("bench/plain", "v1"), progress="off")
        signed_ref = f"{registry.host}/bench/signed@{signed.digest}"
        plain_ref = f"{registry.host}/bench/plain@{plain.digest}"
        blobs = [
            Blob(f"{registry.url}/v2/bench/plain/blobs/sha256:{_sha(f)}", f.stat().st_size) for f in files
        ]
        clock = WorkerClock()
        clock.install()
        inflight = LoaderOptions().remote_inflight
        rows: dict[str, list[dict[str, float]]] = {}

        def load(ref: str, keys: list[Any] | None) -> dict[str, float]:
            stats = LoadStats()
            clock.take()
            t, c = time.perf_counter(), time.process_time()
            for name, tensor in iter_tensors(ref, trusted_keys=keys, stats=stats):
                params[name].copy_(tensor)
                del tensor
            wall, cpu = time.perf_counter() - t, time.process_time() - c
            worker = clock.take()
            return {"wall": wall, "cpu": cpu, "staged": getattr(stats, "staged_bytes", -1), **worker}

        for _ in range(args.repeat):
            la = os.getloadavg()[0]
            for name, fn in (
                ("streamed, chunk table", lambda: load(signed_ref, [key.public])),
                ("streamed, whole layers", lambda: load(plain_ref, None)),
                ("transfer, raw", lambda: _children(lambda: transfer(blobs, inflight, verify=False))),
                ("transfer, verified", lambda: _children(lambda: transfer(blobs, inflight, verify=True))),
            ):
                row = fn()
                row["load"] = la
                rows.setdefault(name, []).append(row)
    finally:
        registry.stop()
    loads = [r["load"] for rs in rows.values() for r in rs]
    print(
        f"streamed loads, loader only, {size / 2**20:.1f} MiB in {len(files)} file(s) from a loopback registry, "
        f"{args.repeat} interleaved rounds, load average {min(loads):.1f}–{max(loads):.1f}; code: {chunked.__file__}"
    )
    print()
    print(
        "| row | wall best / median | CPU best / median | staged | worker time in reads / hashing (median) |"
    )
    print("|---|---|---|---|---|")
    for name, rs in rows.items():
        wall = [r["wall"] for r in rs]
        line = f"| {name} | {min(wall):.2f} / {statistics.median(wall):.2f} s |"
        cpu = [r["cpu"] for r in rs]
        line += f" {min(cpu):.2f} / {statistics.median(cpu):.2f} s |"
        if "staged" in rs[0]:
            staged = int(rs[0]["staged"])
            line += f" {staged / 2**20:.0f} MiB |" if staged >= 0 else " (not counted) |"
            reads = statistics.median(r["read"] for r in rs)
            line += f" {reads:.2f} / {statistics.median(r['hash'] for r in rs):.2f} s |"
        else:
            line += " (curl + openssl processes) | |"
        print(line)
    return 0


def _children(fn: Callable[[], float]) -> dict[str, float]:
    """Wall seconds of ``fn`` and the CPU seconds (user + sys) of the processes it ran."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    wall = fn()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"wall": wall, "cpu": after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime}


def _sha(path: Path) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


if __name__ == "__main__":
    os.environ.setdefault("CI", "1")
    sys.exit(main())
