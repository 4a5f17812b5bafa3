"""Bytes a standalone rank reads under a signed chunk table, as a fraction of the model.

Two generated checkpoints, packed into an OCI layout and chunk-signed:

- ``bar``: a Llama-shaped model of a few large 2-D tensors (q/k/v/gate/up split along dim 0,
  o/down along dim 1), loaded as TP rank 0 of 2;
- ``moe``: a DeepSeek-shaped model (16 routed experts per layer, shared experts, router), loaded
  as EP rank 0 of 8.

For each, the table is built three ways: fixed-size chunks (``--chunk-size``, the published v1
form), tensor-aligned chunks without column blocks (``aligned-rows``: what aligned tables were
before them) and as ``modelpack sign`` writes it (``aligned=True``, with column blocks). Prints one JSON line per case: bytes read by the
rank, what it needs (``bytesToRead``), the model's tensor bytes and the ratios.

    .venv/bin/python benchmarks/share_reads.py [--chunk-size 4194304]
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from modelpack.loader import LoadStats, load_state_dict
from modelpack.signing.chunks import DEFAULT_CHUNK_SIZE, compute_chunk_table

from modelpack.testdata.synthetic import SyntheticSpec, write_checkpoint
from tests.loader_helpers import pack_layout
from tests.moe_checkpoints import write_moe


def _case(lay: Any, table: Any, **rank: int) -> dict[str, Any]:
    stats = LoadStats()
    load_state_dict(lay.ref, chunk_table=table, stats=stats, **rank)
    assert stats.plan is not None
    model = stats.plan.total_bytes
    return {
        **rank,
        "bytesRead": stats.bytes_read,
        "bytesToRead": stats.bytes_to_read,
        "modelBytes": model,
        "readOverModel": round(stats.bytes_read / model, 3),
        "readOverNeeded": round(stats.bytes_read / max(1, stats.bytes_to_read), 3),
    }


def seed_table_size(chunk_size: int, shards: int = 141, layers: int = 72) -> dict[str, Any]:
    """The signed predicate's size for a GLM-shaped FP8 model of ``shards`` files (~700 GB):
    256 routed + 1 shared expert per layer (2048×6144 F8 projections, F32 128×128 block scales),
    BF16 attention and embeddings; headers only, no bytes hashed."""
    from modelpack.signing.chunk_bounds import aligned_starts, column_blocks, fixed_starts, runs_of

    from modelpack.packing.safetensors_format import SafetensorsHeader, TensorInfo

    hidden, inter, experts, vocab = 6144, 2048, 256, 151552
    tensors: list[tuple[str, str, tuple[int, ...], int]] = []  # name, dtype, shape, bytes/elem

    def proj(name: str, out: int, inp: int) -> None:
        tensors.append((name + ".weight", "F8_E4M3", (out, inp), 1))
        tensors.append((name + ".weight_scale_inv", "F32", (-(-out // 128), -(-inp // 128)), 4))

    tensors.append(("model.embed_tokens.weight", "BF16", (vocab, hidden), 2))
    for i in range(layers):
        p = f"model.layers.{i}."
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            proj(p + "self_attn." + n, hidden, hidden)
        tensors.append((p + "input_layernorm.weight", "BF16", (hidden,), 2))
        tensors.append((p + "mlp.gate.weight", "BF16", (experts, hidden), 2))
        for e in [*(f"experts.{k}" for k in range(experts)), "shared_experts"]:
            proj(p + f"mlp.{e}.gate_proj", inter, hidden)
            proj(p + f"mlp.{e}.up_proj", inter, hidden)
            proj(p + f"mlp.{e}.down_proj", hidden, inter)
    tensors.append(("lm_head.weight", "BF16", (vocab, hidden), 2))
    total = sum(math.prod(shape) * es for _, _, shape, es in tensors)
    per_shard = -(-total // shards)
    files: list[list[TensorInfo]] = [[]]
    pos = 0
    for name, dtype, shape, es in tensors:
        n = math.prod(shape) * es
        if pos and pos + n > per_shard:
            files.append([])
            pos = 0
        files[-1].append(TensorInfo(name, dtype, shape, pos, pos + n))
        pos += n
    fixed = aligned = columns = 0
    fixed_json = aligned_json = 0
    for infos in files:
        hdr_len = 100 * len(infos)  # ~100 header bytes per tensor
        hdr = SafetensorsHeader("x", hdr_len, 0, tuple(infos))
        size = hdr.data_start + infos[-1].end
        digest = ["0" * 64]
        f = fixed_starts(size, chunk_size)
        a = aligned_starts(hdr, size, chunk_size)
        c = column_blocks(hdr, size, chunk_size)
        blocks = sum(k for *_, k in c)
        fixed += len(f)
        aligned += len(a)
        columns += blocks
        fixed_json += len(json.dumps({"size": size, "chunks": digest * len(f)}))
        entry = {"size": size, "chunks": digest * len(a), "runs": runs_of(a, size)}
        aligned_json += len(
            json.dumps({**entry, "columns": [list(x) for x in c], "columnChunks": digest * blocks})
        )
    return {
        "model": "glm-shaped",
        "files": len(files),
        "modelBytes": total,
        "fixedChunks": fixed,
        "fixedPredicateBytes": fixed_json,
        "alignedChunks": aligned,
        "alignedColumnBlocks": columns,
        "alignedPredicateBytes": aligned_json,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK_SIZE)
    args = ap.parse_args()
    print(json.dumps(seed_table_size(args.chunk_size)))
    aligned_ok = "aligned" in inspect.signature(compute_chunk_table).parameters
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        bar = SyntheticSpec(hidden=2048, intermediate=5504, layers=2, heads=16, kv_heads=8, vocab=4096)
        write_checkpoint(str(root / "bar"), bar)
        write_moe(root / "moe", "deepseek", experts=16, layers=2, hidden=768, inter=1536, vocab=4096)
        cases = {"bar": {"tp_size": 2, "tp_rank": 0}, "moe": {"ep_size": 8, "ep_rank": 0}}
        for name, rank in cases.items():
            lay = pack_layout(root / name, root / f"{name}-layout")
            for form in ("fixed", "aligned-rows", "aligned") if aligned_ok else ("fixed",):
                kw: dict[str, Any] = {"aligned": True} if form.startswith("aligned") else {}
                table = compute_chunk_table(lay.target, lay.manifest, args.chunk_size, **kw)
                if form == "aligned-rows":  # the aligned table without its column blocks
                    layers = {k: dataclasses.replace(v, columns=()) for k, v in table.layers.items()}
                    table = dataclasses.replace(table, layers=layers)
                row = _case(lay, table, **rank)
                chunks = sum(len(x.digests) for x in table.layers.values())
                print(json.dumps({"model": name, "table": form, "chunks": chunks, **row}))


if __name__ == "__main__":
    main()
