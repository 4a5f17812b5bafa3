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
import statistics
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


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="2GiB")
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--dir", default="/tmp/modelpack-bench")
    ap.add_argument("--repeat", type=int, default=3, help="interleaved rounds; medians are reported")
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
    cli = shutil.which("modelpack", path=os.path.dirname(sys.executable)) or shutil.which("modelpack")

    # coreutils sha256sum has no SHA-NI code path; OpenSSL (which hashlib uses) does: the honest
    # parallel-hash ceiling is OpenSSL on every core (sha256sum on every core where it is missing)
    hasher = "openssl dgst -sha256" if shutil.which("openssl") else "sha256sum"
    ceiling_name = f"{hasher} ({cores} processes)"
    commands: list[tuple[str, list[str]]] = [
        ("cat > /dev/null", ["sh", "-c", 'cat "$@" > /dev/null', "cat", *files]),
        ("sha256sum (1 process)", ["sha256sum", *files]),
        (
            f"sha256sum ({cores} processes)",
            ["sh", "-c", f'printf "%s\\n" "$@" | xargs -P{cores} -n1 sha256sum', "x", *files],
        ),
    ]
    if hasher != "sha256sum":
        commands.append(
            (ceiling_name, ["sh", "-c", f'printf "%s\\n" "$@" | xargs -P{cores} -n1 {hasher}', "x", *files])
        )
    seconds: dict[str, list[float]] = {}
    rss: dict[str, int] = {}
    ratio_in: list[float] = []  # per round: ceiling s / in-process pack s (link=auto)
    gap_whole: list[float] = []  # per round: whole-process pack s − ceiling s (link=auto)
    for _ in range(max(1, args.repeat)):  # interleaved, so a burst of load hits every row alike
        for name, cmd in commands:
            dt, _, _ = run_timed(cmd)
            seconds.setdefault(name, []).append(dt)
        ceiling = seconds[ceiling_name][-1]
        for mode in ("auto", "copy"):
            layout = os.path.join(args.dir, f"layout-{mode}")
            shutil.rmtree(layout, ignore_errors=True)
            dt, peak, out = run_timed([sys.executable, "-c", PACK_CHILD, ckpt, layout, mode])
            inproc = float(out.split()[-1])
            for label, value in (("whole process", dt), ("in-process", inproc)):
                name = f"modelpack pack (link={mode}), {label}"
                seconds.setdefault(name, []).append(value)
                rss[name] = max(rss.get(name, 0), peak)
            if mode == "auto":
                ratio_in.append(ceiling / inproc)
                gap_whole.append(dt - ceiling)
            shutil.rmtree(layout, ignore_errors=True)
        if cli:  # what a person types: click, the API and the CLI's lazy imports included
            layout = os.path.join(args.dir, "layout-cli")
            shutil.rmtree(layout, ignore_errors=True)
            dt, peak, _ = run_timed([cli, "pack", ckpt, f"oci:{layout}:bench", "--progress", "off"])
            seconds.setdefault("modelpack pack CLI (link=auto), whole process", []).append(dt)
            rss["modelpack pack CLI (link=auto), whole process"] = peak
            shutil.rmtree(layout, ignore_errors=True)

    ceiling = median(seconds[ceiling_name])
    print(
        f"\ncheckpoint: {len(files)} files, {gib:.2f} GiB, {cores} cores, hot page cache, "
        f"median of {max(1, args.repeat)} interleaved rounds; load average {os.getloadavg()[0]:.2f}"
    )
    print(f"{'':50} {'seconds':>8} {'GiB/s':>7} {'× ceiling':>10} {'− ceiling s':>12} {'peak RSS':>10}")
    for name, values in seconds.items():
        dt = median(values)
        line = f"{name:50} {dt:8.3f} {gib / dt:7.2f} {ceiling / dt:10.2f} {dt - ceiling:+12.3f}"
        print(line + (f" {rss[name] / 2**20:7.0f} MB" if name in rss else ""))
    print(
        f"\nceiling: {ceiling_name}, {ceiling:.3f} s"
        f"\nin-process pack (link=auto) vs ceiling:    {median(ratio_in):.2f}× (goal ≥ 0.90×; per round "
        + ", ".join(f"{r:.2f}" for r in ratio_in)
        + ")"
        f"\nwhole-process pack (link=auto) − ceiling:  {median(gap_whole):+.3f} s (goal ≤ +0.200 s; per round "
        + ", ".join(f"{g:+.3f}" for g in gap_whole)
        + ")"
    )


if __name__ == "__main__":
    main()
