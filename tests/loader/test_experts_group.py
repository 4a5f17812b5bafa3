"""Expert-parallel reads over chunk-verified range reads: a standalone EP rank fetches only the
chunks of its experts and the replicated tensors; EP ranks in a gloo group read each needed byte
once per node and share the rest. Real processes, a real gloo group over loopback TCP."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from modelpack.loader import LoadStats, load_state_dict

from tests.loader_helpers import pack_layout, reference_tensors, run_gloo_ranks
from tests.moe_checkpoints import expert_of, linear_experts, write_moe

CHUNK = 64 * 1024
EP = 4
E = 8

RANK = r"""
import json, os, sys
import torch, torch.distributed as dist
from modelpack.loader import LoaderOptions, LoadStats, load_state_dict
from modelpack.signing.chunks import ChunkTable
from modelpack import api
from modelpack.targets.layout import OCILayoutTarget
from tests.loader_helpers import reference_tensors
from tests.moe_checkpoints import expert_of, is_stacked, linear_experts

ckpt, layout, digest, table_path, tp, copier = sys.argv[1:7]
tp = int(tp)
dist.init_process_group("gloo", init_method=os.environ["INIT"], rank=int(os.environ["RANK"]),
                        world_size=int(os.environ["WORLD"]))
rank, world = dist.get_rank(), dist.get_world_size()
from tests.fixtures.device import device_problems, install_standin
dev = install_standin(seed=rank) if copier == "standin" else None
manifest, _ = api.fetch_manifest(OCILayoutTarget(layout), digest)
table = ChunkTable.from_predicate(json.load(open(table_path)), manifest)
stats = LoadStats()
sd = load_state_dict(f"oci:{layout}@{digest}", tp_size=tp, tp_rank=rank % tp, ep_size=world, ep_rank=rank,
                     chunk_table=table, options=LoaderOptions(group=dist.group.WORLD), stats=stats)
ref = reference_tensors(ckpt)
mine = linear_experts(int(os.environ["EXPERTS"]), world, rank)
bad = []
for name, full in ref.items():
    e = expert_of(name)
    if e is not None:
        want = full if e in mine else None
    elif is_stacked(name):
        want = full[mine[0]:mine[-1] + 1]
    elif tp > 1 and name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight", "up_proj.weight", "embed_tokens.weight", "lm_head.weight")):
        want = full.chunk(tp, 0)[rank % tp]
    elif tp > 1 and name.endswith(("o_proj.weight", "down_proj.weight")):
        want = full.chunk(tp, 1)[rank % tp]
    else:
        want = full
    if (want is None) != (name not in sd) or (want is not None and not torch.equal(sd[name], want)):
        bad.append(name)
print("RESULT " + json.dumps({"rank": rank, "bad": bad, "read": stats.bytes_read, "received": stats.bytes_received,
                              "needed": stats.bytes_to_read, "by_split": stats.bytes_by_split,
                              "device": device_problems(dev)}), flush=True)
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from modelpack.signing.chunks import compute_chunk_table

    root = tmp_path_factory.mktemp("moegroup")
    ckpt = write_moe(root / "ckpt", "deepseek", experts=E, hidden=256, inter=512)
    lay = pack_layout(ckpt, root / "layout")
    table = compute_chunk_table(lay.target, lay.manifest, CHUNK)
    (root / "table.json").write_text(json.dumps(table.to_predicate()))
    files = sorted(ckpt.glob("*.safetensors"))
    return {
        "ckpt": ckpt,
        "layout": lay.path,
        "digest": lay.digest,
        "table": root / "table.json",
        "files": sum(f.stat().st_size for f in files),
        "nfiles": len(files),
        "lay": lay,
    }


def test_a_standalone_ep_rank_fetches_only_the_chunks_of_its_experts(model: dict[str, Any]) -> None:
    from modelpack.signing.chunks import ChunkTable

    lay = model["lay"]
    table = ChunkTable.from_predicate(json.loads(Path(model["table"]).read_text()), lay.manifest)
    ref = reference_tensors(model["ckpt"])
    for rank in range(EP):
        mine = linear_experts(E, EP, rank)
        stats = LoadStats()
        sd = load_state_dict(lay.ref, ep_size=EP, ep_rank=rank, chunk_table=table, stats=stats)
        for name, t in sd.items():
            e = expert_of(name)
            assert e is None or e in mine, name
            assert torch.equal(t, ref[name]), name
        share = stats.bytes_by_split["expert"]["planned"]
        replicated = stats.bytes_by_split["replicate"]["planned"]
        assert share + replicated == stats.bytes_to_read
        # whole chunks: each run of wanted bytes may drag in a partial chunk at either end
        slack = model["nfiles"] * 3 * CHUNK
        assert stats.bytes_read <= (share + replicated) * 1.05 + slack, (
            rank,
            stats.bytes_read,
            share,
            replicated,
        )
        assert stats.bytes_read < 0.5 * model["files"]


def _run_ranks(model: dict[str, Any], world: int, tp: int, copier: str) -> list[dict[str, Any]]:
    args = [str(model[k]) for k in ("ckpt", "layout", "digest", "table")] + [str(tp), copier]
    return run_gloo_ranks(RANK, world, lambda r: args, env={"EXPERTS": str(E)})


@pytest.mark.host_copier  # the ranks run in child processes and pick their copier themselves
@pytest.mark.parametrize(("tp", "rank_copier"), [(1, "host"), (2, "standin")])
def test_ep_ranks_of_a_group_read_each_needed_byte_once_per_node(
    model: dict[str, Any], tp: int, rank_copier: str
) -> None:
    """EP=4 (TP=1, or TP=2 inside it): every rank equals safetensors; the node reads the model
    once (≤ 1.05× + header chunks) and no rank reads another rank's experts (TP=2: through the
    stand-in device, which must end clean)."""
    results = _run_ranks(model, EP, tp, rank_copier)
    files = model["files"]
    headers = model["nfiles"] * CHUNK
    for r in results:
        assert r["device"] == [], (r["rank"], r["device"])
        assert r["bad"] == [], (r["rank"], r["bad"][:5])
        expert = r["by_split"]["expert"]
        # its experts' chunks (+ a partial chunk at each end of a run), and its part of the shared reads
        assert expert["read"] <= expert["planned"] * 1.05 + 2 * model["nfiles"] * CHUNK, (r["rank"], expert)
        assert r["read"] <= files / EP * 1.05 + 4 * model["nfiles"] * CHUNK + headers, (r["rank"], r["read"])
    node = sum(r["read"] for r in results)
    assert node <= files * 1.05 + headers, (node, files)
