"""Each byte once per node: TP ranks in a gloo group share chunk-verified reads.

Real processes: one per rank, a real gloo group over loopback TCP, an OCI layout read by range with
a chunk table. Every rank checks its tensors against ``safetensors``' own load of the checkpoint
(sliced like ``torch.chunk``) and reports the bytes its reader fetched and the bytes it received
from its peers. Goals: per rank ≤ 1/TP of the weight files + 5 % (+ one chunk per tensor and a
header chunk), node total ≤ 1.05 × the files (+ the header chunks, each read by one rank).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from modelpack.testdata.synthetic import SyntheticSpec, write_checkpoint
from tests.fixtures.loopback import free_port
from tests.loader_helpers import pack_layout, run_gloo_ranks
from tests.paths import REPO_ROOT

pytestmark = pytest.mark.host_copier  # the ranks run in child processes; they pick their copier themselves

CHUNK = 64 * 1024
SPEC = SyntheticSpec(
    hidden=1024, intermediate=2816, layers=2, heads=8, kv_heads=8, vocab=4096, shards=2, seed=3
)

RANK = r"""
import hashlib, json, os, sys
import torch, torch.distributed as dist
from modelpack.loader import LoaderOptions, LoadStats, load_state_dict
from modelpack.signing.chunks import ChunkTable
from modelpack import api
from modelpack.targets.layout import OCILayoutTarget
from tests.loader_helpers import expected_shard, reference_tensors

ckpt, layout, digest, table_path, mode, copier = sys.argv[1:7]
layout = os.environ.get("LAYOUT") or layout  # a rank may be given its own copy (a corrupted one)
dist.init_process_group("gloo", init_method=os.environ["INIT"], rank=int(os.environ["RANK"]),
                        world_size=int(os.environ["WORLD"]))
rank, world = dist.get_rank(), dist.get_world_size()
dev = None
if copier == "standin":
    from tests.fixtures.device import install_standin
    dev = install_standin(seed=rank)
from tests.fixtures.device import device_problems
manifest, _ = api.fetch_manifest(OCILayoutTarget(layout), digest)
table = ChunkTable.from_predicate(json.load(open(table_path)), manifest)
stats = LoadStats()
opts = LoaderOptions(group=dist.group.WORLD if mode in ("group", "stall") else None)
if mode == "stall" and rank == 1:  # alive, but never takes part again (a hung or stopped rank)
    import signal
    os.kill(os.getpid(), signal.SIGSTOP)
try:
    sd = load_state_dict(f"oci:{layout}@{digest}", tp_size=world, tp_rank=rank, chunk_table=table,
                         options=opts, stats=stats)
except Exception as exc:
    print("RESULT " + json.dumps({"rank": rank, "error": type(exc).__name__, "message": str(exc),
                                  "device": device_problems(dev)}), flush=True)
    # the group failed: its process group cannot be torn down in order (the other rank may be gone),
    # and gloo's destructor at interpreter exit may abort with work pending; the result is out
    os._exit(0)
ref = reference_tensors(ckpt)
rules = {t.name: t.rule for t in stats.plan.tensors}
bad = [n for n in ref if n not in sd or not torch.equal(sd[n], expected_shard(ref[n], rules[n], world, rank))]
print("RESULT " + json.dumps({"rank": rank, "bad": bad, "read": stats.bytes_read, "received": stats.bytes_received,
                              "tensors": len(ref), "by_split": stats.bytes_by_split,
                              "device": device_problems(dev)}), flush=True)
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from modelpack.signing.chunks import compute_chunk_table

    root = tmp_path_factory.mktemp("group")
    ckpt = root / "ckpt"
    write_checkpoint(str(ckpt), SPEC)
    lay = pack_layout(ckpt, root / "layout")
    table = compute_chunk_table(lay.target, lay.manifest, CHUNK)
    (root / "table.json").write_text(json.dumps(table.to_predicate()))
    files = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    return {
        "ckpt": ckpt,
        "layout": lay.path,
        "digest": lay.digest,
        "table": root / "table.json",
        "files": files,
    }


def _run_ranks(
    model: dict[str, Any],
    world: int,
    mode: str,
    layouts: dict[int, Path] | None = None,
    copier: str = "host",
) -> list[dict[str, Any]]:
    """Every rank's RESULT; ``copier``: "standin" runs each rank through the stand-in device
    (``device`` in a result: what it caught, [] when clean)."""
    args = [str(model[k]) for k in ("ckpt", "layout", "digest", "table")] + [mode, copier]
    return run_gloo_ranks(
        RANK, world, lambda r: args, rank_env=lambda r: {"LAYOUT": str((layouts or {}).get(r, ""))}
    )


