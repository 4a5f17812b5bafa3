"""Loader → GPU throughput on a CUDA machine (H200 / H20), against the pinned H2D ceiling.

    python benchmarks/gpu_load.py [--size 8GiB] [--tp 8] [--workers 8] [--dir /tmp/modelpack-gpu-bench]
    python benchmarks/gpu_load.py --device cpu --size 256MiB   # logic check without a GPU

One self-contained run, under 5 minutes on an H200 node:

1. generates a ~8 GiB bf16 Llama-shaped checkpoint (4 shards) and warms the page cache;
2. ceilings: pinned host → device ``copy_`` of 1 GiB (best of 5), and the host read ceiling
   (``--workers`` threads ``preadv`` the files into one reused pinned buffer each);
3. modelpack TP=1 to the GPU, fresh tensors and preallocated ``out=`` tensors;
4. simulated TP=8: each rank loaded in turn (fresh tensors), slowest rank and bytes per rank;
5. spot checks: a few tensors (and their TP shards) compared bit-for-bit with safetensors.

Prints GB/s and the ratio to each ceiling. ``--verify-chunks`` also packs the checkpoint into an
OCI layout, computes a chunk table and loads with per-chunk verification (adds hashing time).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="8GiB", help="checkpoint size, 8–16 GiB on a GPU node (default 8GiB)")
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--tp", type=int, default=8, help="simulated tensor-parallel ranks (default 8)")
    ap.add_argument("--workers", type=int, default=8, help="loader read threads (default 8)")
    ap.add_argument("--slot-mib", type=int, default=32, help="staging slot size in MiB (default 32)")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu for a logic check")
    ap.add_argument("--dir", default="/tmp/modelpack-gpu-bench")
    ap.add_argument("--verify-chunks", action="store_true", help="also time a chunk-verified load")
    ap.add_argument("--keep", action="store_true", help="keep the generated checkpoint")
    args = ap.parse_args(argv)
    if args.tp < 1 or args.workers < 1 or args.shards < 1 or args.slot_mib < 1:
        ap.error("--tp, --workers, --shards and --slot-mib must be positive")
    return args


def h2d_ceiling(device: str, nbytes: int = 1 << 30) -> float:
    import torch

    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host.fill_(1)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    best = 0.0
    for _ in range(5):
        t = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        best = max(best, nbytes / (time.perf_counter() - t))
    del host, dev
    return best


def read_ceiling(files: list[str], workers: int, pinned: bool) -> float:
    """Threads preadv every file into one reused (pinned) 32 MiB buffer each: the host read ceiling."""
    import torch

    jobs: list[tuple[str, int, int]] = []
    for f in files:
        size = os.path.getsize(f)
        jobs += [(f, off, min(32 << 20, size - off)) for off in range(0, size, 32 << 20)]
    lock = threading.Lock()
    total = sum(n for _, _, n in jobs)

    def run() -> None:
        buf = torch.empty(32 << 20, dtype=torch.uint8, pin_memory=pinned)
        mv = buf.numpy().data
        fds: dict[str, int] = {}
        while True:
            with lock:
                if not jobs:
                    break
                f, off, n = jobs.pop()
            fd = fds.get(f) or fds.setdefault(f, os.open(f, os.O_RDONLY))
            os.preadv(fd, [mv[:n]], off)
        for fd in fds.values():
            os.close(fd)

    t = time.perf_counter()
    threads = [threading.Thread(target=run) for _ in range(workers)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return total / (time.perf_counter() - t)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    from modelpack.loader import LoaderOptions, LoadStats, load_state_dict
    from modelpack.loader.benchdata import warm, write_fast_checkpoint
    from modelpack.loader.plan import ShardRule

    from modelpack.cli import parse_size

    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        print(
            "no CUDA device: run this on the GPU node (or pass --device cpu for a logic check)",
            file=sys.stderr,
        )
        return 2
    size = parse_size(args.size)
    t = time.perf_counter()
    if not os.path.exists(os.path.join(args.dir, f".generated-{size}-{args.shards}")):
        import shutil

        shutil.rmtree(args.dir, ignore_errors=True)
        write_fast_checkpoint(args.dir, size, args.shards)
        open(os.path.join(args.dir, f".generated-{size}-{args.shards}"), "w").close()
    files = sorted(os.path.join(args.dir, f) for f in os.listdir(args.dir) if f.endswith(".safetensors"))
    total = warm(files)
    print(
        f"checkpoint {total / 2**30:.2f} GiB in {len(files)} files (ready in {time.perf_counter() - t:.1f} s)"
    )
    if cuda:
        print(f"device {torch.cuda.get_device_name()}  torch {torch.__version__}  cores {os.cpu_count()}")

    h2d = h2d_ceiling(args.device) if cuda else 0.0
    rd = read_ceiling(files, args.workers, pinned=cuda)
    if cuda:
        print(f"ceiling  pinned H2D copy_          {h2d / 1e9:7.2f} GB/s")
    print(f"ceiling  host read ({args.workers} threads)     {rd / 1e9:7.2f} GB/s")
    opts = LoaderOptions(workers=args.workers, slots=args.workers + 4, slot_bytes=args.slot_mib << 20)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def one(
        tp: int, rank: int, out: dict[str, torch.Tensor] | None = None, **kw: object
    ) -> tuple[float, LoadStats, dict[str, torch.Tensor]]:
        st = LoadStats()
        source = kw.pop("source", args.dir)
        sync()
        t0 = time.perf_counter()
        sd = load_state_dict(
            source,
            args.device,
            tp_size=tp,
            tp_rank=rank,
            allow_unverified=source == args.dir,  # the generated plain directory
            options=opts,
            stats=st,
            out=out,
            **kw,
        )
        sync()
        return time.perf_counter() - t0, st, sd

    def report(label: str, secs: float, nbytes: int) -> None:
        gbps = nbytes / secs
        ratios = f"  = {gbps / h2d:.2f}x H2D" if h2d else ""
        print(f"{label:<36} {gbps / 1e9:7.2f} GB/s  {secs:7.3f} s{ratios}  {gbps / rd:.2f}x host read")

    # warm-up (CUDA context, allocator, pinned ring)
    one(1, 0)
    secs, st, sd = one(1, 0)
    report("modelpack TP=1 (fresh tensors)", secs, st.bytes_to_read)
    out = sd
    secs, st, _ = one(1, 0, out=out)
    report("modelpack TP=1 (preallocated out=)", secs, st.bytes_to_read)

    from safetensors import safe_open

    def spot(sd: dict[str, torch.Tensor], tp: int, rank: int, plan: object) -> None:
        checked = 0
        for t in getattr(plan, "tensors", []):
            if checked >= 6 or t.name not in sd:
                continue
            if checked >= 3 and t.rule is ShardRule.REPLICATE:
                continue
            with safe_open(os.path.join(args.dir, t.file), framework="pt") as f:
                full = f.get_tensor(t.name)
            want = (
                full
                if t.rule is ShardRule.REPLICATE
                else torch.chunk(full, tp, 0 if t.rule is ShardRule.DIM0 else 1)[rank]
            )
            assert torch.equal(sd[t.name].cpu(), want), f"{t.name} rank {rank}: mismatch"
            checked += 1

    spot(out, 1, 0, st.plan)
    del sd, out
    if cuda:
        torch.cuda.empty_cache()

    times = []
    for rank in range(args.tp):
        secs, st, sd = one(args.tp, rank)
        times.append((secs, st.bytes_read, st.bytes_to_read))
        if rank in (0, args.tp - 1):
            spot(sd, args.tp, rank, st.plan)
        del sd
        if cuda:
            torch.cuda.empty_cache()
    slow = max(times)
    print(
        f"simulated TP={args.tp}: slowest rank {slow[0]:.3f} s ({slow[2] / slow[0] / 1e9:.2f} GB/s of its shard), "
        f"bytes per rank {min(b for _, b, _ in times) / 2**30:.2f}–{max(b for _, b, _ in times) / 2**30:.2f} GiB "
        f"(model/TP = {total / args.tp / 2**30:.2f} GiB), sum over ranks {sum(s for s, _, _ in times):.2f} s"
    )
    report(f"TP={args.tp} slowest rank", slow[0], slow[2])

    if args.verify_chunks:
        import tempfile

        from modelpack.signing.chunks import compute_chunk_table

        from modelpack import api
        from modelpack.targets.layout import OCILayoutTarget

        lay = tempfile.mkdtemp(prefix="mp-gpu-layout-", dir=os.path.dirname(args.dir) or "/tmp")
        t = time.perf_counter()
        packed = api.pack(args.dir, f"oci:{lay}:v1")
        target = OCILayoutTarget(lay)
        table = compute_chunk_table(target, packed.artifact.manifest, jobs=os.cpu_count() or 2)
        print(f"packed + chunk table in {time.perf_counter() - t:.1f} s")
        digest = str(packed.artifact.digest)
        secs, st, sd = one(1, 0, source=f"oci:{lay}@{digest}", chunk_table=table, expected_digest=digest)
        report("modelpack TP=1 chunk-verified", secs, st.bytes_to_read)
        del sd
        import shutil

        shutil.rmtree(lay, ignore_errors=True)
    if not args.keep:
        import shutil

        shutil.rmtree(args.dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
