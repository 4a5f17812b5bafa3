"""The seed's model shape, end to end: a DeepSeek-V3-shaped MoE FP8 checkpoint through pack → push
→ pull --cache → load at TP=8 and TP=8 + EP=8, beside safetensors, runai-model-streamer and
fastsafetensors on the same files.

    .venv/bin/python benchmarks/seed_shape.py                     # default 512MiB: a few minutes on 2 cores
    .venv/bin/python benchmarks/seed_shape.py --size 2GiB --repeat 3 --json-out seed_shape.json
    .venv/bin/python benchmarks/seed_shape.py --tiny              # smoke test (tests/loader/test_seed_shape_script.py)

**The checkpoint** has the seed's structure at a size this machine holds: 141 safetensors shards
(plus ``model.safetensors.index.json``), DeepSeek-V3 names (MLA attention ``q_a_proj`` …
``kv_b_proj``, ``o_proj``; ``mlp.experts.{i}.{gate,up,down}_proj``, ``mlp.shared_experts.*``, the
router ``mlp.gate.weight`` + ``e_score_correction_bias``; the first ``first_k_dense_replace``
layers dense), 256 routed + 1 shared expert per MoE layer, every projection FP8 e4m3 with its
block-wise ``weight_scale_inv`` (``quantization_config.weight_block_size``), and a ``config.json``
with ``n_routed_experts``. ``--size`` scales the hidden and expert sizes (``--layers`` the depth);
``--tiny`` is the structure at a few MiB.

**Stages** (each timed): pack into an OCI layout, push to a loopback ``docker-registry`` signed
(``--sign-key``: the chunk table), ``pull --cache`` (``modelpack pull REF --cache DIR --json``) and
the same pull again (a hit).

**Loads**: 8 rank processes started together (a gloo group over loopback, one process per rank,
forked from one server that imported torch once, so 8 interpreter starts do not swamp 2 cores),
behind a barrier, for two layouts: ``tp8`` (TP=8: experts split by the TP rules) and ``tp8_ep8``
(TP=8 with EP=8: rank r holds the 32 routed experts vLLM's linear map gives it, whole, and TP
rank r's share of the rest). Rows, round-robin ``--repeat`` times:

- ``modelpack-stream-group``: ``load_state_dict(REF@digest, trusted_keys=[key],
  options=LoaderOptions(group=WORLD))``: every chunk verified against the signed chunk table, each
  needed chunk fetched once per node and broadcast;
- ``modelpack-stream-alone``: the same without the group (each rank fetches its chunks);
- ``modelpack-hit``: the node-cache snapshot (``--expected-digest``), no registry;
- ``safetensors``: ``safe_open`` + ``get_slice`` of the rank's share, from the snapshot's files;
- ``runai-model-streamer``: ``SafetensorsStreamer.stream_files(..., is_distributed=True)`` over
  the gloo group (``RUNAI_STREAMER_DIST=1``: its distributed mode on CPU) at its documented
  file-system concurrency (``RUNAI_STREAMER_CONCURRENCY=16``), the rank's share sliced and copied;
- ``fastsafetensors``: ``SafeTensorsFileLoader(SingleGroup(), "cpu", nogds=True)`` with, at EP=8,
  its own ``expert_parallel_filter`` (partial reads of local files), the share sliced and copied.

A peer that is not installed or cannot run here is a row with ``skipped`` and the reason.

**Correctness first**: every rank of every row hashes its tensors (name, dtype, shape, bytes); for
each layout all rows must equal the ``safetensors`` row, whose share is cut by this script's own
table (experts by index, TP splits by the presets, a block scale with its weight), not by the
loader's plan. A mismatch exits 1.

**Bytes**: per rank, what it read (``LoadStats.bytes_read``: registry range reads or local file
reads) against what it needed (``bytes_to_read``: its experts + replicated + its TP share), its
split-kind accounting, and the node's sum; for the peers ``rchar`` (read()/pread() bytes of the
process; ``safetensors`` maps the files, so its reads are page faults and not counted).
``modelpack timeline --json`` over the loader events gives p50/p95 of t4−t3 and t5−t3 per state
(one start = one group load).

JSON to ``--json-out`` (default ``$OUT/seed_shape.json`` or ``./seed_shape.json``) and a markdown
table on stdout.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import multiprocessing as mp
import os
import platform
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

EXPERTS = 256
SHARED = 1
WORLD = 8
LAYOUTS = {"tp8": (8, 1), "tp8_ep8": (8, 8)}
ROWS = (
    "modelpack-stream-group",
    "modelpack-stream-alone",
    "modelpack-hit",
    "safetensors",
    "runai-model-streamer",
    "fastsafetensors",
)
RUNAI_CONCURRENCY = 16  # docs/src/env-vars.md of runai-model-streamer: 16 for a file system
EXPERT_RE = re.compile(r"\.experts\.(\d+)\.")
# the TP presets (loader/plan.py DEFAULT_RULES): the share a TP rank holds, cut here independently
DIM0_RE = re.compile(
    r"(^|\.)(q_proj|k_proj|v_proj|qkv_proj|gate_proj|up_proj|gate_up_proj|q_b_proj|kv_b_proj|embed_tokens|lm_head)$"
)
DIM1_RE = re.compile(r"(^|\.)(o_proj|down_proj)$")


# ----------------------------------------------------------------------------- the checkpoint
def approx_bytes(hidden: int, inter: int, layers: int, dense: int) -> int:
    """The checkpoint's size for these dimensions, to within the norms and scales (~1 %)."""
    attn = hidden * (hidden // 2) * 2 + hidden * (hidden // 4) * 2 + hidden * hidden  # MLA, FP8
    moe = (EXPERTS + SHARED) * 3 * hidden * inter
    return (
        layers * attn
        + dense * 3 * hidden * 2 * hidden
        + (layers - dense) * moe
        + 2 * 2 * hidden * WORLD * 512
    )


def dims_for(size: int, layers: int, dense: int, block: int | None) -> tuple[int, int, int]:
    """(hidden, moe_intermediate, block): multiples of 8 blocks (a TP=8 share is whole FP8 blocks),
    the expert width at most the hidden size, the pair whose checkpoint is nearest ``size``. The
    block is DeepSeek's 128 unless that makes even the smallest such model too big (or ``block``)."""
    blocks = [block] if block else [128, 64, 32, 16, 8]
    for b in blocks:
        unit = WORLD * b
        if b == blocks[-1] or approx_bytes(unit, unit, layers, dense) <= size:
            break
    options = [
        (abs(approx_bytes(unit * k, unit * j, layers, dense) - size), -k, unit * k, unit * j)
        for k in range(1, 65)
        for j in range(1, k + 1)
    ]
    _, _, hidden, inter = min(options)
    return hidden, inter, b


def tensor_specs(cfg: dict[str, Any]) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, kind) in DeepSeek-V3's order; kind: fp8 (with a block scale), bf16, f32."""
    h, inter, v, b = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["vocab_size"], cfg["_block"]
    dense_inter = cfg["intermediate_size"]
    q_rank, kv_rank = cfg["q_lora_rank"], cfg["kv_lora_rank"]
    out: list[tuple[str, tuple[int, ...], str]] = [("model.embed_tokens.weight", (v, h), "bf16")]
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        out.append((p + "input_layernorm.weight", (h,), "bf16"))
        a = p + "self_attn."
        out += [
            (a + "q_a_proj", (q_rank, h), "fp8"),
            (a + "q_a_layernorm.weight", (q_rank,), "bf16"),
            (a + "q_b_proj", (h, q_rank), "fp8"),
            (a + "kv_a_proj_with_mqa", (kv_rank + b, h), "fp8"),
            (a + "kv_a_layernorm.weight", (kv_rank,), "bf16"),
            (a + "kv_b_proj", (h, kv_rank), "fp8"),
            (a + "o_proj", (h, h), "fp8"),
        ]
        out.append((p + "post_attention_layernorm.weight", (h,), "bf16"))
        m = p + "mlp."
        if layer < cfg["first_k_dense_replace"]:
            out += [
                (m + "gate_proj", (dense_inter, h), "fp8"),
                (m + "up_proj", (dense_inter, h), "fp8"),
                (m + "down_proj", (h, dense_inter), "fp8"),
            ]
            continue
        out += [
            (m + "gate.weight", (EXPERTS, h), "bf16"),
            (m + "gate.e_score_correction_bias", (EXPERTS,), "f32"),
        ]
        for e in [f"experts.{i}." for i in range(EXPERTS)] + ["shared_experts."]:
            out += [
                (m + e + "gate_proj", (inter, h), "fp8"),
                (m + e + "up_proj", (inter, h), "fp8"),
                (m + e + "down_proj", (h, inter), "fp8"),
            ]
    out += [("model.norm.weight", (h,), "bf16"), ("lm_head.weight", (v, h), "bf16")]
    return out


