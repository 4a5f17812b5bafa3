"""Pack throughput beside sha256sum and cat of the same files, in the same run.

    python benchmarks/pack.py [--size 2GiB] [--shards 4] [--dir /tmp/modelpack-bench]

Generates a ~2 GiB, 4-shard bf16 checkpoint (kept between runs), warms the page cache, then
times: ``cat`` to /dev/null, ``sha256sum`` one file at a time and with one process per core,
``openssl dgst -sha256`` with one process per core (the parallel-hash ceiling: coreutils has no
SHA-NI code path, OpenSSL and so hashlib do), and ``modelpack pack`` into an OCI layout on the same
filesystem (hard links/reflinks) and with ``--link copy`` semantics. Peak RSS is the child's
``ru_maxrss``. Goal (issue 2): pack ≥ 0.9 × the parallel-hash ceiling, peak RSS < 200 MB.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from modelpack.cli import parse_size
from modelpack.testdata.synthetic import SyntheticSpec, write_checkpoint

PACK_CHILD = """
import sys, time
from modelpack.targets.layout import OCILayoutTarget
from modelpack.packing.packer import build_artifact, PackOptions
from modelpack.transfer.copy import copy
t0 = time.perf_counter()
art = build_artifact(sys.argv[1], PackOptions(progress="off"))
t = OCILayoutTarget(sys.argv[2], create=True, link=sys.argv[3])
copy(art, t, "latest", "bench", progress="off")
print(time.perf_counter() - t0)
"""


def run_timed(cmd: list[str], **kw: object) -> tuple[float, int, str]:
    """Wall seconds, peak RSS (bytes) of the child, stdout."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t0 = time.perf_counter()
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, **kw)  # type: ignore[call-overload]
    dt = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return dt, max(after, before) * 1024, out.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="2GiB")
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--dir", default="/tmp/modelpack-bench")
    args = ap.parse_args()
    size = parse_size(args.size)
    ckpt = os.path.join(args.dir, f"ckpt-{size}-{args.shards}")
    if not os.path.exists(os.path.join(ckpt, "config.json")):
        print(f"generating {args.size} checkpoint in {ckpt} …", flush=True)
        write_checkpoint(ckpt, SyntheticSpec.for_size(size, shards=args.shards))
    files = sorted(os.path.join(ckpt, f) for f in os.listdir(ckpt))
    total = sum(os.path.getsize(f) for f in files)
    gib = total / 2**30
    cores = os.cpu_count() or 2
    subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True)  # warm the page cache

    results: list[tuple[str, float, int]] = []
    dt, _, _ = run_timed(["sh", "-c", 'cat "$@" > /dev/null', "cat", *files])
    results.append(("cat > /dev/null", dt, 0))
    dt, _, _ = run_timed(["sha256sum", *files])
    results.append(("sha256sum (1 process)", dt, 0))
    dt, _, _ = run_timed(["sh", "-c", f'printf "%s\\n" "$@" | xargs -P{cores} -n1 sha256sum', "x", *files])
    results.append((f"sha256sum ({cores} processes)", dt, 0))
    if shutil.which("openssl"):
        # coreutils sha256sum has no SHA-NI code path; OpenSSL (which hashlib uses) does: the
        # honest parallel-hash ceiling is OpenSSL on every core
        dt, _, _ = run_timed(
            ["sh", "-c", f'printf "%s\\n" "$@" | xargs -P{cores} -n1 openssl dgst -sha256', "x", *files]
        )
        results.append((f"openssl dgst -sha256 ({cores} processes)", dt, 0))
    ceiling = dt
    for mode in ("auto", "copy"):
        layout = os.path.join(args.dir, f"layout-{mode}")
        shutil.rmtree(layout, ignore_errors=True)
        dt, rss, out = run_timed([sys.executable, "-c", PACK_CHILD, ckpt, layout, mode])
        results.append((f"modelpack pack (link={mode}), whole process", dt, rss))
        results.append((f"modelpack pack (link={mode}), after imports", float(out.split()[-1]), rss))
        shutil.rmtree(layout, ignore_errors=True)

    print(f"\ncheckpoint: {len(files)} files, {gib:.2f} GiB, {cores} cores, hot page cache")
    print(f"{'':44} {'GiB/s':>7} {'× parallel hash':>21} {'peak RSS':>10}")
    for name, dt, rss in results:
        print(
            f"{name:44} {gib / dt:7.2f} {ceiling / dt:21.2f} {rss / 2**20:8.0f} MB"
            if rss
            else f"{name:44} {gib / dt:7.2f} {ceiling / dt:21.2f}"
        )


if __name__ == "__main__":
    main()
