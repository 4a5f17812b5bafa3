"""Scaling curves toward 100+ GiB shapes: how each stage's time and memory grow with model size.

    .venv/bin/python benchmarks/scaling.py [--sizes 64M,256M,1G] [--shards 4] [--shards-at-largest 141]
        [--file-series 4,16,64,141 --file-series-size 256M] [--json-out scaling.json] [--png scaling.png]
    .venv/bin/python benchmarks/scaling.py --sizes 1G,4G,16G          # the docs/performance.md run
    .venv/bin/python benchmarks/scaling.py --sizes 16G,64G,156G --shards 48   # a bigger machine

For every size a Llama-shaped bf16 checkpoint is generated (``modelpack.testdata.synthetic``
with ``benchmarks/shapes.py``'s spec: 80 layers, hidden size and vocabulary scaled to the byte
count; ``--shards`` files plus index, config, tokenizer config, generation config and README)
and taken through the delivery chain, each stage
a fresh ``modelpack`` process whose wall time and peak RSS (``VmHWM`` from /proc, the child
alone; ``benchmarks/transfer.py``'s ``run_child``) are recorded:

  pack        modelpack pack CKPT oci:LAYOUT:v1            (hashing; files linked, not copied)
  push        modelpack push oci:LAYOUT:v1 REGISTRY/…:v1   (a fresh loopback docker-registry)
  pull dir    modelpack pull REF@sha256:… DIR               (verified files at their paths)
  pull cache  modelpack pull REF@sha256:… --cache DIR       (node cache: ingest, verify, snapshot)
  cache hit   the same command again                        (ready marker: no I/O on the model)
  load TP=1   modelpack load SNAPSHOT --expected-digest …   (every tensor into CPU memory)
  load TP=8   … --tp-size 8 --tp-rank 0                     (one rank's shard)

At the largest size the same model is also generated in ``--shards-at-largest`` files (GLM-5.2
FP8 ships 141) and taken through the same stages, and ``--file-series`` repeats only pull-into-
cache and the hit over several shard counts at one small size: the cache hit should be flat in
bytes, linear in the file count, and small. Cache hits are also timed in process (median of
``--hit-repeat``), which removes the interpreter start that dominates the whole process.

Each stage's output is deleted as soon as it has been measured. Before each size the free space
of ``--workdir`` must be ≥ 3× the size (the peak is about 2×: a copy at the source plus one at
the destination) and, for the TP=1 load, available memory ≥ the size + 4 GiB; otherwise the size
(or the load) is skipped and the table says so. Prints a table and the fitted exponent k of
time ∝ size^k and RSS ∝ size^k per stage (k ≈ 1: linear; k ≈ 0: flat), and writes JSON and a PNG
(seconds and RSS vs size, log-log; cache hit vs file count).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from shapes import spec_for  # noqa: E402
from transfer import run_child  # noqa: E402

from modelpack.cli import parse_size  # noqa: E402
from modelpack.testdata.synthetic import SyntheticSpec, tensor_shapes, write_checkpoint  # noqa: E402
from tests.fixtures.registry import RegistryServer, start_registry  # noqa: E402

MODELPACK = [sys.executable, "-c", "from modelpack.cli import main; main()"]
STAGES = ("pack", "push", "pull dir", "pull cache", "cache hit", "load TP=1", "load TP=8 rank 0")
GiB = 1 << 30


def tensor_bytes(spec: SyntheticSpec) -> int:
    return sum(2 * math.prod(s) for _, s in tensor_shapes(spec))


@dataclass
class Row:
    size: int  # requested
    shards: int
    files: int = 0
    model_bytes: int = 0  # all files of the checkpoint
    stage: str = ""
    seconds: float | None = None
    peak_rss: int | None = None
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def rmtree_force(path: Path) -> None:
    """Remove a tree even where the node cache made directories read-only."""
    if not path.exists():
        return
    for dirpath, dirnames, _ in os.walk(path):
        for d in dirnames:
            p = os.path.join(dirpath, d)
            if not os.path.islink(p):
                os.chmod(p, 0o700)
    os.chmod(path, 0o700)
    shutil.rmtree(path, ignore_errors=True)


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def load_avg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def layout_digest(layout: Path) -> str:
    index = json.loads((layout / "index.json").read_text())
    return str(index["manifests"][0]["digest"])


def median_hit(cache_root: Path, ref: str, repeat: int) -> tuple[float, str]:
    """In-process cache hits: median seconds and the snapshot path."""
    from modelpack.mount import NodeCache

    cache = NodeCache(str(cache_root))
    times = []
    path = ""
    for _ in range(repeat):
        t = time.perf_counter()
        res = cache.pull(ref)
        times.append(time.perf_counter() - t)
        if res.state != "hit" or res.bytes_downloaded:
            raise SystemExit(f"expected a cache hit for {ref}, got {res.state}")
        path = res.path
    return statistics.median(times), path


def run_shape(
    size: int,
    shards: int,
    work: Path,
    env: dict[str, str],
    args: argparse.Namespace,
    cache_only: bool = False,
) -> list[Row]:
    """Generate one shape and take it through every stage; returns one row per stage."""
    rows: list[Row] = []
    base = Row(size, shards)

    def row(stage: str, seconds: float | None, rss: int | None, note: str = "", **extra: Any) -> None:
        r = Row(
            size,
            shards,
            base.files,
            base.model_bytes,
            stage,
            seconds,
            rss,
            note,
            {**extra, "load": load_avg()},
        )
        rows.append(r)
        shown = f"{seconds:8.2f} s  {rss / 2**20:7.0f} MiB" if seconds is not None and rss else note
        print(f"  {stage:<18} {shown}   (load {load_avg()})", flush=True)

    free = shutil.disk_usage(work).free
    if free < 3 * size:
        note = f"skipped: {free / GiB:.1f} GiB free < 3 × {size / GiB:.1f} GiB"
        print(f"{size / GiB:.2f} GiB × {shards} shards: {note}", flush=True)
        rows.append(Row(size, shards, stage="all", note=note))
        return rows

    ckpt = work / "ckpt"
    spec = spec_for(size, shards)
    t = time.perf_counter()
    write_checkpoint(str(ckpt), spec)
    files = sorted(p for p in ckpt.iterdir() if p.is_file())
    empty = [p.name for p in files if p.suffix == ".safetensors" and p.stat().st_size < 64 << 10]
    if empty:
        raise SystemExit(f"shard plan left {len(empty)} near-empty files (e.g. {empty[0]}): change spec_for")
    base.files = len(files)
    base.model_bytes = sum(p.stat().st_size for p in files)
    print(
        f"{base.model_bytes / GiB:.2f} GiB in {base.files} files ({shards} shards, hidden {spec.hidden}), "
        f"generated in {time.perf_counter() - t:.0f} s; free {free / GiB:.0f} GiB, load {load_avg()}",
        flush=True,
    )
    jobs = ["-j", str(args.jobs), "--progress", "off"]
    layout = work / "layout"
    server: RegistryServer | None = None
    try:
        t_, rss = run_child([*MODELPACK, "pack", str(ckpt), f"oci:{layout}:v1", *jobs], env)
        digest = layout_digest(layout)
        if not cache_only:
            row("pack", t_, rss)
        server = start_registry(Path(tempfile.mkdtemp(prefix="registry-", dir=work)))
        tag_ref = server.ref("bench/model", "v1")
        ref = f"{tag_ref.rsplit(':', 1)[0]}@{digest}"
        t_, rss = run_child([*MODELPACK, "push", f"oci:{layout}:v1", tag_ref, *jobs], env)
        if not cache_only:
            row("push", t_, rss)
        rmtree_force(layout)
        rmtree_force(ckpt)

        if not cache_only:
            dest = work / "pulled"
            t_, rss = run_child([*MODELPACK, "pull", ref, str(dest), *jobs], env)
            row("pull dir", t_, rss)
            rmtree_force(dest)

        cache = work / "cache"
        pull_cache = [*MODELPACK, "pull", ref, "--cache", str(cache), *jobs]
        t_, rss = run_child(pull_cache, env)
        row("pull cache", t_, rss)
        server.stop()  # a hit must not need the registry
        rmtree_force(server.config_path.parent)
        server = None
        t_, rss = run_child(pull_cache, env)
        hit_in_process, snapshot = median_hit(cache, ref, args.hit_repeat)
        row("cache hit", t_, rss, hit_in_process_s=hit_in_process)

        if not cache_only:
            tensors = tensor_bytes(spec)
            need = tensors + 4 * GiB
            avail = mem_available()
            load = [*MODELPACK, "load", snapshot, "--expected-digest", digest, "--progress", "off"]
            if avail < need:
                row(
                    "load TP=1",
                    None,
                    None,
                    f"skipped: {avail / GiB:.1f} GiB available < {need / GiB:.1f} GiB",
                )
            else:
                t_, rss = run_child(load, env)
                row("load TP=1", t_, rss, held_bytes=tensors)
            t_, rss = run_child([*load, "--tp-size", "8", "--tp-rank", "0"], env)
            row("load TP=8 rank 0", t_, rss, held_bytes=rank_bytes(spec, 8, 0))
        rmtree_force(cache)
    except SystemExit as exc:  # a stage's command failed: say so in the table, go on with the next shape
        msg = str(exc).strip().splitlines()
        row("failed", None, None, f"FAILED: {msg[-1][:160] if msg else exc.code}")
        print("\n".join(msg[-6:]), file=sys.stderr)
    finally:
        if server is not None:
            server.stop()
        for name in ("ckpt", "layout", "pulled", "cache"):
            rmtree_force(work / name)
        for reg in work.glob("registry-*"):
            rmtree_force(reg)
    return rows


def rank_bytes(spec: SyntheticSpec, tp: int, rank: int) -> int:
    """Tensor bytes rank ``rank`` of ``tp`` holds under the default Llama shard rules."""
    from modelpack.loader.plan import ShardRule, compile_rules, rule_for

    compiled = compile_rules()
    total = 0
    for name, shape in tensor_shapes(spec):
        n = 2 * math.prod(shape)
        total += n if rule_for(name, shape, compiled) is ShardRule.REPLICATE else n // tp
    return total


def exponent(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of log(y) on log(x): y ∝ x^k."""
    pts = [(math.log(x), math.log(y)) for x, y in points if x > 0 and y > 0]
    if len(pts) < 2:
        return None
    mx = statistics.fmean(p[0] for p in pts)
    my = statistics.fmean(p[1] for p in pts)
    den = sum((p[0] - mx) ** 2 for p in pts)
    return sum((p[0] - mx) * (p[1] - my) for p in pts) / den if den else None