def write_seed_checkpoint(
    directory: Path, size: int, layers: int, shards: int, block: int | None = None
) -> dict[str, Any]:
    """Write the checkpoint (``shards`` files in name order, about equal bytes) and its config."""
    import torch
    from safetensors.torch import save_file

    dense = min(3, max(1, layers // 4))
    hidden, inter, block = dims_for(size, layers, dense, block)
    cfg: dict[str, Any] = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_size": hidden,
        "intermediate_size": hidden * 2,
        "moe_intermediate_size": inter,
        "num_hidden_layers": layers,
        "first_k_dense_replace": dense,
        "n_routed_experts": EXPERTS,
        "n_shared_experts": SHARED,
        "num_experts_per_tok": 8,
        "q_lora_rank": hidden // 2,
        "kv_lora_rank": hidden // 4,
        "vocab_size": WORLD * 512,
        "torch_dtype": "bfloat16",
        "quantization_config": {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [block, block],
        },
        "_block": block,
    }
    specs = tensor_specs(cfg)
    g = torch.Generator().manual_seed(0)
    pool = torch.randint(-100, 100, (min(64 << 20, max(1 << 20, size // 4)),), dtype=torch.int8, generator=g)

    def fill(n: int, k: int) -> torch.Tensor:  # cheap distinct bytes: a window of the random pool
        if n > pool.numel():
            return pool.repeat(-(-n // pool.numel()))[:n]
        off = ((k * 7919 * 64) % (pool.numel() - n + 1)) & ~7
        return pool[off : off + n].clone()  # save_file refuses tensors that share memory

    tensors: list[tuple[str, torch.Tensor]] = []
    for k, (name, shape, kind) in enumerate(specs):
        n = math.prod(shape)
        if kind == "fp8":
            w = fill(n, k * 7919).view(torch.float8_e4m3fn).reshape(shape)
            tensors.append((name + ".weight", w))
            sshape = (-(-shape[0] // block), -(-shape[1] // block))
            s = (fill(math.prod(sshape) * 4, k * 104729).view(torch.float32).abs() % 1.0) + 0.5
            tensors.append((name + ".weight_scale_inv", s.reshape(sshape)))
        elif kind == "bf16":
            tensors.append((name, fill(n * 2, k * 31).view(torch.bfloat16).reshape(shape).nan_to_num()))
        else:
            tensors.append((name, fill(n * 4, k * 37).view(torch.float32).reshape(shape).nan_to_num()))
    total = sum(t.numel() * t.element_size() for _, t in tensors)
    directory.mkdir(parents=True, exist_ok=True)
    per = total / shards
    groups: list[list[tuple[str, torch.Tensor]]] = [[] for _ in range(shards)]
    acc = 0
    for name, t in tensors:
        i = min(shards - 1, int(acc / per))
        groups[i].append((name, t))
        acc += t.numel() * t.element_size()
    weight_map: dict[str, str] = {}
    for i, group in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file(dict(group), str(directory / fname), metadata={"format": "pt"})
        weight_map.update((name, fname) for name, _ in group)
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1)
    )
    public = {k: v for k, v in cfg.items() if not k.startswith("_")}
    (directory / "config.json").write_text(json.dumps(public, indent=1))
    return {**cfg, "tensors": len(tensors), "tensor_bytes": total}


# ----------------------------------------------------------------------------- the rank's share
def linear_experts(rank: int, ep: int) -> range:
    """vLLM's linear expert map: rank r holds a contiguous run (the first E % ep ranks one more)."""
    base, rem = divmod(EXPERTS, ep)
    start = rank * base + min(rank, rem)
    return range(start, start + base + (1 if rank < rem else 0))


def share_of(name: str, shape: tuple[int, ...], tp: int, ep: int, rank: int) -> tuple[str, int] | None:
    """(rule, dim) of the part of ``name`` rank ``rank`` holds: ("whole", -1) or ("chunk", dim);
    None: not on this rank. Cut by this table, not by the loader's plan."""
    m = EXPERT_RE.search(name)
    if m is not None and ep > 1:
        return ("whole", -1) if int(m.group(1)) in linear_experts(rank, ep) else None
    base = name.removesuffix(".weight_scale_inv").removesuffix(".weight")
    if tp > 1 and len(shape) == 2 and (name.endswith(".weight") or name.endswith(".weight_scale_inv")):
        if DIM0_RE.search(base):
            return ("chunk", 0)
        if DIM1_RE.search(base):
            return ("chunk", 1)
    return ("whole", -1)


def cut(t: Any, rule: tuple[str, int], tp: int, rank: int) -> Any:
    return t if rule[0] == "whole" else t.chunk(tp, rule[1])[rank % tp]


def state_digest(sd: dict[str, Any]) -> tuple[str, int]:
    """sha256 over (name, dtype, shape, bytes) in name order; and the bytes hashed."""
    import torch

    h = hashlib.sha256()
    n = 0
    for name in sorted(sd):
        t = sd[name].contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        h.update(raw)
        n += len(raw)
    return h.hexdigest(), n


# ----------------------------------------------------------------------------- one rank
def rchar() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    return 0


def rank_main(spec: dict[str, Any], rank: int, results: Any) -> None:
    """One rank of one row: init the gloo group, barrier, load, barrier, report."""
    try:
        results.put(_rank(spec, rank))
    except BaseException as exc:
        import traceback

        results.put(
            {"rank": rank, "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-3000:]}
        )


def _rank(spec: dict[str, Any], rank: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(spec.get("env", {}))
    dist.init_process_group("gloo", init_method=spec["init"], rank=rank, world_size=WORLD)
    tp, ep = spec["tp"], spec["ep"]
    row = spec["row"]
    files = spec["files"]
    out: dict[str, Any] = {"rank": rank, "pid": os.getpid()}
    dist.barrier()
    c0 = rchar()
    t0 = time.perf_counter()
    if row.startswith("modelpack"):
        sd = _modelpack(spec, rank, out)
    elif row == "safetensors":
        sd = _safetensors(files, tp, ep, rank)
    elif row == "runai-model-streamer":
        sd = _runai(files, tp, ep, rank, out)
    elif row == "fastsafetensors":
        sd = _fastsafetensors(files, tp, ep, rank)
    else:
        raise SystemExit(f"unknown row {row}")
    out["seconds"] = time.perf_counter() - t0
    out["rchar"] = rchar() - c0
    dist.barrier()
    out["tensors"] = len(sd)
    out["bytes_delivered"] = sum(t.numel() * t.element_size() for t in sd.values())
    if spec.get("digest"):
        out["digest"], _ = state_digest(sd)
    dist.destroy_process_group()
    return out


def _modelpack(spec: dict[str, Any], rank: int, out: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist
    from modelpack.loader import LoaderOptions, LoadRequest, LoadStats, load_state_dict
    from modelpack.signing.keys import load_public_key

    tp, ep = spec["tp"], spec["ep"]
    stats = LoadStats()
    req = LoadRequest(
        tp_size=tp,
        tp_rank=rank % tp,
        ep_size=ep,
        ep_rank=rank % ep,
        events=spec["events"],
        start_id=spec["start_id"],
        stats=stats,
        options=LoaderOptions(group=dist.group.WORLD if spec["row"].endswith("group") else None),
    )
    if spec["row"] == "modelpack-hit":
        req = req.replace(expected_digest=spec["digest_ref"])
        sd = load_state_dict(spec["snapshot"], req)
    else:
        req = req.replace(trusted_keys=[load_public_key(spec["public_key"])])
        sd = load_state_dict(spec["reference"], req)
    out.update(
        bytes_read=stats.bytes_read,
        bytes_received=stats.bytes_received,
        bytes_to_read=stats.bytes_to_read,
        bytes_by_split=stats.bytes_by_split,
        state=stats.state,
        verification=sorted(set(stats.verification.values())),
    )
    return sd


def _safetensors(files: list[str], tp: int, ep: int, rank: int) -> dict[str, Any]:
    from safetensors import safe_open

    sd = {}
    for f in files:
        with safe_open(f, framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 - safe_open is not a mapping
                sl = st.get_slice(name)
                shape = tuple(sl.get_shape())
                rule = share_of(name, shape, tp, ep, rank)
                if rule is None:
                    continue
                if rule[0] == "whole":
                    sd[name] = sl[:]
                else:
                    n = shape[rule[1]] // tp
                    lo, hi = (rank % tp) * n, (rank % tp + 1) * n
                    sd[name] = sl[lo:hi] if rule[1] == 0 else sl[:, lo:hi]
    return sd


def _runai(files: list[str], tp: int, ep: int, rank: int, out: dict[str, Any]) -> dict[str, Any]:
    import importlib.metadata as md

    from runai_model_streamer import SafetensorsStreamer

    out["version"] = md.version("runai-model-streamer")
    sd = {}
    with SafetensorsStreamer() as s:
        s.stream_files(files, device="cpu", is_distributed=True)
        for name, t in s.get_tensors():
            rule = share_of(name, tuple(t.shape), tp, ep, rank)
            if rule is not None:
                sd[name] = cut(t, rule, tp, rank).clone()  # its buffers are reused
        # whether its distributed mode really ran (it falls back to each rank reading alone)
        out["distributed"] = bool(getattr(s.file_streamer, "is_distributed", False))
    return sd


def _fastsafetensors(files: list[str], tp: int, ep: int, rank: int) -> dict[str, Any]:
    from fastsafetensors import SafeTensorsFileLoader, SingleGroup
    from fastsafetensors.ep_slice import expert_parallel_filter

    loader = SafeTensorsFileLoader(SingleGroup(), "cpu", nogds=True)
    if ep > 1:
        loader.set_tensor_filter(expert_parallel_filter(num_experts=EXPERTS, ep_size=ep, ep_rank=rank % ep))
    loader.add_filenames({0: files})
    fb = loader.copy_files_to_device()
    sd = {}
    try:
        for meta, _ in loader.meta.values():
            for name, frame in meta.tensors.items():
                shape = tuple(frame.shape)
                rule = share_of(name, shape, tp, ep, rank)
                if rule is not None:
                    sd[name] = cut(fb.get_tensor(name), rule, tp, rank).clone()
    finally:
        fb.close()
        loader.close()
    return sd


# ----------------------------------------------------------------------------- the parent
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_group(ctx: Any, spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    """WORLD rank processes at once; all must report. Returns ranks (sorted) and the wall time."""
    spec = {**spec, "init": f"tcp://127.0.0.1:{free_port()}"}
    results = ctx.Queue()
    t0 = time.perf_counter()
    procs = [ctx.Process(target=rank_main, args=(spec, r, results), daemon=True) for r in range(WORLD)]
    for p in procs:
        p.start()
    got: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout
    try:
        while len(got) < WORLD:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"{spec['row']} ({spec['layout']}): {len(got)}/{WORLD} ranks after {timeout:.0f} s"
                )
            try:
                got.append(results.get(timeout=min(left, 5.0)))
            except Exception:  # queue.Empty: check that the ranks still live
                if all(not p.is_alive() for p in procs) and results.empty():
                    raise RuntimeError(
                        f"{spec['row']} ({spec['layout']}): ranks exited without reporting "
                        f"(exit codes {[p.exitcode for p in procs]})"
                    ) from None
                if any(r.get("error") for r in got):
                    break
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    wall = time.perf_counter() - t0
    errors = [r for r in got if r.get("error")]
    if errors:
        raise RuntimeError(f"rank {errors[0]['rank']}: {errors[0]['error']}\n{errors[0].get('trace', '')}")
    return {"ranks": sorted(got, key=lambda r: r["rank"]), "wall_seconds": wall}


def peer_available(row: str) -> str | None:
    """None when the peer can run here, else why not."""
    mod = {"runai-model-streamer": "runai_model_streamer", "fastsafetensors": "fastsafetensors"}.get(row)
    if mod is None:
        return None
    try:
        __import__(mod)
    except Exception as exc:
        return f"not importable: {type(exc).__name__}: {exc}"[:300]
    return None


def modelpack_cli(*args: str, env: dict[str, str]) -> tuple[float, dict[str, Any]]:
    exe = Path(sys.executable).with_name("modelpack")
    cmd = [
        str(exe) if exe.exists() else sys.executable,
        *([] if exe.exists() else ["-m", "modelpack.cli"]),
        *args,
    ]
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    secs = time.perf_counter() - t
    if proc.returncode != 0:
        raise RuntimeError(
            f"modelpack {' '.join(args[:2])} failed ({proc.returncode}): {proc.stderr[-2000:]}"
        )
    try:
        return secs, json.loads(proc.stdout)
    except json.JSONDecodeError:
        return secs, {"stdout": proc.stdout[-2000:]}


def summarize(rows: dict[str, dict[str, Any]], model_bytes: int) -> None:
    """Per row: best and median group wall, and the byte accounting of its first run."""
    for doc in rows.values():
        runs = doc.get("runs", [])
        if not runs:
            continue
        walls = [max(r["seconds"] for r in run["ranks"]) for run in runs]
        doc["slowest_rank_seconds_best"] = min(walls)
        doc["slowest_rank_seconds_median"] = statistics.median(walls)
        doc["gbps_node_best"] = model_bytes / min(walls) / 1e9
        first = runs[0]["ranks"]
        per_rank = []
        for r in first:
            entry: dict[str, Any] = {
                "rank": r["rank"],
                "bytes_delivered": r["bytes_delivered"],
                "rchar": r["rchar"],
            }
            if "bytes_read" in r:
                header = r["bytes_by_split"].get("header", {}).get("read", 0)
                entry.update(
                    bytes_read=r["bytes_read"],
                    bytes_needed=r["bytes_to_read"],
                    bytes_received=r["bytes_received"],
                    header_bytes_read=header,
                    # tensor bytes: what it read less the 141 safetensors headers (reported apart:
                    # ~0 at the seed's size, a few % of a tiny model)
                    tensor_bytes_read=r["bytes_read"] - header,
                    read_over_needed=(r["bytes_read"] - header) / r["bytes_to_read"]
                    if r["bytes_to_read"]
                    else 0.0,
                    within_needed_plus_5pct=r["bytes_read"] - header <= r["bytes_to_read"] * 1.05,
                    bytes_by_split=r["bytes_by_split"],
                )
            per_rank.append(entry)
        doc["per_rank"] = per_rank
        if any("distributed" in r for r in first):
            doc["distributed"] = all(r.get("distributed") for r in first)
        if all("bytes_read" in e for e in per_rank):
            node = sum(e["bytes_read"] for e in per_rank)
            doc["node_bytes_read"] = node
            doc["node_over_model"] = node / model_bytes
            doc["max_rank_over_model"] = max(e["bytes_read"] for e in per_rank) / model_bytes
        else:
            doc["node_rchar"] = sum(e["rchar"] for e in per_rank)
            doc["node_rchar_over_model"] = doc["node_rchar"] / model_bytes


def timeline_spans(events: Path, env: dict[str, str]) -> dict[str, Any]:
    """p50/p95 of t4−t3 and t5−t3 per state, from ``modelpack timeline --json``."""
    _, doc = modelpack_cli("timeline", str(events), "--json", env=env)
    out: dict[str, Any] = {"starts": doc.get("starts")}
    for state, body in (doc.get("states") or {}).items():
        spans = body.get("spans", {})
        out[state] = {
            span: {
                "count": spans[span]["count"],
                "p50_ms": spans[span]["p50Ms"],
                "p95_ms": spans[span]["p95Ms"],
            }
            for span in ("t4-t3", "t5-t3")
            if span in spans
        }
    return out


def markdown(result: dict[str, Any]) -> str:
    lines = [
        "| layout | row | slowest rank best / median | node GB/s | max rank read ÷ model | node read ÷ model | ranks reading ≤ needed + 5 % |",
        "|---|---|---|---|---|---|---|",
    ]
    mb = result["model_bytes"]
    for layout, rows in result["loads"].items():
        for row, doc in rows.items():
            if doc.get("skipped"):
                lines.append(f"| {layout} | {row} | skipped: {doc['skipped'][:90]} | | | | |")
                continue
            best, med = doc["slowest_rank_seconds_best"], doc["slowest_rank_seconds_median"]
            if "node_bytes_read" in doc:
                ok = sum(1 for e in doc["per_rank"] if e["within_needed_plus_5pct"])
                reads = f"{doc['max_rank_over_model']:.3f} | {doc['node_over_model']:.3f} | {ok}/{WORLD}"
            else:
                reads = f"(rchar) {max(e['rchar'] for e in doc['per_rank']) / mb:.3f} | (rchar) {doc['node_rchar_over_model']:.3f} | –"
            lines.append(f"| {layout} | {row} | {best:.2f} / {med:.2f} s | {mb / best / 1e9:.3f} | {reads} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from modelpack.cli import parse_size

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--size", default="512MiB", help="checkpoint size (default 512MiB: a few minutes on 2 cores)"
    )
    ap.add_argument("--layers", type=int, default=4, help="decoder layers (the first quarter, ≤ 3, dense)")
    ap.add_argument("--shards", type=int, default=141, help="safetensors files (default 141, the seed's)")
    ap.add_argument(
        "--block",
        type=int,
        default=0,
        help="FP8 block size (default: 128, smaller only where 128 would not fit --size)",
    )
    ap.add_argument("--repeat", type=int, default=2, help="round-robin rounds of every row (default 2)")
    ap.add_argument("--tiny", action="store_true", help="the structure at a few MiB, one round: a smoke test")
    ap.add_argument("--rows", default=",".join(ROWS), help="comma-separated rows to run (default: all)")
    ap.add_argument(
        "--layouts", default=",".join(LAYOUTS), help="comma-separated layouts (default tp8,tp8_ep8)"
    )
    ap.add_argument(
        "--workdir", default=None, help="where the checkpoint, registry and cache live (a temp dir)"
    )
    ap.add_argument(
        "--json-out", default=None, help="result JSON (default $OUT/seed_shape.json or ./seed_shape.json)"
    )
    ap.add_argument("--timeout", type=float, default=900, help="seconds one group load may take")
    args = ap.parse_args(argv)
    if args.tiny:
        args.size, args.layers, args.repeat = "4MiB", 2, 1
    args.size_bytes = parse_size(str(args.size))
    args.rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    args.layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    bad = [r for r in args.rows if r not in ROWS] + [x for x in args.layouts if x not in LAYOUTS]
    if bad:
        ap.error(f"unknown rows/layouts {bad}: rows are {', '.join(ROWS)}; layouts {', '.join(LAYOUTS)}")
    if min(args.layers, args.shards, args.repeat) < 1 or args.block < 0:
        ap.error("--layers, --shards and --repeat must be positive")
    if args.json_out is None:
        out = os.environ.get("OUT")
        args.json_out = os.path.join(out, "seed_shape.json") if out else "seed_shape.json"
    return args


def main(argv: list[str] | None = None) -> int:
    import signal

    args = parse_args(argv)
    # a SIGTERM unwinds like Ctrl-C: the registry is stopped and the work directory removed
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t_start = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="mp-seed-", dir=args.workdir))
    try:
        return run(args, work, t_start)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(args: argparse.Namespace, work: Path, t_start: float) -> int:
    import torch
    from modelpack.signing.keys import generate_key

    from modelpack import api
    from tests.fixtures.registry import start_registry

    result: dict[str, Any] = {
        "command": " ".join(["benchmarks/seed_shape.py", *sys.argv[1:]]),
        "host": {
            "cores": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "load_average_start": os.getloadavg(),
        },
        "passed": False,
    }

    def write_json() -> None:
        result["seconds_total"] = round(time.perf_counter() - t_start, 2)
        os.makedirs(os.path.dirname(os.path.abspath(args.json_out)), exist_ok=True)
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")

    env = {
        **os.environ,
        "CI": "1",
        "PYTHONPATH": str(ROOT),
        "MODELPACK_UPLOAD_STATE_DIR": str(work / "upload"),
    }
    stages: dict[str, float] = {}
    result["stages_seconds"] = stages
    t = time.perf_counter()
    ckpt = work / "checkpoint"
    cfg = write_seed_checkpoint(ckpt, args.size_bytes, args.layers, args.shards, args.block or None)
    stages["generate"] = time.perf_counter() - t
    model_bytes = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    result["model"] = {
        "files": len(list(ckpt.glob("*.safetensors"))),
        "tensors": cfg["tensors"],
        "hidden_size": cfg["hidden_size"],
        "moe_intermediate_size": cfg["moe_intermediate_size"],
        "layers": cfg["num_hidden_layers"],
        "dense_layers": cfg["first_k_dense_replace"],
        "routed_experts": EXPERTS,
        "shared_experts": SHARED,
        "weight_block_size": cfg["_block"],
    }
    result["model_bytes"] = model_bytes
    print(
        f"seed-shaped checkpoint: {model_bytes / 2**20:.1f} MiB in {result['model']['files']} shards, "
        f"{cfg['tensors']} tensors (H {cfg['hidden_size']}, expert I {cfg['moe_intermediate_size']}, "
        f"{cfg['num_hidden_layers']} layers, {EXPERTS}+{SHARED} experts, FP8 block {cfg['_block']}); "
        f"generated in {stages['generate']:.1f} s",
        flush=True,
    )

    registry = start_registry(work / "registry")
    try:
        key = generate_key()
        pub = work / "key.pub"
        pub.write_bytes(key.public.pem)
        t = time.perf_counter()
        layout = work / "layout"
        packed = api.pack(str(ckpt), f"oci:{layout}:v1")
        stages["pack"] = time.perf_counter() - t
        digest = str(packed.artifact.digest)
        t = time.perf_counter()
        api.push(f"oci:{layout}:v1", registry.ref("seed/moe", "v1"), sign_key=key, progress="off")
        stages["push (signed)"] = time.perf_counter() - t
        reference = f"{registry.host}/seed/moe@{digest}"
        cache = work / "cache"
        secs, pulled = modelpack_cli(
            "pull", reference, "--cache", str(cache), "--key", str(pub), "--json", env=env
        )
        stages["pull --cache"] = secs
        secs, again = modelpack_cli(
            "pull", reference, "--cache", str(cache), "--key", str(pub), "--json", env=env
        )
        stages["pull --cache (hit)"] = secs
        snapshot = str(pulled.get("path") or pulled.get("snapshot") or again.get("path"))
        result["pull"] = {k: pulled.get(k) for k in ("state", "bytesDownloaded", "path") if k in pulled}
        result["pull_again"] = {k: again.get(k) for k in ("state", "bytesDownloaded") if k in again}
        for name, s in stages.items():
            print(f"{name:<20} {s:7.2f} s", flush=True)
        files = sorted(str(p) for p in Path(snapshot).glob("*.safetensors"))
        if len(files) != result["model"]["files"]:
            raise SystemExit(
                f"snapshot {snapshot} holds {len(files)} weight files, expected {result['model']['files']}"
            )
        events = work / "events.jsonl"
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(
            ["torch", "torch.distributed", "safetensors", "modelpack.loader", "benchmarks.seed_shape"]
        )
        base = {
            "files": files,
            "reference": reference,
            "snapshot": snapshot,
            "digest_ref": digest,
            "public_key": str(pub),
            "events": str(events),
            "env": {
                "RUNAI_STREAMER_DIST": "1",
                "RUNAI_STREAMER_CONCURRENCY": str(RUNAI_CONCURRENCY),
                "RUNAI_STREAMER_LOG_LEVEL": "ERROR",
                "OMP_NUM_THREADS": "1",
            },
        }
        loads: dict[str, dict[str, dict[str, Any]]] = {x: {} for x in args.layouts}
        result["loads"] = loads
        skipped = {row: why for row in args.rows if (why := peer_available(row))}
        for layout_name in args.layouts:
            for row in args.rows:
                loads[layout_name][row] = {"skipped": skipped[row]} if row in skipped else {"runs": []}
        for rnd in range(args.repeat):
            for layout_name in args.layouts:
                tp, ep = LAYOUTS[layout_name]
                for row in args.rows:
                    doc = loads[layout_name][row]
                    if doc.get("skipped"):
                        continue
                    spec = {
                        **base,
                        "row": row,
                        "layout": layout_name,
                        "tp": tp,
                        "ep": ep,
                        "start_id": f"{layout_name}/{row}/{rnd}/{uuid.uuid4().hex[:8]}",
                        "digest": rnd == 0,
                    }
                    la = os.getloadavg()[0]
                    try:
                        run_doc = run_group(ctx, spec, args.timeout)
                    except (RuntimeError, TimeoutError) as exc:
                        if row.startswith("modelpack") or row == "safetensors":
                            raise
                        doc.clear()
                        doc["skipped"] = f"failed here: {str(exc).splitlines()[0][:300]}"
                        print(f"{layout_name:<8} {row:<28} skipped: {doc['skipped']}", flush=True)
                        continue
                    run_doc["load_average"] = la
                    doc["runs"].append(run_doc)
                    slow = max(r["seconds"] for r in run_doc["ranks"])
                    print(
                        f"{layout_name:<8} {row:<28} round {rnd + 1}: slowest rank {slow:6.2f} s "
                        f"(load {la:.1f})",
                        flush=True,
                    )
        # correctness: every rank of every row equals the safetensors row's rank
        mismatches = []
        for layout_name, rows in loads.items():
            ref = rows.get("safetensors", {}).get("runs")
            if not ref:
                continue
            want = [r["digest"] for r in ref[0]["ranks"]]
            for row, doc in rows.items():
                for r in (doc.get("runs") or [{}])[0].get("ranks", []):
                    if r.get("digest") != want[r["rank"]]:
                        mismatches.append(f"{layout_name} {row} rank {r['rank']}")
            rows["safetensors"]["reference"] = True
        result["correctness"] = {
            "passed": not mismatches,
            "mismatches": mismatches,
            "compared_with": "safetensors safe_open+get_slice, share cut by this script",
        }
        for rows in loads.values():
            summarize(rows, model_bytes)
        result["timeline"] = timeline_spans(events, env)
        result["passed"] = not mismatches
    finally:
        registry.stop()
    table = markdown(result)
    result["table_markdown"] = table
    print()
    print(table)
    spans = result.get("timeline", {})
    print()
    for state, body in spans.items():
        if isinstance(body, dict):
            cells = "; ".join(
                f"{k} p50 {v['p50_ms']} ms / p95 {v['p95_ms']} ms (n={v['count']})" for k, v in body.items()
            )
            print(f"timeline {state}: {cells}")
    if mismatches:
        print("MISMATCH: " + ", ".join(mismatches[:10]), file=sys.stderr)
    write_json()
    print(f"wrote {args.json_out} ({time.perf_counter() - t_start:.0f} s in all)")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
