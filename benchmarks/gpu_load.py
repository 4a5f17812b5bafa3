"""Loader → GPU: correctness first, then throughput against the pinned H2D ceiling, one script.

    python benchmarks/gpu_load.py                       # on a CUDA node (H200 / H20): < 5 minutes
    python benchmarks/gpu_load.py --size 16GiB --tp 8 --workers 8 --json-out result.json
    python benchmarks/gpu_load.py --device cpu --size 32MiB   # the same logic without a GPU

1. Generates a bf16 Llama-shaped checkpoint (default 8 GiB in 4 shards; 80 layers, hidden size
   scaled to the size: ``benchmarks/shapes.py`` + ``modelpack.testdata.synthetic``) and loads it
   once with safetensors (``load_file``) on the CPU: the reference.
2. **Correctness**, before anything is timed: modelpack loads TP=1, then every rank of a simulated
   TP=2 and TP=8 group (``--tp-check``), onto ``--device``. Every tensor must be there (no
   missing, no extra name), on the device, with the reference's dtype, and byte-equal (compared
   as raw bytes on the device) to the reference — for a sharded tensor, to the reference's slice
   under the shard rules (dim0: rows, dim1: columns; ``torch.chunk`` of the full tensor). The
   first mismatch is reported with tensor, rank and first differing byte, the JSON says
   ``"passed": false`` and the script exits 1 without measuring anything.
3. **Throughput**: the copy ceiling (pinned host → device ``copy_`` of 1 GiB, best of 5; on
   ``--device cpu`` a host memcpy), the host read ceiling (``--workers`` threads ``preadv`` the
   files), modelpack TP=1 (fresh tensors; best of ``--repeat``), TP=1 into preallocated ``out=``
   tensors, and every TP group of ``--tp-check`` and ``--tp`` **run as an engine runs it**: one
   process per rank, all started together behind a gloo barrier, rank ``r`` on ``cuda:r % N``;
   the slowest rank and the group's wall time; GB/s and the ratio to each ceiling.
4. Writes the result as JSON to ``--json-out`` (default ``$OUT/gpu_load.json`` when ``$OUT`` is
   set, else ``./gpu_load.json``); exit 0 only when correctness passed.

5. **Delivery rows on the same files** (``--no-delivery`` skips them), each timed (best of
   ``--repeat``) and then compared tensor by tensor on the device with the reference: the
   checkpoint is packed, pushed signed (chunk table) to a loopback ``docker-registry`` (the one the
   tests start; an OCI layout where none is installed, said in the JSON) and pulled into a node
   cache (``modelpack pull --cache``); then ``modelpack hit`` (the verified node-cache snapshot,
   pinned digest), ``modelpack stream`` (range reads, every chunk verified against the signed
   table), ``safetensors`` (``load_file(device=…)``), ``runai-model-streamer``
   (``SafetensorsStreamer``, its documented file-system concurrency 16) and ``fastsafetensors``
   (``SafeTensorsFileLoader``, ``nogds=True``) on the snapshot's files, with GB/s and the ratio to
   the pinned and the pageable H2D ceilings. A peer missing here is a row ``skipped`` with the
   reason, never a number. Two more modelpack rows: a standalone TP=2 rank 0 streaming its share
   from the OCI layout (an aligned chunk table with column blocks: dim-1 tensors read by rows and
   checked against the column blocks, the staged path on a GPU; ``read_vs_model`` says how much of
   the model it read), and a first start
   through a fresh node cache (``CacheStream``, ``publish="background"`` as the vLLM load format
   asks; ``publish_after_s``: when the snapshot was published after the load returned).

The JSON names the machine: GPU model, memory, PCIe link (``nvidia-smi --query-gpu``: generation and
width, current and max) and torch's device properties, or why there are none.

``--dry`` is the logic check this repository's suite runs without a GPU (``--device cpu``, 16 MiB,
TP=2, one repeat: tests/loader/test_gpu_load_script.py); the ceilings are then host memcpys and
say so.

``--verify-chunks`` also packs the checkpoint into an OCI layout, computes a chunk table and times
a load with per-chunk verification (adds hashing time), then the ``--tp`` group streaming it
chunk-verified twice: each rank alone, and the ranks sharing reads over a gloo group
(``LoaderOptions(group=…)``: node bytes read ≈ 1× the model).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

if TYPE_CHECKING:
    import torch


def default_json_out() -> str:
    out = os.environ.get("OUT")
    return os.path.join(out, "gpu_load.json") if out else "gpu_load.json"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="8GiB", help="checkpoint size (default 8GiB: < 5 minutes on an H200)")
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--tp", type=int, default=8, help="simulated tensor-parallel ranks timed (default 8)")
    ap.add_argument(
        "--tp-check", default="2,8", help="TP sizes whose every rank is checked byte for byte (default 2,8)"
    )
    ap.add_argument("--workers", type=int, default=8, help="loader read threads (default 8)")
    ap.add_argument("--slot-mib", type=int, default=32, help="staging slot size in MiB (default 32)")
    ap.add_argument("--repeat", type=int, default=3, help="timed TP=1 loads, best kept (default 3)")
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu for a logic check")
    ap.add_argument("--dir", default="/tmp/modelpack-gpu-bench", help="where the checkpoint is generated")
    ap.add_argument(
        "--json-out", default=None, help="result JSON (default $OUT/gpu_load.json or ./gpu_load.json)"
    )
    ap.add_argument("--verify-chunks", action="store_true", help="also time a chunk-verified load")
    ap.add_argument("--no-delivery", action="store_true", help="skip the registry/cache/peer rows (step 5)")
    ap.add_argument(
        "--stream-from",
        choices=("auto", "registry", "layout"),
        default="auto",
        help="the stream row's source: a loopback docker-registry, an OCI layout, or auto (the registry where installed)",
    )
    ap.add_argument(
        "--dry",
        action="store_true",
        help="the CPU logic check: --device cpu --size 16MiB --shards 2 --tp 2 --tp-check 2 --workers 2 --repeat 1",
    )
    ap.add_argument("--keep", action="store_true", help="keep the generated checkpoint")
    # flips one byte of one tensor in the file after the reference was taken: the check must fail
    ap.add_argument("--self-test-corrupt", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.dry:
        args.device, args.size, args.shards, args.tp, args.tp_check = "cpu", "16MiB", 2, 2, "2"
        args.workers, args.repeat = 2, 1
    if min(args.tp, args.workers, args.shards, args.slot_mib, args.repeat) < 1:
        ap.error("--tp, --workers, --shards, --slot-mib and --repeat must be positive")
    try:
        args.tp_check = sorted({int(x) for x in args.tp_check.split(",") if x.strip()})
    except ValueError:
        ap.error("--tp-check takes comma-separated integers, e.g. 2,8")
    if any(t < 1 for t in args.tp_check):
        ap.error("--tp-check sizes must be positive")
    args.json_out = args.json_out or default_json_out()
    return args


# ----------------------------------------------------------------------------- ceilings
def copy_ceiling(device: str, nbytes: int, pinned: bool = True) -> float:
    """Host → device ``copy_`` (best of 5): from pinned memory (``non_blocking``: a
    ``cudaMemcpyAsync`` the DMA engine runs at the link's speed) or from pageable memory (the
    driver stages it through its own pinned buffer); on the CPU a host memcpy of the same size."""
    import torch

    cuda = device.startswith("cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda and pinned)
    host.fill_(1)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dev.fill_(0)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    dev.copy_(host, non_blocking=cuda and pinned)
    sync()
    best = 0.0
    for _ in range(5):
        t = time.perf_counter()
        dev.copy_(host, non_blocking=cuda and pinned)
        sync()
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


# ----------------------------------------------------------------------------- the machine
NVIDIA_SMI_FIELDS = (
    "name",
    "memory.total",
    "driver_version",
    "pcie.link.gen.current",
    "pcie.link.gen.max",
    "pcie.link.width.current",
    "pcie.link.width.max",
)


def machine_info(device: str) -> dict[str, Any]:
    """GPU model, memory and PCIe link (``nvidia-smi --query-gpu``) and torch's device properties;
    for a CPU run, or where a source is missing, the reason instead."""
    import subprocess

    import torch

    info: dict[str, Any] = {}
    smi = shutil.which("nvidia-smi")
    if smi is None:
        info["nvidia_smi"] = {"skipped": "nvidia-smi not found"}
    else:
        proc = subprocess.run(
            [smi, f"--query-gpu={','.join(NVIDIA_SMI_FIELDS)}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if proc.returncode != 0:
            info["nvidia_smi"] = {"skipped": f"exit {proc.returncode}: {proc.stderr.strip()[:200]}"}
        else:
            info["nvidia_smi"] = [
                dict(zip(NVIDIA_SMI_FIELDS, (c.strip() for c in line.split(",")), strict=False))
                for line in proc.stdout.strip().splitlines()
            ]
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpus"] = torch.cuda.device_count()
        props = torch.cuda.get_device_properties(torch.device(device))
        info["torch_props"] = {
            "name": props.name,
            "total_memory": props.total_memory,
            "multi_processor_count": props.multi_processor_count,
            "capability": f"{props.major}.{props.minor}",
        }
    else:
        info["gpus"] = 0
        info["torch_props"] = {"skipped": f"device {device}: no CUDA device in this run"}
    return info


# ----------------------------------------------------------------------------- delivery rows
RUNAI_CONCURRENCY = 16  # runai-model-streamer's docs (env-vars.md): 16 for a file system


def prepare_delivery(directory: str, work: str, stream_from: str = "auto") -> dict[str, Any]:
    """Pack, push signed (chunk table) to a loopback registry (an OCI layout where no
    docker-registry is installed) and ``pull --cache``: what the delivery rows load."""
    from modelpack.signing.keys import generate_key

    from modelpack import api

    key = generate_key()
    pub = os.path.join(work, "key.pub")
    with open(pub, "wb") as f:
        f.write(key.public.pem)
    out: dict[str, Any] = {"public_key": pub, "key": key}
    t = time.perf_counter()
    layout = os.path.join(work, "layout")
    packed = api.pack(directory, f"oci:{layout}:v1", jobs=os.cpu_count() or 4)
    out["digest"] = digest = str(packed.artifact.digest)
    out["pack_seconds"] = time.perf_counter() - t
    registry = None
    have_registry = os.path.exists("/usr/bin/docker-registry")
    if stream_from == "registry" and not have_registry:
        raise RuntimeError("--stream-from registry: /usr/bin/docker-registry is not installed")
    if stream_from != "layout" and have_registry:
        from pathlib import Path

        from tests.fixtures.registry import start_registry

        registry = start_registry(Path(work) / "registry")
        out["registry"] = registry
        t = time.perf_counter()
        api.push(f"oci:{layout}:v1", registry.ref("bench/gpu", "v1"), sign_key=key, progress="off")
        out["push_seconds"] = time.perf_counter() - t
        out["reference"] = f"{registry.host}/bench/gpu@{digest}"
        out["stream_source"] = "loopback docker-registry"
    # a tensor-aligned table with column blocks (what `modelpack sign` writes) for the layout: a
    # standalone rank reads its dim-1 columns by rows from local files (a registry answers each
    # row range for ~0.5 ms: column reads from one are opt-in, `--column-reads always`)
    from modelpack.signing.chunks import compute_chunk_table

    from modelpack.targets.layout import OCILayoutTarget

    out["layout_reference"] = f"oci:{layout}@{digest}"
    out["layout_table"] = compute_chunk_table(
        OCILayoutTarget(layout), packed.artifact.manifest, jobs=os.cpu_count() or 2, aligned=True
    )
    if registry is None:
        out["chunk_table"] = out["layout_table"]
        out["reference"] = out["layout_reference"]
        out["stream_source"] = "OCI layout" + ("" if have_registry else " (no /usr/bin/docker-registry here)")
    from modelpack.mount import NodeCache

    t = time.perf_counter()  # `modelpack pull REF --cache DIR --key PUB`, in process
    pulled = NodeCache(os.path.join(work, "cache")).pull(
        out["reference"], policy=[key.public] if registry is not None else None
    )
    out["pull_seconds"] = time.perf_counter() - t
    out["snapshot"] = pulled.path
    return out


def load_peer(name: str, files: list[str], device: str) -> dict[str, torch.Tensor]:
    """One peer's load of ``files`` onto ``device``, each tensor its own memory."""
    if name == "safetensors":
        from safetensors.torch import load_file

        sd: dict[str, torch.Tensor] = {}
        for f in files:
            sd.update(load_file(f, device=device))
        return sd
    if name == "runai-model-streamer":
        from runai_model_streamer import SafetensorsStreamer

        os.environ.setdefault("RUNAI_STREAMER_CONCURRENCY", str(RUNAI_CONCURRENCY))
        os.environ.setdefault("RUNAI_STREAMER_LOG_LEVEL", "ERROR")
        sd = {}
        with SafetensorsStreamer() as s:
            s.stream_files(files, device=device)
            for k, v in s.get_tensors():
                sd[k] = v.to(device).clone()  # its buffers are reused
        return sd
    if name == "fastsafetensors":
        from fastsafetensors import SafeTensorsFileLoader, SingleGroup

        loader = SafeTensorsFileLoader(SingleGroup(), device, nogds=True)
        loader.add_filenames({0: files})
        fb = loader.copy_files_to_device()
        try:
            sd = {k: fb.get_tensor(k).clone() for meta, _ in loader.meta.values() for k in meta.tensors}
        finally:
            fb.close()
            loader.close()
        return sd
    raise ValueError(name)


