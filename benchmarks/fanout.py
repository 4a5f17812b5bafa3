"""Origin fan-out (issue 17 item 8, the seed's P3 experiment): N nodes pull one model at once.

For N in {1, 2, 4, 8} simulated nodes (separate processes, separate destinations, started
together) pull the same model (a) straight from the origin, (b) through a pull-through mirror
(Debian's ``docker-registry`` with ``proxy: remoteurl:``) that is cold at the start of the run,
and (c) ``warm``: through the same kind of mirror after one earlier node pulled the model.
Reported per run: origin egress (blob bytes in the origin's access log), total bytes moved (origin
+ mirror egress), p50/p95 completion time, and retries (blob requests beyond one per blob per
node: ranged resumes, refused or failed requests). A table on stdout, JSON and a PNG plot in
``--out``.

    python benchmarks/fanout.py                      # ~256 MiB model, N = 1 2 4 8
    python benchmarks/fanout.py --size 1GiB --nodes 1,8 --out /tmp/fanout
"""

from __future__ import annotations

import argparse
import json
import os
import re
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

from modelpack.api import transfer  # noqa: E402
from modelpack.cli import parse_size  # noqa: E402
from tests.fixtures.registry import RegistryServer, start_registry  # noqa: E402

MODELPACK = [sys.executable, "-c", "from modelpack.cli import main; main()"]
_LINE = re.compile(r'"GET (/v2/[^ ]*/blobs/sha256:[0-9a-f]{64}) HTTP/[0-9.]+" (\d{3}) (\d+)')


def make_model(directory: Path, size: int, files: int = 4) -> None:
    """Random bytes (incompressible, no dedup) split over ``files`` files."""
    directory.mkdir(parents=True)
    per = size // files
    for i in range(files):
        with open(directory / f"shard-{i:02d}.bin", "wb") as f:
            left = per
            while left:
                n = min(left, 16 << 20)
                f.write(os.urandom(n))
                left -= n


def blob_traffic(server: RegistryServer, mark: int) -> tuple[int, int]:
    """(bytes of blob bodies served, blob GETs) in the access log after line ``mark``."""
    sent = gets = 0
    for line in server.access_log()[mark:]:
        m = _LINE.search(line)
        if m:
            gets += 1
            sent += int(m.group(3))
    return sent, gets


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def run(
    n: int, mode: str, origin: RegistryServer, ref_repo: str, blobs: int, work: Path, retry_for: str
) -> dict[str, Any]:
    mirror = None
    if mode in ("mirror", "warm"):
        mirror = start_registry(work / f"mirror-{n}", proxy_remote=origin.url)
    if mirror and mode == "warm":  # one node pulled it before: the mirror holds every blob
        dest = work / f"warmup-{n}"
        subprocess.run(
            [
                *MODELPACK,
                "pull",
                "--progress",
                "off",
                "--mirror",
                f"http://{mirror.host}",
                origin.ref(ref_repo, "v1"),
                str(dest),
            ],
            check=True,
            capture_output=True,
        )
        shutil.rmtree(dest, ignore_errors=True)
        time.sleep(1.0)  # the pull-through stores in the background after serving
    mark_o = origin.log_mark()
    mark_m = mirror.log_mark() if mirror else 0
    procs = []
    start = time.monotonic()
    for i in range(n):
        dest = work / f"{mode}-{n}-node{i}"
        cmd = [*MODELPACK, "pull", "--progress", "off", "--retry-for", retry_for]
        if mirror:
            cmd += ["--mirror", f"http://{mirror.host}"]
        cmd += [origin.ref(ref_repo, "v1"), str(dest)]
        env = {**os.environ, "MODELPACK_HOSTS_DIR": str(work / "no-hosts-dir")}
        procs.append(
            (subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env), dest)
        )
    times = []
    for proc, dest in procs:
        _, err = proc.communicate()
        times.append(time.monotonic() - start)
        if proc.returncode:
            raise SystemExit(f"node pull failed ({mode}, N={n}): {err.decode()[-2000:]}")
        shutil.rmtree(dest, ignore_errors=True)
    time.sleep(0.3)  # the access log is written after the response
    origin_bytes, origin_gets = blob_traffic(origin, mark_o)
    mirror_bytes, mirror_gets = blob_traffic(mirror, mark_m) if mirror else (0, 0)
    if mirror:
        mirror.stop()
        shutil.rmtree(work / f"mirror-{n}", ignore_errors=True)
    # each node asks its first source once per blob; the pull-through mirror asks the origin once
    client_gets = mirror_gets if mirror else origin_gets
    return {
        "mode": mode,
        "nodes": n,
        "origin_egress": origin_bytes,
        "total_moved": origin_bytes + mirror_bytes,
        "p50_s": round(statistics.median(times), 2),
        "p95_s": round(percentile(times, 0.95), 2),
        "retries": max(0, client_gets - n * blobs),
    }


def plot(rows: list[dict[str, Any]], size: int, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing (pip install 'modelpack-oci[bench]'): no PNG", file=sys.stderr)
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for mode, marker, color in (("origin", "o", "C0"), ("mirror", "s", "C1"), ("warm", "^", "C2")):
        pts = [r for r in rows if r["mode"] == mode]
        xs = [r["nodes"] for r in pts]
        ax1.plot(xs, [r["origin_egress"] / size for r in pts], marker=marker, color=color, label=mode)
        ax2.plot(xs, [r["p95_s"] for r in pts], marker=marker, color=color, label=f"{mode} p95")
        ax2.plot(
            xs, [r["p50_s"] for r in pts], marker=marker, color=color, linestyle="--", label=f"{mode} p50"
        )
    ax1.set(xlabel="nodes", ylabel="origin egress (model copies)", title="Origin egress")
    ax2.set(xlabel="nodes", ylabel="seconds", title="Completion time")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.legend()
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="256MiB", help="model size (default 256MiB; 1GiB+ on a bigger machine)")
    ap.add_argument("--nodes", default="1,2,4,8", help="comma-separated node counts")
    ap.add_argument("--out", default=None, help="directory for fanout.json and fanout.png")
    ap.add_argument("--retry-for", default="60s", help="each node's --retry-for")
    args = ap.parse_args()
    size = parse_size(args.size)
    counts = [int(x) for x in args.nodes.split(",")]
    out = Path(args.out or tempfile.mkdtemp(prefix="fanout-out-"))
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="fanout-"))
    origin = start_registry(work / "origin")
    try:
        make_model(work / "model", size)
        transfer.push(str(work / "model"), origin.ref("bench/fanout", "v1"), progress="off")
        blobs = len(list((work / "model").iterdir()))
        rows = [
            run(n, mode, origin, "bench/fanout", blobs, work, args.retry_for)
            for mode in ("origin", "mirror", "warm")
            for n in counts
        ]
    finally:
        origin.stop()
        shutil.rmtree(work, ignore_errors=True)
    mib = 1024 * 1024
    print(f"model {size / mib:.0f} MiB in {blobs} files; cpus {os.cpu_count()}")
    print("| mode | nodes | origin egress MiB | total moved MiB | p50 s | p95 s | retries |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['mode']} | {r['nodes']} | {r['origin_egress'] / mib:.0f} | {r['total_moved'] / mib:.0f} "
            f"| {r['p50_s']} | {r['p95_s']} | {r['retries']} |"
        )
    (out / "fanout.json").write_text(json.dumps({"size": size, "rows": rows}, indent=2))
    if plot(rows, size, out / "fanout.png"):
        print(f"plot: {out / 'fanout.png'}")


if __name__ == "__main__":
    main()
