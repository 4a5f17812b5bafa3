"""Node-cache hot-hit latency vs re-hashing the same files (DESIGN §5, issue 5).

A generated 141-file model (136 safetensors shards + index + config/tokenizer/README) is packed
into an OCI layout, pulled once into a fresh cache, then pulled again pinned by digest: that hit
must cost no hashing and no I/O on the source, so its latency should stay flat (goal < 50 ms)
whatever the model size. The peer measured in the same run is what a cache without ready
markers would have to do on every start: re-hash every file of the snapshot.

    .venv/bin/python benchmarks/cache_hit.py [--sizes 64,512] [--repeat 50] [--workdir /tmp]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from modelpack.mount import NodeCache

from modelpack import api
from modelpack.oci.digest import sha256_file
from modelpack.testdata.synthetic import SyntheticSpec, write_checkpoint

SHARDS = 136  # + model.safetensors.index.json + 4 small files = 141 files


def spec_for(mib: int) -> SyntheticSpec:
    layers, vocab = 16, 4096
    target = mib * 1024 * 1024
    hidden = 64
    while True:
        inter = (int(hidden * 2.6875) + 7) // 8 * 8
        size = 2 * (2 * vocab * hidden + layers * (4 * hidden * hidden + 3 * hidden * inter))
        if size >= target:
            break
        hidden += 32
    return SyntheticSpec(
        hidden=hidden, intermediate=inter, layers=layers, heads=8, kv_heads=8, vocab=vocab, shards=SHARDS
    )


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def run(mib: int, repeat: int, workdir: str) -> dict[str, float]:
    root = tempfile.mkdtemp(prefix="cache-hit-", dir=workdir)
    try:
        ckpt = os.path.join(root, "ckpt")
        write_checkpoint(ckpt, spec_for(mib))
        files = sorted(os.listdir(ckpt))
        assert len(files) == 141, len(files)
        total = sum(os.path.getsize(os.path.join(ckpt, f)) for f in files)
        layout = os.path.join(root, "layout")
        digest = str(api.pack(ckpt, f"oci:{layout}:v1").artifact.digest)
        cache = NodeCache(os.path.join(root, "cache"))
        t = time.perf_counter()
        cold = cache.pull(f"oci:{layout}:v1")
        cold_s = time.perf_counter() - t
        ref = f"oci:{layout}@{digest}"
        hits = []
        for _ in range(repeat):
            t = time.perf_counter()
            res = cache.pull(ref)
            hits.append(time.perf_counter() - t)
            assert res.state == "hit" and res.bytes_downloaded == 0
        # peer: re-hash the snapshot's files (what a start without a trusted ready marker costs)
        rehash = []
        for _ in range(3):
            t = time.perf_counter()
            for f in files:
                sha256_file(os.path.join(cold.path, f))
            rehash.append(time.perf_counter() - t)
        # the CLI end to end (includes Python start-up and imports)
        t = time.perf_counter()
        subprocess.run(
            [os.path.join(os.path.dirname(sys.executable), "modelpack"), "pull", ref, "--cache", cache.root],
            check=True,
            capture_output=True,
        )
        cli_s = time.perf_counter() - t
        return {
            "mib": total / 2**20,
            "files": len(files),
            "cold_s": cold_s,
            "hit_p50_ms": statistics.median(hits) * 1000,
            "hit_p95_ms": percentile(hits, 0.95) * 1000,
            "rehash_ms": min(rehash) * 1000,
            "cli_hit_ms": cli_s * 1000,
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="64,512", help="model sizes in MiB, comma-separated")
    ap.add_argument("--repeat", type=int, default=50)
    ap.add_argument("--workdir", default=tempfile.gettempdir())
    args = ap.parse_args()
    print(
        f"{'model':>10} {'files':>5} {'cold pull':>10} {'hit p50':>9} {'hit p95':>9} {'re-hash':>10} "
        f"{'re-hash/hit':>11} {'CLI hit':>9}"
    )
    for mib in (int(x) for x in args.sizes.split(",")):
        r = run(mib, args.repeat, args.workdir)
        print(
            f"{r['mib']:>7.0f}MiB {r['files']:>5} {r['cold_s']:>9.2f}s {r['hit_p50_ms']:>7.2f}ms "
            f"{r['hit_p95_ms']:>7.2f}ms {r['rehash_ms']:>8.1f}ms {r['rehash_ms'] / r['hit_p50_ms']:>10.0f}x "
            f"{r['cli_hit_ms']:>7.0f}ms"
        )
    print("goal: hit < 50 ms and flat across sizes; 're-hash' is the peer (verify every file on start)")


if __name__ == "__main__":
    main()