def peer_missing(name: str) -> str | None:
    mod = {"runai-model-streamer": "runai_model_streamer", "fastsafetensors": "fastsafetensors"}.get(name)
    try:
        __import__(mod or "safetensors")
    except Exception as exc:
        return f"not importable here: {type(exc).__name__}: {str(exc)[:200]}"
    return None


# ----------------------------------------------------------------------------- correctness
class Mismatch(Exception):
    pass


def expected_slice(full: torch.Tensor, rule: str, tp: int, rank: int) -> torch.Tensor:
    """The reference's part for ``rank`` under a shard rule, by torch alone (not the loader's plan)."""
    import torch

    if tp == 1 or rule == "replicate":
        return full
    dim = 0 if rule == "dim0" else 1
    return torch.chunk(full, tp, dim)[rank]


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    import torch

    return t.contiguous().reshape(-1).view(torch.uint8)


def check_rank(
    sd: dict[str, torch.Tensor],
    reference: dict[str, torch.Tensor],
    rules: dict[str, str],
    device: str,
    tp: int,
    rank: int,
) -> int:
    """Raise ``Mismatch`` unless ``sd`` is exactly rank ``rank`` of ``tp`` of ``reference``; returns bytes checked."""
    import torch

    want_type = torch.device(device).type
    missing = sorted(set(reference) - set(sd))
    extra = sorted(set(sd) - set(reference))
    if missing or extra:
        raise Mismatch(f"TP={tp} rank {rank}: missing tensors {missing[:5]}, unexpected {extra[:5]}")
    checked = 0
    for name, full in reference.items():
        got = sd[name]
        rule = rules.get(name, "replicate")
        want = expected_slice(full, rule, tp, rank)
        where = f"TP={tp} rank {rank} tensor {name!r} ({rule})"
        if got.device.type != want_type:
            raise Mismatch(f"{where}: on {got.device}, expected {device}")
        if got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape):
            raise Mismatch(
                f"{where}: {got.dtype} {tuple(got.shape)}, expected {want.dtype} {tuple(want.shape)}"
            )
        a = as_bytes(got)
        b = as_bytes(want).to(got.device, non_blocking=False)
        if not torch.equal(a, b):
            first = int(torch.nonzero(a != b)[0].item())
            raise Mismatch(
                f"{where}: bytes differ from the safetensors reference, first at byte {first} "
                f"(got {int(a[first])}, expected {int(b[first])})"
            )
        checked += a.numel()
    return checked