def test_a_rank_that_stops_but_stays_alive_fails_the_group_within_its_progress_deadline(
    model: dict[str, Any],
) -> None:
    """A rank killed, refusing or exiting fails the others at once; one that stops but stays
    alive (SIGSTOP, a hang) left them in gloo's collective for its 30-minute default. The group
    has a progress deadline of its own (``MODELPACK_GROUP_PROGRESS_TIMEOUT``, here 3 s) and the
    error names the rank waited for."""
    init = f"tcp://127.0.0.1:{free_port()}"
    args = [str(model[k]) for k in ("ckpt", "layout", "digest", "table")] + ["stall", "host"]
    procs = []
    for r in range(2):
        env = dict(
            os.environ,
            INIT=init,
            RANK=str(r),
            WORLD="2",
            OMP_NUM_THREADS="1",
            LAYOUT="",
            MODELPACK_GROUP_PROGRESS_TIMEOUT="3s",
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", RANK, *args],
                env=env,
                cwd=str(REPO_ROOT),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    try:
        out, err = procs[0].communicate(timeout=90)
    finally:
        procs[1].kill()
        procs[1].communicate()
    line = next((x for x in out.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, err[-4000:]
    doc = json.loads(line[len("RESULT ") :])
    assert doc["error"] == "GroupStalledError", doc
    assert "rank 1" in doc["message"] and "3 s" in doc["message"], doc


@pytest.mark.parametrize(("world", "rank_copier"), [(2, "host"), (2, "standin"), (8, "standin")])
def test_ranks_of_a_group_read_each_byte_once_and_equal_safetensors(
    model: dict[str, Any], world: int, rank_copier: str
) -> None:
    """Every rank equals safetensors, reads ≤ 1/TP of the files (+ slack) and receives the rest;
    through the stand-in device the shared chunks cross the group in device memory, on the
    current stream, and no slot is reused or tensor handed out before its copy completed."""
    results = _run_ranks(model, world, "group", copier=rank_copier)
    files = model["files"]
    headers = 2 * CHUNK  # the header chunk of each of the 2 files, read by every rank to plan
    for r in results:
        assert "error" not in r and r["device"] == [], results
        assert r["bad"] == [], f"rank {r['rank']}: tensors differ from safetensors: {r['bad'][:5]}"
        slack = r["tensors"] * CHUNK + headers
        assert r["read"] <= files / world * 1.05 + slack, (r["rank"], r["read"], files / world)
        assert r["received"] > 0
    node = sum(r["read"] for r in results)
    assert node <= files * 1.05 + headers, (node, files)  # header chunks too: read by one rank each


def test_without_a_group_each_rank_reads_its_column_split_and_replicated_tensors_whole(
    model: dict[str, Any],
) -> None:
    results = _run_ranks(model, 2, "alone")
    for r in results:
        assert r["bad"] == [] and r["received"] == 0
        dim1 = r["by_split"]["dim1"]
        assert dim1["read"] >= dim1["tensorBytes"]  # every rank fetched them whole: what the group saves


@pytest.mark.parametrize("rank_copier", ["host", "standin"])
def test_a_rank_whose_shared_chunks_fail_verification_fails_every_rank_instead_of_hanging(
    model: dict[str, Any], tmp_path: Path, rank_copier: str
) -> None:
    """Rank 1 reads a copy of the layout whose column-split tensors were edited: its own check of
    the chunks it owns fails, it broadcasts the failure, and rank 0 raises too (no rank waits).
    Through the stand-in device neither rank leaks a pinned slot or leaves a copy pending."""
    import shutil

    from modelpack.packing.safetensors_format import read_header
    from modelpack.targets.layout import OCILayoutTarget
    from tests.loader_helpers import corrupt

    bad = tmp_path / "bad-layout"
    shutil.copytree(model["layout"], bad)
    from modelpack import api

    manifest, _ = api.fetch_manifest(OCILayoutTarget(str(bad)), model["digest"])
    for layer in manifest.layers:
        rel = (layer.annotations or {}).get("org.cncf.model.filepath", "")
        if not rel.endswith(".safetensors"):
            continue
        blob = Path(OCILayoutTarget(str(bad)).blob_path(layer.digest))
        hdr = read_header(str(blob))
        for t in hdr.tensors:
            if t.name.endswith(("o_proj.weight", "down_proj.weight")):
                corrupt(blob, hdr.absolute(t)[1] - 1)  # the last byte of every column-split tensor
    results = _run_ranks(model, 2, "group", layouts={1: bad}, copier=rank_copier)
    by_rank = {r["rank"]: r for r in results}
    assert [r["device"] for r in results] == [[], []], results
    assert by_rank[1]["error"] == "ChunkDigestMismatch", by_rank[1]
    assert by_rank[0]["error"] == "LoaderError" and "rank 1 failed" in by_rank[0]["message"], by_rank[0]
