"""Push and pull throughput: modelpack vs skopeo against the same local registry, same run.

A generated checkpoint (default 2 GiB) is pushed and pulled by both tools, each run as its own
child process whose peak RSS (VmHWM) is read from /proc:

  push   modelpack push DIR → registry       (packs on the fly: hashing is included)
         modelpack cp oci:LAYOUT → registry   (like for like with skopeo)
         skopeo copy oci:LAYOUT → registry
  pull   modelpack pull registry → DIR        (verified files at their paths)
         modelpack cp registry → oci:LAYOUT   (like for like with skopeo)
         skopeo copy registry → oci:LAYOUT

Each push goes to a fresh registry process on fresh storage (same binary and config), so no
tool finds blobs another tool already stored. Prints throughput, the ratio to skopeo, and peak RSS.

  .venv/bin/python benchmarks/transfer.py [--size 2G] [--shards 4] [--jobs 4] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from modelpack import api  # noqa: E402
from modelpack.cli import parse_size  # noqa: E402
from modelpack.testdata.synthetic import SyntheticSpec, write_checkpoint  # noqa: E402
from tests.fixtures.registry import RegistryServer, start_registry  # noqa: E402

MODELPACK = [sys.executable, "-c", "from modelpack.cli import main; main()"]
SKOPEO = ["skopeo", "copy", "--preserve-digests"]


def _vm_hwm(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def run_child(cmd: list[str], env: dict[str, str]) -> tuple[float, int]:
    """Run ``cmd``; return (seconds, peak RSS in bytes) of that child alone.

    Peak RSS is the child's ``VmHWM`` polled from /proc (``ru_maxrss`` would include the
    benchmark's own memory: a forked child inherits its parent's high-water mark until exec).
    Dirty pages left by the previous transfer are flushed first (untimed): otherwise whichever
    tool runs next pays for its predecessor's writeback.
    """
    os.sync()
    start = time.perf_counter()
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err)
        peak = 0
        while proc.poll() is None:
            peak = max(peak, _vm_hwm(proc.pid))
            time.sleep(0.01)
        seconds = time.perf_counter() - start
        if proc.returncode != 0:
            err.seek(0)
            tail = err.read()[-2000:].decode(errors="replace")
            raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{tail}")
    return seconds, peak


def drop_dir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="2G", help="checkpoint size (default 2G)")
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--jobs", type=int, default=4, help="modelpack --jobs")
    ap.add_argument("--rounds", type=int, default=3, help="repeat (rotating the order); best time per tool")
    ap.add_argument("--workdir", help="where to put data (default: a temp dir, removed after)")
    args = ap.parse_args()

    size = parse_size(args.size)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="mp-bench-transfer-"))
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "CI": "1", "MODELPACK_UPLOAD_STATE_DIR": str(work / "upload-state")}
    servers: list[RegistryServer] = []
    try:
        ckpt = work / "ckpt"
        print(f"generating a {size / 2**30:.2f} GiB checkpoint ({args.shards} shards) …", flush=True)
        write_checkpoint(str(ckpt), SyntheticSpec.for_size(size, args.shards))
        total = sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file())
        layout = work / "layout"
        packed = api.pack(str(ckpt), f"oci:{layout}:v1")
        digest = str(packed.artifact.digest)
        print(f"checkpoint: {total / 2**30:.2f} GiB in {len(packed.artifact.files)} files; {digest}")

        results: dict[str, tuple[float, int]] = {}

        def record(name: str, seconds: float, rss: int) -> None:
            best = results.get(name)
            if best is None or seconds < best[0]:
                results[name] = (seconds, rss if best is None else max(rss, best[1]))

        def fresh_registry() -> RegistryServer:
            base = Path(tempfile.mkdtemp(prefix="registry-", dir=work))
            s = start_registry(base)
            servers.append(s)
            return s

        def retire(s: RegistryServer) -> None:
            s.stop()
            servers.remove(s)
            drop_dir(s.config_path.parent)

        jobs = ["-j", str(args.jobs), "--progress", "off"]
        pushes = [
            ("push modelpack (dir)", lambda ref: [*MODELPACK, "push", str(ckpt), ref, *jobs]),
            ("push modelpack (layout)", lambda ref: [*MODELPACK, "cp", f"oci:{layout}:v1", ref, *jobs]),
            (
                "push skopeo (layout)",
                lambda ref: [*SKOPEO, "--dest-tls-verify=false", f"oci:{layout}:v1", f"docker://{ref}"],
            ),
        ]
        pulls = [
            ("pull modelpack (files)", lambda ref, dest: [*MODELPACK, "pull", ref, str(dest), *jobs]),
            ("pull modelpack (layout)", lambda ref, dest: [*MODELPACK, "cp", ref, f"oci:{dest}:v1", *jobs]),
            (
                "pull skopeo (layout)",
                lambda ref, dest: [*SKOPEO, "--src-tls-verify=false", f"docker://{ref}", f"oci:{dest}:v1"],
            ),
        ]
        for r in range(args.rounds):
            # the order rotates each round so no tool always runs first
            for name, make in pushes[r % 3 :] + pushes[: r % 3]:
                s = fresh_registry()  # each push into a fresh, empty registry
                t, rss = run_child(make(s.ref("bench/model", "v1")), env)
                record(name, t, rss)
                retire(s)
            s = fresh_registry()
            run_child([*MODELPACK, "push", str(ckpt), s.ref("bench/model", "v1"), *jobs], env)
            for name, make_pull in pulls[r % 3 :] + pulls[: r % 3]:
                dest = work / "pulled"
                drop_dir(dest)
                t, rss = run_child(make_pull(s.ref("bench/model", "v1"), dest), env)
                record(name, t, rss)
                drop_dir(dest)
            retire(s)

        print()
        print(f"{'transfer':<26}{'seconds':>9}{'MB/s':>9}{'vs skopeo':>11}{'peak RSS':>11}")
        for name, (t, rss) in results.items():
            peer = "push skopeo (layout)" if name.startswith("push") else "pull skopeo (layout)"
            ratio = results[peer][0] / t
            print(f"{name:<26}{t:>9.2f}{total / t / 1e6:>9.0f}{ratio:>10.2f}x{rss / 2**20:>8.0f} MiB")
        print("\nratio = skopeo seconds / this tool's seconds (>1: faster than skopeo)")
    finally:
        for s in servers:
            s.stop()
        if not args.workdir:
            drop_dir(work)


if __name__ == "__main__":
    main()
