"""A streamed load through the node cache vs the same stream without it.

A generated checkpoint (``SyntheticSpec.for_size``) is pushed to a registry, signed (chunk table)
and unsigned. Rounds, interleaved, each load a fresh process-local load of the pinned reference
(``load_state_dict``):

- ``stream``: range reads from the registry, no cache (today's streamed start);
- ``stream + cache, cold``: ``CacheStream`` into a fresh node cache: the cache's pull fetches
  each blob once, the load reads from its ingest (on the CPU unhashed, vouched for by the cache's
  whole-blob check: ``loader/settled.py``), the snapshot is published before it returns
  (``publish="wait"``, the CLI's way; the wall includes the cache's fsyncs and publish);
- ``stream + cache, cold, publish in background``: the same into another fresh cache with
  ``publish="background"`` (the vLLM load format's way): the load returns once its tensors are
  verified, the cache's commit (fsync, rename, publish) goes on after it; the last column is how
  long after the return the snapshot was published;
- ``stream + cache, hit``: the first cache again (0 registry blob bytes).

Where the registry is (``--links``): on loopback (the default; the registry shares this machine's
cores, which bound every row), and/or behind a link of each rate given (``--links 1000,2500``): the
registry (Debian ``docker-registry``) in a network namespace of its own, the loads in another,
joined by a bridge, each veth shaped with ``tc tbf`` (``benchmarks/storm.py``'s ``Network``; needs
root; every namespace is created and removed here, addresses in 10.232.0.0/24 only) — a registry
across a network, as a node sees one.

    .venv/bin/python benchmarks/stream_cache.py [--size-mib 512] [--shards 4] [--repeat 3]
    sudo .venv/bin/python benchmarks/stream_cache.py --links loopback,1000,2500 --repeat 3
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from modelpack.loader import CacheStream, load_state_dict  # noqa: E402
from modelpack.mount import NodeCache  # noqa: E402
from modelpack.signing.keys import generate_key  # noqa: E402

from modelpack import api  # noqa: E402
from modelpack.targets.opener import TargetOptions  # noqa: E402
from modelpack.testdata.synthetic import SyntheticSpec, write_checkpoint  # noqa: E402
from tests.fixtures.registry import start_registry  # noqa: E402

PLAIN = TargetOptions(plain_http=True)
SUBNET = "10.232.0"
Rows = dict[str, list[tuple[float, float, float]]]  # row → (wall, CPU, publish wait) per round


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=512)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--workdir", default=None)
    ap.add_argument(
        "--links",
        default="loopback",
        help="comma-separated: 'loopback' (the registry on this machine's loopback) and/or link rates "
        "in Mbit/s (the registry behind a shaped link of that rate; needs root), e.g. loopback,1000,2500",
    )
    ap.add_argument("--inner", default="", help=argparse.SUPPRESS)  # registry host:port, in a namespace
    args = ap.parse_args()
    if args.inner:
        rows = measure(args.inner, Path(args.workdir), args.repeat)
        print(json.dumps(rows))
        return 0
    links = [x.strip() for x in args.links.split(",") if x.strip()]
    rates = [float(x) for x in links if x != "loopback"]
    skipped = False
    if rates:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from storm import Unavailable, check_environment

        try:
            check_environment()
        except Unavailable as exc:  # the loopback rows still run; the exit status says what did not
            print(f"stream_cache.py: skipping the shaped links ({exc})", file=sys.stderr)
            rates, skipped = [], True
    work = Path(tempfile.mkdtemp(prefix="stream-cache-", dir=args.workdir))
    try:
        ckpt = work / "checkpoint"
        write_checkpoint(str(ckpt), SyntheticSpec.for_size(args.size_mib * 2**20, shards=args.shards))
        size = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
        head = f"{size / 2**20:.0f} MiB in {args.shards} shard(s), {args.repeat} interleaved rounds"
        if "loopback" in links:
            registry = start_registry(work / "registry")
            try:
                rows = measure(registry.host, work, args.repeat)
            finally:
                registry.stop()
            print_table(f"{head}, a loopback registry", rows)
        for mbit in rates:
            print_table(
                f"{head}, the registry behind a {mbit:g} Mbit/s link", shaped(mbit, work, args.repeat)
            )
        return 77 if skipped else 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


def shaped(mbit: float, work: Path, repeat: int) -> Rows:
    """``measure`` in a namespace of its own, the registry in another behind ``mbit`` links."""
    from storm import Network
    from storm import start_registry as start_ns_registry

    net = Network(f"mpsc-{os.getpid()}")
    try:
        origin = net.add_host("o", f"{SUBNET}.1", mbit)
        node = net.add_host("n", f"{SUBNET}.2", mbit)
        start_ns_registry(net, origin, work / f"registry-{mbit:g}")
        out = net.popen(
            node,
            [
                sys.executable,
                __file__,
                "--inner",
                f"{SUBNET}.1:5000",
                "--workdir",
                str(work),
                "--repeat",
                str(repeat),
            ],
            stdout=subprocess.PIPE,
        ).communicate()[0]
        doc = json.loads(out.decode().strip().splitlines()[-1])
        return {k: [(r[0], r[1], r[2]) for r in v] for k, v in doc.items()}
    finally:
        net.close()


def measure(host: str, work: Path, repeat: int) -> Rows:
    """The rounds (module docstring) against the registry at ``host`` (plain HTTP), of the
    checkpoint in ``work/checkpoint``."""
    ckpt = work / "checkpoint"
    rows: Rows = {}
    key = generate_key()
    signed = api.push(
        str(ckpt), f"{host}/bench/signed:v1", sign_key=key, progress="off", target_options=PLAIN
    )
    plain = api.push(str(ckpt), f"{host}/bench/plain:v1", progress="off", target_options=PLAIN)
    cases = (
        ("chunk table", f"{host}/bench/signed@{signed.digest}", [key.public]),
        ("whole layers", f"{host}/bench/plain@{plain.digest}", None),
    )
    for i in range(repeat):
        for label, ref, keys in cases:
            t, c = time.perf_counter(), time.process_time()
            sd = load_state_dict(ref, trusted_keys=keys, target_options=PLAIN)
            rows.setdefault(f"{label}: stream", []).append(
                (time.perf_counter() - t, time.process_time() - c, 0.0)
            )
            del sd
            cache_dir = work / f"cache-{os.getpid()}-{i}-{label[0]}"
            for state, publish, where in (
                ("cold", "wait", cache_dir),
                ("cold, publish in background", "background", cache_dir.with_name(cache_dir.name + "-bg")),
                ("hit", "wait", cache_dir),
            ):
                src = CacheStream(NodeCache(str(where)), ref, target_options=PLAIN, publish=publish)
                t, c = time.perf_counter(), time.process_time()
                sd = load_state_dict(src, trusted_keys=keys)
                wall, cpu = time.perf_counter() - t, time.process_time() - c
                src.wait()  # the next round must not overlap this fill
                lag = src.report.wait_s if publish == "wait" else time.perf_counter() - t - wall
                rows.setdefault(f"{label}: stream + cache, {state}", []).append((wall, cpu, lag))
                assert src.report.published and src.report.state == ("hit" if state == "hit" else "filled")
                del sd
            shutil.rmtree(cache_dir)
            shutil.rmtree(cache_dir.with_name(cache_dir.name + "-bg"))
    return rows


def print_table(head: str, rows: Rows) -> None:
    print(
        f"{head}, load average {os.getloadavg()[0]:.1f} at the end "
        "(seconds: best / median; CPU = the loading process, every thread)"
    )
    print()
    print(
        "| row | wall | vs stream (median wall) | CPU | vs stream (median CPU) "
        "| publish wait / after return (median) |"
    )
    print("|---|---|---|---|---|---|")
    for name, runs in rows.items():
        base = rows[name.split(":")[0] + ": stream"]
        wall, cpu, wait = ([r[k] for r in runs] for k in range(3))
        print(
            f"| {name} | {min(wall):.2f} / {statistics.median(wall):.2f} s | "
            f"{statistics.median(wall) / statistics.median(r[0] for r in base):.2f}× | "
            f"{min(cpu):.2f} / {statistics.median(cpu):.2f} s | "
            f"{statistics.median(cpu) / statistics.median(r[1] for r in base):.2f}× | "
            f"{statistics.median(wait) * 1000:.0f} ms |"
        )
    print()


if __name__ == "__main__":
    raise SystemExit(main())
