"""S3 → registry copy throughput beside ``aws s3 cp`` of the same files, in the same run.

    python benchmarks/s3_transfer.py [--size 256MiB] [--shards 4] [--reps 2] [--part-size 16MiB]

Starts moto_server and Debian's docker-registry on 127.0.0.1 (free ports, temp storage; both
stopped at the end), generates a synthetic bf16 checkpoint, uploads it as plain files and pushes
it as an OCI layout into the bucket, then times, best of ``--reps``:

- ``aws s3 cp --recursive`` of the layout's blobs to a local directory (the peer; skipped with a
  note when awscli is not installed),
- ``modelpack cp s3://…:v1 oci:DIR`` (same bytes, same direction as the peer, digests verified),
- ``modelpack cp s3://…:v1 REGISTRY/REPO:v1`` (S3 → registry, what the issue asks for),
- ``modelpack pack s3://BUCKET/ckpt/ REGISTRY/REPO:v1`` (pack a checkpoint in S3 straight to
  the registry: hashes by streaming, then streams each object again),
- ``modelpack push DIR s3://…`` (local checkpoint → S3, multipart), beside ``aws s3 cp`` up.

Every operation runs as a CLI child process, so modelpack and aws both pay their start-up.

Each figure is MB/s of model bytes and a ratio against ``aws s3 cp`` measured in this run. moto
is a Python server, so absolute numbers say little about AWS; the ratios compare clients against
the same endpoint on the same cores.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from modelpack.cli import parse_size
from modelpack.testdata.synthetic import SyntheticSpec, write_checkpoint
from tests.fixtures.registry import start_registry
from tests.fixtures.s3 import DUMMY_ENV, S3Server, _wait_ready, free_port


def best_of(reps: int, fn: Callable[[int], object]) -> float:
    times = []
    for i in range(reps):
        t0 = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t0)
    return min(times)


def best_into_fresh_registry(reps: int, work: Path, fn: Callable[[int, str], object]) -> float:
    """Best of ``reps`` runs of ``fn(i, registry_ref_base)``, each into a registry started empty for it
    (untimed), so no repetition times blob mounts or "already exists" answers left by an earlier one."""
    times = []
    for i in range(reps):
        registry = start_registry(work / f"registry-{time.monotonic_ns()}")
        try:
            t0 = time.perf_counter()
            fn(i, registry.ref(f"bench/r{i}", "v1"))
            times.append(time.perf_counter() - t0)
        finally:
            registry.stop()
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="256MiB")
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--part-size", default="16MiB")
    ap.add_argument("--jobs", type=int, default=4)
    args = ap.parse_args()
    size = parse_size(args.size)
    part_size = parse_size(args.part_size)
    work = Path(tempfile.mkdtemp(prefix="modelpack-s3-bench-"))
    os.environ.update(DUMMY_ENV)
    port = free_port()
    moto = subprocess.Popen(
        [str(Path(sys.executable).with_name("moto_server")), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ},
    )
    try:
        s3 = S3Server(f"http://127.0.0.1:{port}", moto)
        _wait_ready(s3.endpoint, moto)
        os.environ["MODELPACK_S3_ENDPOINT"] = s3.endpoint

        ckpt = work / "ckpt"
        print(f"generating a {args.size} checkpoint ({args.shards} shards) …", flush=True)
        write_checkpoint(str(ckpt), SyntheticSpec.for_size(size, shards=args.shards))
        total = sum(p.stat().st_size for p in ckpt.iterdir())
        bucket = s3.make_bucket("bench")
        s3.upload_dir(bucket, "ckpt", ckpt)
        exe = str(Path(sys.executable).with_name("modelpack"))
        env = {**os.environ, "MODELPACK_S3_PART_SIZE": str(part_size)}
        runs = [0]

        def mp(*argv: str) -> None:
            # the CLI in a child process, like the aws peer (both pay their start-up); every run has
            # its own upload-state directory (never the user's ~/.cache/modelpack/uploads)
            runs[0] += 1
            state = work / f"upload-state-{runs[0]}"
            cmd = [exe, *argv, "--jobs", str(args.jobs), "--progress", "off"]
            run_env = {**env, "MODELPACK_UPLOAD_STATE_DIR": str(state)}
            subprocess.run(cmd, check=True, env=run_env, stdout=subprocess.DEVNULL)
            shutil.rmtree(state, ignore_errors=True)

        print(
            "compares: aws s3 cp (no digest checks) against modelpack push / cp / pack (every digest "
            "verified), same files, same moto endpoint; every registry row pushes into a registry "
            "started empty for that repetition"
        )

        # (seconds, peer name) per operation; uploads compare with the upload peer
        results: dict[str, tuple[float, str]] = {}
        aws = shutil.which("aws")
        up_peer, down_peer = "aws s3 cp DIR → s3 (upload peer)", "aws s3 cp s3 → DIR (download peer)"
        if aws:

            def aws_up(i: int) -> None:
                cmd = [aws, "s3", "cp", "--recursive", "--only-show-errors", "--endpoint-url", s3.endpoint]
                subprocess.run([*cmd, str(ckpt), f"s3://{bucket}/aws-up{i}/"], check=True)

            results[up_peer] = (best_of(args.reps, aws_up), up_peer)
        results["modelpack push DIR → s3 (multipart)"] = (
            best_of(args.reps, lambda i: mp("push", str(ckpt), f"s3://{bucket}/push{i}:v1")),
            up_peer,
        )
        src_ref = f"s3://{bucket}/push0:v1"
        if aws:

            def aws_down(i: int) -> None:
                out = work / f"aws{i}"
                cmd = [aws, "s3", "cp", "--recursive", "--only-show-errors", "--endpoint-url", s3.endpoint]
                subprocess.run([*cmd, f"s3://{bucket}/push0/blobs/", str(out)], check=True)
                shutil.rmtree(out)

            results[down_peer] = (best_of(args.reps, aws_down), down_peer)
        else:
            print("note: awscli is not installed; no `aws s3 cp` peer in this run")

        def cp_layout(i: int) -> None:
            mp("cp", src_ref, f"oci:{work / f'layout{i}'}:v1")
            shutil.rmtree(work / f"layout{i}")

        results["modelpack cp s3 → oci dir"] = (best_of(args.reps, cp_layout), down_peer)
        results["modelpack cp s3 → registry"] = (
            best_into_fresh_registry(args.reps, work, lambda i, ref: mp("cp", src_ref, ref, "--plain-http")),
            down_peer,
        )
        results["modelpack pack s3://ckpt/ → registry"] = (
            best_into_fresh_registry(
                args.reps, work, lambda i, ref: mp("pack", f"s3://{bucket}/ckpt/", ref, "--plain-http")
            ),
            down_peer,
        )

        print(
            f"\nmodel bytes: {total / 1e6:.0f} MB, part size {part_size >> 20} MiB, jobs {args.jobs}, "
            f"best of {args.reps}, endpoint moto_server on 127.0.0.1"
        )
        print(f"{'operation':<40} {'seconds':>8} {'MB/s':>8} {'× its aws peer':>15}")
        for name, (secs, peer) in results.items():
            ratio = f"{results[peer][0] / secs:.2f}" if peer in results else "-"
            print(f"{name:<40} {secs:>8.2f} {total / 1e6 / secs:>8.1f} {ratio:>15}")
        print(
            "(> 1 means faster than `aws s3 cp` of the same files; modelpack verifies every digest, aws does not)"
        )
    finally:
        moto.terminate()
        try:
            moto.wait(timeout=10)
        except subprocess.TimeoutExpired:
            moto.kill()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