def corrupt_one_byte(directory: str, files: list[str]) -> str:
    """Flip one byte in the middle of a column-split tensor's data on disk; returns its name."""
    from modelpack.packing.safetensors_format import read_header

    for path in reversed(files):
        hdr = read_header(path)
        for info in hdr.tensors:
            if info.name.endswith("down_proj.weight"):
                off = hdr.data_start + info.begin + info.nbytes // 2 + 1
                with open(path, "r+b") as f:
                    f.seek(off)
                    b = f.read(1)
                    f.seek(off)
                    f.write(bytes([b[0] ^ 0x01]))
                    f.flush()
                    os.fsync(f.fileno())
                # the generator's stamp no longer describes these files
                for stamp in os.listdir(directory):
                    if stamp.startswith(".generated-"):
                        os.unlink(os.path.join(directory, stamp))
                return info.name
    raise SystemExit("no down_proj tensor to corrupt")


# ----------------------------------------------------------------------------- main
RANK_FLAG = "--rank-child"


def rank_child(spec: dict[str, Any]) -> int:
    """One rank of a concurrent TP group (a process of its own, as in an engine)."""
    import torch
    import torch.distributed as dist
    from modelpack.loader import LoaderOptions, LoadStats, load_state_dict

    rank, tp = spec["rank"], spec["tp"]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=spec["init"], rank=rank, world_size=tp)
    device = spec["device"]
    if device.startswith("cuda"):
        device = f"cuda:{rank % torch.cuda.device_count()}"
        torch.cuda.set_device(device)
    table = None
    if spec.get("chunk_table"):
        from modelpack.signing.chunks import ChunkTable

        with open(spec["chunk_table"]) as f:
            table = ChunkTable.from_predicate(json.load(f))
    opts = LoaderOptions(
        workers=spec["workers"],
        slots=spec["workers"] + 4,
        slot_bytes=spec["slot_mib"] << 20,
        group=dist.group.WORLD if spec.get("share") else None,
    )
    st = LoadStats()
    dist.barrier()
    t0 = time.perf_counter()
    sd = load_state_dict(
        spec["source"],
        device,
        tp_size=tp,
        tp_rank=rank,
        allow_unverified=bool(spec.get("allow_unverified")),
        chunk_table=table,
        options=opts,
        stats=st,
    )
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    secs = time.perf_counter() - t0
    dist.barrier()
    doc = {
        "rank": rank,
        "pid": os.getpid(),
        "device": device,
        "seconds": secs,
        "tensors": len(sd),
        "bytes_read": st.bytes_read,
        "bytes_received": st.bytes_received,
        "bytes_to_read": st.bytes_to_read,
    }
    print("RANK " + json.dumps(doc), flush=True)
    dist.destroy_process_group()
    return 0