def summarize(rows: list[Row], few: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for stage in STAGES:
        pts = [
            (float(r.model_bytes), r.seconds, float(r.peak_rss), float(r.extra.get("held_bytes", 0)))
            for r in rows
            if r.stage == stage and r.shards == few and r.seconds is not None and r.peak_rss
        ]
        out[stage] = {
            "time_exponent": exponent([(b, t) for b, t, _, _ in pts]),
            "rss_exponent": exponent([(b, m) for b, _, m, _ in pts]),
            "rss_less_tensors_exponent": (
                exponent([(b, max(1.0, m - h)) for b, _, m, h in pts]) if stage.startswith("load") else None
            ),
        }
    return out


def print_table(rows: list[Row]) -> None:
    print()
    print(
        f"{'model':>9} {'files':>5} {'stage':<17} {'seconds':>8} {'GB/s':>6} {'peak RSS':>9} "
        f"{'RSS−tensors':>11} {'in-proc hit':>11}  load avg"
    )
    for r in rows:
        if r.seconds is None or not r.peak_rss:
            print(f"{r.size / GiB:>7.2f}Gi {r.files:>5} {r.stage:<17} {r.note}")
            continue
        gbps = f"{r.model_bytes / r.seconds / 1e9:>6.2f}" if r.stage != "cache hit" else f"{'-':>6}"
        held = r.extra.get("held_bytes")
        over = f"{(r.peak_rss - held) / 2**20:>7.0f} MiB" if held else f"{'':>11}"
        hit = r.extra.get("hit_in_process_s")
        hit_s = f"{hit * 1000:>8.1f} ms" if hit is not None else f"{'':>11}"
        print(
            f"{r.model_bytes / GiB:>7.2f}Gi {r.files:>5} {r.stage:<17} {r.seconds:>8.2f} "
            f"{gbps} {r.peak_rss / 2**20:>5.0f} MiB {over} {hit_s}  {r.extra.get('load', '')}"
        )


def plot(rows: list[Row], few: int, many: int, series: list[Row], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(17, 5.2))
    for stage in STAGES:
        pts = sorted(
            (r.model_bytes / GiB, r.seconds, r.peak_rss / 2**20)
            for r in rows
            if r.stage == stage and r.shards == few and r.seconds is not None and r.peak_rss
        )
        if not pts:
            continue
        xs = [p[0] for p in pts]
        (line,) = a1.plot(xs, [p[1] for p in pts], marker="o", label=stage)
        a2.plot(xs, [p[2] for p in pts], marker="o", label=stage, color=line.get_color())
        big = [
            r for r in rows if r.stage == stage and r.shards == many and r.seconds is not None and r.peak_rss
        ]
        for r in big:
            a1.plot([r.model_bytes / GiB], [r.seconds], marker="x", ms=9, color=line.get_color())
            a2.plot(
                [r.model_bytes / GiB], [(r.peak_rss or 0) / 2**20], marker="x", ms=9, color=line.get_color()
            )
    if xs_all := [r.model_bytes / GiB for r in rows if r.shards == few and r.model_bytes]:
        lo, hi = min(xs_all), max(xs_all)
        t_pack = [r for r in rows if r.stage == "pull dir" and r.shards == few and r.seconds]
        if t_pack:
            ref = min(t_pack, key=lambda r: r.model_bytes)
            k = ref.seconds / (ref.model_bytes / GiB)  # type: ignore[operator]
            a1.plot([lo, hi], [k * lo, k * hi], ls=":", color="grey", label="linear (through pull dir)")
    for ax, title, ylabel in (
        (a1, f"time vs size ({few} shards: o, {many} shards: x)", "seconds (whole process)"),
        (a2, "peak RSS vs size", "peak RSS (MiB, VmHWM)"),
    ):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("model size (GiB)")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    a1.legend(fontsize=8)
    hits = [r for r in series + rows if r.stage == "cache hit" and r.seconds is not None]
    for size in sorted({r.size for r in hits}):
        pts = sorted(
            (r.files, r.seconds or 0.0, r.extra.get("hit_in_process_s") or 0.0)
            for r in hits
            if r.size == size
        )
        lbl = f"{size / GiB:.2f} GiB" if size >= GiB // 4 else f"{size / 2**20:.0f} MiB"
        (line,) = a3.plot(
            [p[0] for p in pts], [p[1] * 1000 for p in pts], marker="o", label=f"whole process, {lbl}"
        )
        a3.plot(
            [p[0] for p in pts],
            [p[2] * 1000 for p in pts],
            marker="s",
            ls="--",
            color=line.get_color(),
            label=f"in process, {lbl}",
        )
    if hits:
        a3.set_xscale("log")
        a3.set_yscale("log")
        a3.set_xlabel("files in the model")
        a3.set_ylabel("cache hit (ms)")
        a3.set_title("cache hit vs file count (o: process, ■: in process)")
        a3.grid(True, which="both", alpha=0.3)
        a3.legend(fontsize=8)
    fig.suptitle(
        f"modelpack scaling — {platform.machine()}, {os.cpu_count()} cores, "
        f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / GiB:.0f} GiB RAM"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="64M,256M,1G", help="comma-separated sizes (default 64M,256M,1G)")
    ap.add_argument("--shards", type=int, default=4, help="shards of the few-shard shape (default 4)")
    ap.add_argument(
        "--shards-at-largest",
        type=int,
        default=141,
        help="also run the largest size in this many shards (0: no)",
    )
    ap.add_argument(
        "--file-series",
        default="4,16,64,141",
        help="shard counts for the cache-hit-vs-files series ('': none)",
    )
    ap.add_argument("--file-series-size", default="256M", help="model size of that series (default 256M)")
    ap.add_argument("--hit-repeat", type=int, default=20, help="in-process cache hits per shape (median)")
    ap.add_argument("--jobs", type=int, default=4, help="modelpack -j")
    ap.add_argument("--workdir", default=tempfile.gettempdir(), help="where data goes (deleted per stage)")
    ap.add_argument("--json-out", default="scaling.json")
    ap.add_argument("--png", default="scaling.png", help="plot path ('' to skip)")
    args = ap.parse_args(argv)
    sizes = sorted(parse_size(s) for s in args.sizes.split(",") if s.strip())
    if not sizes or args.shards < 1 or args.shards_at_largest < 0:
        ap.error("--sizes needs at least one size; --shards must be positive")

    work = Path(tempfile.mkdtemp(prefix="mp-scaling-", dir=args.workdir))
    env = {
        **os.environ,
        "CI": "1",
        "MODELPACK_UPLOAD_STATE_DIR": str(work / "upload-state"),
        "PYTHONPATH": str(ROOT),
    }
    started = time.time()
    print(
        f"modelpack scaling: sizes {args.sizes}, {args.shards} shards (+{args.shards_at_largest} at the largest); "
        f"{os.cpu_count()} cores, {mem_available() / GiB:.1f} GiB available, "
        f"{shutil.disk_usage(work).free / GiB:.0f} GiB free in {args.workdir}; load {load_avg()}",
        flush=True,
    )
    rows: list[Row] = []
    series: list[Row] = []
    try:
        for size in sizes:
            rows += run_shape(size, args.shards, work, env, args)
        if args.shards_at_largest and args.shards_at_largest != args.shards:
            rows += run_shape(sizes[-1], args.shards_at_largest, work, env, args)
        if args.file_series.strip():
            fsize = parse_size(args.file_series_size)
            print(f"cache hit vs file count at {fsize / 2**20:.0f} MiB:", flush=True)
            for n in sorted({int(x) for x in args.file_series.split(",")}):
                series += run_shape(fsize, n, work, env, args, cache_only=True)
    finally:
        rmtree_force(work)
    print_table(rows + series)
    summary = summarize(rows, args.shards)
    print("\nexponent k of seconds ∝ size^k and RSS ∝ size^k (few-shard shape; 1 = linear, 0 = flat):")
    for stage, s in summary.items():
        parts = [
            f"{name} {s[key]:.2f}"
            for key, name in (
                ("time_exponent", "time"),
                ("rss_exponent", "RSS"),
                ("rss_less_tensors_exponent", "RSS−tensors"),
            )
            if s.get(key) is not None
        ]
        print(f"  {stage:<18} {'  '.join(parts) or '-'}")
    doc = {
        "command": " ".join(
            [os.path.relpath(sys.argv[0], ROOT) if sys.argv[0] else "scaling.py", *sys.argv[1:]]
        ),
        "machine": {
            "cores": os.cpu_count(),
            "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "wall_seconds": time.time() - started,
        "rows": [asdict(r) for r in rows],
        "file_series": [asdict(r) for r in series],
        "exponents": summary,
    }
    Path(args.json_out).write_text(json.dumps(doc, indent=2) + "\n")
    print(f"\nwrote {args.json_out}", end="")
    if args.png:
        plot(rows, args.shards, args.shards_at_largest, series, args.png)
        print(f" and {args.png}", end="")
    print(f"; {time.time() - started:.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
