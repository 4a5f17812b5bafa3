"""Expert parallelism across nodes: a gloo group of 4 EP ranks on 2 "nodes" (``LOCAL_WORLD_SIZE``
2, as torchrun sets it): each node reads only the experts its ranks hold and its part of the
replicated tensors (≤ 0.55× the model), and every rank reports what its node read, in
``LoadStats`` and the ``loader.read_done`` event. Real processes, real gloo over loopback."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.loader_helpers import pack_layout, run_gloo_ranks
from tests.moe_checkpoints import write_moe

CHUNK = 256 * 1024
EP, E, LOCAL = 4, 8, 2

RANK = r"""
import json, os, sys
import torch, torch.distributed as dist
from modelpack.loader import LoaderOptions, LoadStats, load_state_dict
from modelpack.signing.chunks import ChunkTable
from modelpack import api
from modelpack.targets.layout import OCILayoutTarget
from tests.loader_helpers import reference_tensors
from tests.moe_checkpoints import expert_of, linear_experts

ckpt, layout, digest, table_path, events = sys.argv[1:6]
dist.init_process_group("gloo", init_method=os.environ["INIT"], rank=int(os.environ["RANK"]),
                        world_size=int(os.environ["WORLD"]))
rank, world = dist.get_rank(), dist.get_world_size()
manifest, _ = api.fetch_manifest(OCILayoutTarget(layout), digest)
table = ChunkTable.from_predicate(json.load(open(table_path)), manifest)
stats = LoadStats()
try:
    sd = load_state_dict(f"oci:{layout}@{digest}", ep_size=world, ep_rank=rank, chunk_table=table,
                         options=LoaderOptions(group=dist.group.WORLD), stats=stats, events=events)
except Exception as exc:
    print("RESULT " + json.dumps({"rank": rank, "error": type(exc).__name__, "message": str(exc)}), flush=True)
    os._exit(0)  # the group failed: no orderly teardown (gloo may abort with work pending)
ref = reference_tensors(ckpt)
mine = linear_experts(int(os.environ["EXPERTS"]), world, rank)
bad = [n for n, t in ref.items() if (expert_of(n) is None or expert_of(n) in mine) != (n in sd)
       or (n in sd and not torch.equal(sd[n], t))]
print("RESULT " + json.dumps({"rank": rank, "bad": bad, "read": stats.bytes_read, "node": stats.node,
      "nodeBytes": stats.node_bytes_read, "byNode": stats.bytes_read_by_node,
      "expertBytes": stats.bytes_by_split["expert"]["planned"]}), flush=True)
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from modelpack.signing.chunks import compute_chunk_table

    root = tmp_path_factory.mktemp("moenodes")
    ckpt = write_moe(root / "ckpt", "deepseek", experts=E, hidden=256, inter=512)
    lay = pack_layout(ckpt, root / "layout")
    table = compute_chunk_table(lay.target, lay.manifest, CHUNK, aligned=True)
    (root / "table.json").write_text(json.dumps(table.to_predicate()))
    files = sorted(ckpt.glob("*.safetensors"))
    return {
        "ckpt": ckpt,
        "layout": lay.path,
        "digest": lay.digest,
        "table": root / "table.json",
        "files": sum(f.stat().st_size for f in files),
        "root": root,
    }


def _run(model: dict[str, Any], tmp: Path) -> list[dict[str, Any]]:
    common = [str(model[k]) for k in ("ckpt", "layout", "digest", "table")]
    return run_gloo_ranks(
        RANK,
        EP,
        lambda r: [*common, str(tmp / f"ev{r}.jsonl")],
        env={"LOCAL_WORLD_SIZE": str(LOCAL), "EXPERTS": str(E)},
    )


def test_over_nodes_a_shared_chunk_is_read_on_a_node_that_needs_it() -> None:
    """Chunks 10..29 are needed by ranks 2 and 3 (node 1) only: none of them is read on node 0,
    whatever the balanced runs say; the chunks every rank needs stay spread over all ranks."""
    from modelpack.loader.shared_read import chunk_owners

    everyone = set(range(30, 70))
    needs = [everyone | {0}, everyone | {1}, everyone | set(range(10, 30)), everyone | set(range(10, 30))]
    nodes = [0, 0, 1, 1]
    owner, shared = chunk_owners(needs, local=set(), nodes=nodes)
    assert shared == list(range(10, 70))
    assert all(nodes[owner[c]] == 1 for c in range(10, 30)), {c: owner[c] for c in range(10, 30)}
    assert {nodes[owner[c]] for c in everyone} == {0, 1}
    # one node: the balanced runs as before (rank 0 reads some of node 1's chunks)
    owner1, _ = chunk_owners(needs, local=set())
    assert any(owner1[c] in (0, 1) for c in range(10, 30))


def test_each_node_reads_only_its_ranks_experts_and_reports_its_bytes(
    model: dict[str, Any], tmp_path: Path
) -> None:
    results = _run(model, tmp_path)
    files = model["files"]
    by_node = [sum(r["read"] for r in results if r["rank"] // LOCAL == n) for n in range(EP // LOCAL)]
    for r in results:
        assert r["bad"] == [], (r["rank"], r["bad"][:5])
        assert r["node"] == r["rank"] // LOCAL
        assert r["byNode"] == by_node and r["nodeBytes"] == by_node[r["node"]]
        done = [
            json.loads(x)
            for x in (tmp_path / f"ev{r['rank']}.jsonl").read_text().splitlines()
            if '"loader.read_done"' in x
        ]
        assert done[0]["node"] == r["node"] and done[0]["nodes"] == EP // LOCAL
        assert done[0]["node_bytes"] == by_node[r["node"]] and done[0]["bytes_by_node"] == by_node
    for n, got in enumerate(by_node):
        # half the experts and about half the replicated tensors: at most 0.55× the model
        assert got <= 0.55 * files, (n, got, files)
    assert sum(by_node) <= 1.05 * files


def test_ranks_that_disagree_on_the_ranks_per_node_refuse_on_every_rank_before_reading(
    model: dict[str, Any], tmp_path: Path
) -> None:
    """A launcher that gives one rank another LOCAL_WORLD_SIZE would make the ranks assign the
    shared chunks to different owners (and broadcast from different roots): every rank refuses."""
    common = [str(model[k]) for k in ("ckpt", "layout", "digest", "table")]
    results = run_gloo_ranks(
        RANK,
        EP,
        lambda r: [*common, str(tmp_path / f"ev{r}.jsonl")],
        env={"EXPERTS": str(E)},
        rank_env=lambda r: {"LOCAL_WORLD_SIZE": "1" if r == 3 else str(LOCAL)},
    )
    for r in results:
        assert r.get("error") == "LoaderError" and "plan" in r["message"], r