def _rank_entry(spec: dict[str, Any], results: Any) -> None:
    """A forked rank: run it, hand its report (or its failure) to the parent."""
    import contextlib
    import io
    import traceback

    try:
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            rank_child(spec)
        line = next((x for x in buf.getvalue().splitlines() if x.startswith("RANK ")), None)
        results.put({"line": line, "rank": spec["rank"]})
    except BaseException as exc:
        results.put(
            {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-2000:]}", "rank": spec["rank"]}
        )


def run_group(tp: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Start ``tp`` rank processes at once (gloo group on loopback), wait for all, collect them.

    The ranks fork from one server process that imported torch and the loader once (not ``tp``
    interpreters importing torch on a few cores) and that never touched CUDA, so each rank
    initialises its own device as an engine's worker does."""
    import multiprocessing as mp
    import queue
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        init = f"tcp://127.0.0.1:{sock.getsockname()[1]}"
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "modelpack.loader", "safetensors"])
    results = ctx.Queue()
    t0 = time.perf_counter()
    procs = [
        ctx.Process(
            target=_rank_entry, args=({**spec, "rank": r, "tp": tp, "init": init}, results), daemon=True
        )
        for r in range(tp)
    ]
    for p in procs:
        p.start()
    got: list[dict[str, Any]] = []
    deadline = time.monotonic() + 1800
    while len(got) < tp and time.monotonic() < deadline:
        try:
            got.append(results.get(timeout=2.0))
        except queue.Empty:
            if not any(p.is_alive() for p in procs) and results.empty():
                break
        if any("error" in g for g in got):
            break
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    wall = time.perf_counter() - t0
    errors = [g["error"] for g in got if "error" in g]
    if errors or len(got) < tp:
        raise RuntimeError(
            f"TP={tp} group: {len(errors) or tp - len(got)} rank(s) failed:\n"
            + (errors[0] if errors else f"exit codes {[p.exitcode for p in procs]}")
        )
    ranks = [json.loads(g["line"][len("RANK ") :]) for g in got]
    ranks.sort(key=lambda r: r["rank"])
    return {"processes": tp, "concurrent": True, "wall_seconds": wall, "ranks": ranks}


