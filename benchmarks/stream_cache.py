"""A streamed load through the node cache vs the same stream without it.

A generated checkpoint (``SyntheticSpec.for_size``) is pushed to a loopback registry, signed
(chunk table) and unsigned. Rounds, interleaved, each load a fresh process-local load of the
pinned reference (``load_state_dict``):

- ``stream``: range reads from the registry, no cache (today's streamed start);
- ``stream + cache, cold``: ``CacheStream`` into a fresh node cache: the cache's pull fetches
  each blob once, the load reads from its ingest, the snapshot is published before it returns;
- ``stream + cache, hit``: the same again on that cache (0 registry blob bytes).

Wall seconds include the publish (the load returns only once the snapshot is ready).

    .venv/bin/python benchmarks/stream_cache.py [--size-mib 512] [--shards 4] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=512)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="stream-cache-", dir=args.workdir))
    try:
        return run(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(args: argparse.Namespace, work: Path) -> int:
    ckpt = work / "checkpoint"
    write_checkpoint(str(ckpt), SyntheticSpec.for_size(args.size_mib * 2**20, shards=args.shards))
    size = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    registry = start_registry(work / "registry")
    rows: dict[str, list[tuple[float, float]]] = {}
    try:
        key = generate_key()
        signed = api.push(str(ckpt), registry.ref("bench/signed", "v1"), sign_key=key, progress="off")
        plain = api.push(str(ckpt), registry.ref("bench/plain", "v1"), progress="off")
        cases = (
            ("chunk table", f"{registry.host}/bench/signed@{signed.digest}", [key.public]),
            ("whole layers", f"{registry.host}/bench/plain@{plain.digest}", None),
        )
        for i in range(args.repeat):
            for label, ref, keys in cases:
                t, c = time.perf_counter(), time.process_time()
                sd = load_state_dict(ref, trusted_keys=keys, target_options=PLAIN)
                rows.setdefault(f"{label}: stream", []).append(
                    (time.perf_counter() - t, time.process_time() - c)
                )
                del sd
                cache = NodeCache(str(work / f"cache-{i}-{label[0]}"))
                for state in ("cold", "hit"):
                    src = CacheStream(cache, ref, target_options=PLAIN)
                    t, c = time.perf_counter(), time.process_time()
                    sd = load_state_dict(src, trusted_keys=keys)
                    rows.setdefault(f"{label}: stream + cache, {state}", []).append(
                        (time.perf_counter() - t, time.process_time() - c)
                    )
                    assert src.report.published and src.report.state == (
                        "filled" if state == "cold" else "hit"
                    )
                    del sd
                shutil.rmtree(work / f"cache-{i}-{label[0]}")
    finally:
        registry.stop()
    print(
        f"{size / 2**20:.0f} MiB in {args.shards} shard(s) from a loopback registry, "
        f"{args.repeat} interleaved rounds, load average {os.getloadavg()[0]:.1f} at the end "
        "(seconds: best / median; CPU = this process, every thread)"
    )
    print()
    print("| row | wall | vs stream (median wall) | CPU | vs stream (median CPU) |")
    print("|---|---|---|---|---|")
    for name, runs in rows.items():
        base = rows[name.split(":")[0] + ": stream"]
        wall, cpu = [w for w, _ in runs], [c for _, c in runs]
        print(
            f"| {name} | {min(wall):.2f} / {statistics.median(wall):.2f} s | "
            f"{statistics.median(wall) / statistics.median(w for w, _ in base):.2f}× | "
            f"{min(cpu):.2f} / {statistics.median(cpu):.2f} s | "
            f"{statistics.median(cpu) / statistics.median(c for _, c in base):.2f}× |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