def delivery_rows(
    args: argparse.Namespace,
    files: list[str],
    compiled: Any,
    pageable: float,
    pinned: float,
    sync: Any,
    free: Any,
) -> dict[str, Any]:
    """Step 5: pack → push → pull --cache, then the hit, the chunk-verified stream and the peers on
    the snapshot's files; each row timed, then every tensor compared on the device."""
    import tempfile

    from modelpack.loader import CacheStream, LoaderOptions, LoadStats, load_state_dict
    from modelpack.loader.plan import rule_for
    from modelpack.mount import NodeCache
    from safetensors.torch import load_file

    out: dict[str, Any] = {"rows": {}}
    work = tempfile.mkdtemp(prefix="mp-gpu-delivery-", dir=os.path.dirname(os.path.abspath(args.dir)))
    prepared: dict[str, Any] = {}
    try:
        prepared = prepare_delivery(args.dir, work, args.stream_from)
        out.update(
            stream_source=prepared["stream_source"],
            pack_seconds=prepared["pack_seconds"],
            push_seconds=prepared.get("push_seconds"),
            pull_cache_seconds=prepared["pull_seconds"],
        )
        snap_files = sorted(
            os.path.join(prepared["snapshot"], f)
            for f in os.listdir(prepared["snapshot"])
            if f.endswith(".safetensors")
        )
        if [os.path.basename(f) for f in snap_files] != [os.path.basename(f) for f in files]:
            raise RuntimeError(f"snapshot {prepared['snapshot']} does not hold the checkpoint's files")
        reference: dict[str, torch.Tensor] = {}
        for f in snap_files:
            reference.update((k, v.clone()) for k, v in load_file(f, device="cpu").items())
        whole = {n: "replicate" for n in reference}
        halves = {n: rule_for(n, tuple(t.shape), compiled).value for n, t in reference.items()}
        total = sum(t.numel() * t.element_size() for t in reference.values())
        half = sum(
            expected_slice(t, halves[n], 2, 0).numel() * t.element_size() for n, t in reference.items()
        )
        caches = iter(range(1_000_000))

        def modelpack_row(kind: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
            st = LoadStats()
            keys = [prepared["key"].public]
            extra: dict[str, Any] = {}
            if kind == "hit":
                sd = load_state_dict(
                    prepared["snapshot"], args.device, expected_digest=prepared["digest"], stats=st
                )
            elif kind == "cache":  # a first start through a fresh node cache
                src = CacheStream(
                    NodeCache(os.path.join(work, f"cold-{next(caches)}")),
                    prepared["reference"],
                    publish="background",
                )
                sd = load_state_dict(src, args.device, trusted_keys=keys, stats=st)
                returned = time.perf_counter()
                report = src.wait()
                extra = {"cache": report.state, "publish_after_s": time.perf_counter() - returned}
            elif kind == "share":  # its dim-1 columns by rows, from the layout's files
                sd = load_state_dict(
                    prepared["layout_reference"],
                    args.device,
                    chunk_table=prepared["layout_table"],
                    tp_size=2,
                    tp_rank=0,
                    options=LoaderOptions(column_reads="local"),
                    stats=st,
                )
                extra = {"read_vs_model": st.bytes_read / total}
            else:
                sd = load_state_dict(
                    prepared["reference"],
                    args.device,
                    trusted_keys=keys,
                    chunk_table=prepared.get("chunk_table"),
                    stats=st,
                )
            return sd, {
                "bytes_read": st.bytes_read,
                "state": st.state,
                "verification": sorted(set(st.verification.values())),
                **extra,
            }

        def peer_row(name: str) -> Any:
            return lambda: (load_peer(name, snap_files, args.device), {})

        # (label, load, the rank's shard rules, TP size, bytes delivered to the rank)
        contenders = [
            ("modelpack hit (verified node cache)", lambda: modelpack_row("hit"), whole, 1, total),
            (
                f"modelpack stream (chunk-verified, {prepared['stream_source']})",
                lambda: modelpack_row("stream"),
                whole,
                1,
                total,
            ),
            (
                "modelpack stream, standalone TP=2 rank 0 (column reads, OCI layout)",
                lambda: modelpack_row("share"),
                halves,
                2,
                half,
            ),
            (
                "modelpack stream + node cache (first start, publish in background)",
                lambda: modelpack_row("cache"),
                whole,
                1,
                total,
            ),
            ("safetensors load_file", peer_row("safetensors"), whole, 1, total),
            (
                f"runai-model-streamer (concurrency {RUNAI_CONCURRENCY})",
                peer_row("runai-model-streamer"),
                whole,
                1,
                total,
            ),
            ("fastsafetensors (nogds)", peer_row("fastsafetensors"), whole, 1, total),
        ]
        for label, fn, rules, tp, delivered in contenders:
            peer = label.split(" ")[0]
            why = None if peer == "modelpack" else peer_missing(peer)
            if why:
                out["rows"][label] = {"skipped": why}
                print(f"{label:<60} skipped: {why}")
                continue
            best = None
            info: dict[str, Any] = {}
            try:
                for _ in range(args.repeat):
                    sync()
                    t = time.perf_counter()
                    sd, info = fn()
                    sync()
                    secs = time.perf_counter() - t
                    try:
                        check_rank(sd, reference, rules, args.device, tp, 0)  # on the device
                    except Mismatch as exc:
                        out["error"] = f"{label}: {exc}"
                        return out
                    del sd
                    free()
                    best = secs if best is None else min(best, secs)
            except Mismatch:
                raise
            except Exception as exc:
                if peer == "modelpack":
                    raise
                out["rows"][label] = {"skipped": f"failed here: {type(exc).__name__}: {str(exc)[:200]}"}
                print(f"{label:<60} skipped: {out['rows'][label]['skipped']}")
                continue
            assert best is not None
            gbps = delivered / best
            out["rows"][label] = {
                "seconds": best,
                "bytes": delivered,
                "gbps": gbps / 1e9,
                "vs_pinned_h2d": gbps / pinned,
                "vs_pageable_h2d": gbps / pageable,
                "checked_on_device": True,
                **info,
            }
            print(f"{label:<60} {gbps / 1e9:7.2f} GB/s  {best:7.3f} s  = {gbps / pinned:.2f}x pinned H2D")
    finally:
        registry = prepared.get("registry")
        if registry is not None:
            registry.stop()
        shutil.rmtree(work, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    raw = sys.argv[1:] if argv is None else argv
    if raw[:1] == [RANK_FLAG]:
        return rank_child(json.loads(raw[1]))
    args = parse_args(argv)
    t_start = time.perf_counter()
    import torch
    from modelpack.loader import LoaderOptions, LoadStats, load_state_dict
    from modelpack.loader.benchdata import warm
    from modelpack.loader.plan import compile_rules, rule_for
    from safetensors.torch import load_file
    from shapes import spec_for

    from modelpack.cli import parse_size
    from modelpack.testdata.synthetic import write_checkpoint

    cuda = args.device.startswith("cuda")
    result: dict[str, Any] = {
        "command": " ".join(["benchmarks/gpu_load.py", *(argv if argv is not None else sys.argv[1:])]),
        "device": args.device,
        "torch": torch.__version__,
        "host": {"cores": os.cpu_count(), "platform": platform.platform()},
        "passed": False,
    }

    def write_json() -> None:
        result["seconds_total"] = round(time.perf_counter() - t_start, 3)
        os.makedirs(os.path.dirname(os.path.abspath(args.json_out)), exist_ok=True)
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")

    if cuda and not torch.cuda.is_available():
        print(
            "no CUDA device: run this on the GPU node (or pass --device cpu for a logic check)",
            file=sys.stderr,
        )
        result["error"] = "no CUDA device"
        write_json()
        return 2
    if cuda:
        result["device_name"] = torch.cuda.get_device_name(torch.device(args.device))
        result["cuda"] = torch.version.cuda
    result["machine"] = machine_info(args.device)

    size = parse_size(args.size)
    stamp = os.path.join(args.dir, f".generated-{size}-{args.shards}")
    t = time.perf_counter()
    if not os.path.exists(stamp):
        shutil.rmtree(args.dir, ignore_errors=True)
        write_checkpoint(args.dir, spec_for(size, args.shards))
        open(stamp, "w").close()
    files = sorted(os.path.join(args.dir, f) for f in os.listdir(args.dir) if f.endswith(".safetensors"))
    total = warm(files)
    result.update(size_bytes=total, files=len(files), generate_seconds=round(time.perf_counter() - t, 3))
    print(
        f"checkpoint {total / 2**30:.2f} GiB in {len(files)} files (ready in {time.perf_counter() - t:.1f} s)"
    )
    if cuda:
        print(f"device {result['device_name']}  torch {torch.__version__}  cores {os.cpu_count()}")

    opts = LoaderOptions(workers=args.workers, slots=args.workers + 4, slot_bytes=args.slot_mib << 20)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def one(
        tp: int, rank: int, out: dict[str, torch.Tensor] | None = None, **kw: Any
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

    def free() -> None:
        if cuda:
            torch.cuda.empty_cache()

    # ---- 1. reference, 2. correctness: nothing is timed unless every check passes
    t = time.perf_counter()
    reference: dict[str, torch.Tensor] = {}
    for f in files:
        # cloned: load_file's tensors may be views of the file's mapping, which would follow the file
        reference.update((k, v.clone()) for k, v in load_file(f, device="cpu").items())
    if args.self_test_corrupt:
        result["self_test_corrupted"] = corrupt_one_byte(args.dir, files)
    correctness: dict[str, Any] = {}
    result["correctness"] = correctness
    compiled = compile_rules()  # the shard rules (presets), applied here independently of the plan
    try:
        for tp in [1, *[x for x in args.tp_check if x != 1]]:
            ranks = []
            rules = {
                n: rule_for(n, tuple(t.shape), compiled).value if tp > 1 else "replicate"
                for n, t in reference.items()
            }
            for rank in range(tp):
                _, st, sd = one(tp, rank)
                planned = st.plan.layout() if st.plan is not None else {}
                if planned != rules:
                    diff = sorted(n for n in rules if planned.get(n) != rules[n])
                    raise Mismatch(
                        f"TP={tp} rank {rank}: the plan splits {diff[:3]} not as the shard rules say"
                    )
                nbytes = check_rank(sd, reference, rules, args.device, tp, rank)
                ranks.append(
                    {"rank": rank, "tensors": len(sd), "bytes_checked": nbytes, "bytes_read": st.bytes_read}
                )
                del sd
                free()
            splits = sorted(set(rules.values()))
            correctness[f"tp{tp}"] = {"passed": True, "ranks": ranks, "split_kinds": splits}
            print(
                f"correct  TP={tp}: {tp} rank(s), {len(reference)} tensors each, byte-equal ({', '.join(splits)})"
            )
    except Mismatch as exc:
        correctness["error"] = str(exc)
        print(f"MISMATCH: {exc}", file=sys.stderr)
        print("correctness failed: nothing measured", file=sys.stderr)
        result["correctness_seconds"] = round(time.perf_counter() - t, 3)
        write_json()
        if not args.keep:
            shutil.rmtree(args.dir, ignore_errors=True)
        return 1
    result["correctness_seconds"] = round(time.perf_counter() - t, 3)
    del reference

    # ---- 3. throughput
    ceiling_bytes = min(1 << 30, max(64 << 20, total)) if not cuda else 1 << 30
    cp = copy_ceiling(args.device, ceiling_bytes)
    pageable = copy_ceiling(args.device, ceiling_bytes, pinned=False)
    rd = read_ceiling(files, args.workers, pinned=cuda)
    label = "pinned H2D copy_" if cuda else "host memcpy (copy_)"
    plabel = "pageable H2D copy_" if cuda else "host memcpy, unpinned"
    print(f"ceiling  {label:<26} {cp / 1e9:7.2f} GB/s")
    print(f"ceiling  {plabel:<26} {pageable / 1e9:7.2f} GB/s")
    print(f"ceiling  host read ({args.workers} threads)     {rd / 1e9:7.2f} GB/s")
    measured: dict[str, Any] = {}
    result["ceilings"] = {
        "copy_gbps": cp / 1e9,
        "copy_kind": label,
        "pinned_h2d_gbps": cp / 1e9,
        "pageable_h2d_gbps": pageable / 1e9,
        "pageable_kind": plabel,
        "host_read_gbps": rd / 1e9,
    }
    result["load"] = measured

    def report(key: str, label: str, secs: float, nbytes: int) -> None:
        gbps = nbytes / secs
        measured[key] = {
            "seconds": secs,
            "bytes": nbytes,
            "gbps": gbps / 1e9,
            "vs_copy_ceiling": gbps / cp,
            "vs_host_read": gbps / rd,
        }
        print(
            f"{label:<36} {gbps / 1e9:7.2f} GB/s  {secs:7.3f} s  = {gbps / cp:.2f}x copy ceiling  {gbps / rd:.2f}x host read"
        )

    best: tuple[float, LoadStats, dict[str, torch.Tensor]] | None = None
    for _ in range(args.repeat):
        run = one(1, 0)
        if best is None or run[0] < best[0]:
            best = run
        else:
            del run
    assert best is not None
    secs, st, out = best
    report("tp1", "modelpack TP=1 (fresh tensors)", secs, st.bytes_to_read)
    secs, st, _ = one(1, 0, out=out)
    report("tp1_out", "modelpack TP=1 (preallocated out=)", secs, st.bytes_to_read)
    del out, best
    free()

    # TP groups as an engine runs them: one process per rank, all started together (a barrier),
    # each on its own device (cuda:rank % devices); the group is ready when its slowest rank is
    child = {"device": args.device, "workers": args.workers, "slot_mib": args.slot_mib}
    for tp in sorted({*[x for x in args.tp_check if x > 1], args.tp}):
        group = run_group(tp, {**child, "source": args.dir, "allow_unverified": True})
        measured[f"tp{tp}_group"] = group
        ranks = group["ranks"]
        slow = max(ranks, key=lambda r: r["seconds"])
        report(
            f"tp{tp}_slowest_rank",
            f"TP={tp} slowest of {tp} concurrent ranks",
            slow["seconds"],
            slow["bytes_to_read"],
        )
        print(
            f"TP={tp}: {tp} processes at once, group wall {group['wall_seconds']:.2f} s; bytes per rank "
            f"{min(r['bytes_read'] for r in ranks) / 2**30:.2f}–{max(r['bytes_read'] for r in ranks) / 2**30:.2f} GiB "
            f"(model/TP = {total / tp / 2**30:.2f} GiB)"
        )
        if tp == args.tp:
            measured["tp_ranks"] = [
                {k: r[k] for k in ("rank", "seconds", "bytes_read", "bytes_to_read")} for r in ranks
            ]

    if not args.no_delivery:
        rows = delivery_rows(args, files, compiled, pageable, cp, sync, free)
        result["delivery"] = rows
        if rows.get("error"):
            print(f"MISMATCH: {rows['error']}", file=sys.stderr)
            write_json()
            if not args.keep:
                shutil.rmtree(args.dir, ignore_errors=True)
            return 1

    if args.verify_chunks:
        import tempfile

        from modelpack.signing.chunks import compute_chunk_table

        from modelpack import api
        from modelpack.targets.layout import OCILayoutTarget

        lay = tempfile.mkdtemp(prefix="mp-gpu-layout-", dir=os.path.dirname(args.dir) or "/tmp")
        t = time.perf_counter()
        packed = api.pack(args.dir, f"oci:{lay}:v1")
        table = compute_chunk_table(OCILayoutTarget(lay), packed.artifact.manifest, jobs=os.cpu_count() or 2)
        print(f"packed + chunk table in {time.perf_counter() - t:.1f} s")
        digest = str(packed.artifact.digest)
        secs, st, sd = one(1, 0, source=f"oci:{lay}@{digest}", chunk_table=table, expected_digest=digest)
        report("tp1_chunk_verified", "modelpack TP=1 chunk-verified", secs, st.bytes_to_read)
        del sd
        table_path = os.path.join(lay, "chunk-table.json")
        with open(table_path, "w") as f:
            json.dump(table.to_predicate(), f)
        for share in (False, True):  # each rank reads alone, or the ranks share reads over a group
            spec = {**child, "source": f"oci:{lay}@{digest}", "chunk_table": table_path, "share": share}
            group = run_group(args.tp, spec)
            key = f"tp{args.tp}_chunk_verified_{'shared' if share else 'alone'}"
            measured[key] = group
            node = sum(r["bytes_read"] for r in group["ranks"])
            print(
                f"TP={args.tp} chunk-verified, {'reads shared over a gloo group' if share else 'each rank alone'}: "
                f"group wall {group['wall_seconds']:.2f} s, node read {node / total:.3f}× the model"
            )
        shutil.rmtree(lay, ignore_errors=True)
    result["passed"] = True
    result["ratio_tp1_vs_copy_ceiling"] = measured["tp1"]["vs_copy_ceiling"]
    if not args.keep:
        shutil.rmtree(args.dir, ignore_errors=True)
    write_json()
    print(f"wrote {args.json_out} ({time.perf_counter() - t_start:.0f} s in all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
