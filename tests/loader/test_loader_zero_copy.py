"""Zero-copy cache hits: store blobs trusted by inode are handed out as views.

With ``LoaderOptions(views="shard" | "full")`` a node-cache hit on the CPU maps each weight file
that snapshot binding trusts (the store's committed, read-only blob, same inode) and yields
tensors whose storage *is* that mapping: no allocation, no copy, the engine reads the page cache
as vLLM's default loader does. Proven here through ``/proc/self/maps``: every tensor's data
pointer lies inside a mapping of the blob's inode. Files that must be hashed, plain directories
and caller-owned ``out=`` destinations are read as before.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from modelpack.loader import LoaderOptions, LoadStats, iter_tensors, load_state_dict
from modelpack.loader.plan import ShardRule

from modelpack.testdata.synthetic import SyntheticSpec, write_checkpoint
from tests.loader_helpers import expected_shard, pack_layout, reference_tensors

pytestmark = pytest.mark.host_copier  # views of mapped store blobs and straight reads are the CPU load


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("zc-ckpt")
    write_checkpoint(str(d), SyntheticSpec(shards=2, seed=25))
    return d


@pytest.fixture(scope="module")
def ref(ckpt: Path) -> dict[str, torch.Tensor]:
    return reference_tensors(ckpt)


@pytest.fixture
def snapshot(ckpt: Path, tmp_path: Path) -> str:
    from modelpack.mount.cache import NodeCache

    lay = pack_layout(ckpt, tmp_path / "layout")
    return NodeCache(str(tmp_path / "cache")).pull(f"oci:{lay.path}@{lay.digest}").path


def _file_mappings() -> list[tuple[int, int, int]]:
    """(start, end, inode) of every file-backed mapping of this process."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            inode = int(parts[4])
            if inode:
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                out.append((lo, hi, inode))
    return out


def _mapped_inode(t: torch.Tensor, maps: list[tuple[int, int, int]]) -> int | None:
    if t.numel() == 0:
        return None
    p0 = t.data_ptr()
    p1 = p0 + (t.untyped_storage().nbytes() - t.storage_offset() * t.element_size())
    for lo, hi, inode in maps:
        if lo <= p0 and p1 <= hi:
            return inode
    return None


def _blob_inodes(snapshot: str) -> set[int]:
    return {
        os.stat(os.path.join(snapshot, n)).st_ino for n in os.listdir(snapshot) if n.endswith(".safetensors")
    }


def test_a_hit_hands_out_views_of_the_store_blobs_equal_to_safetensors(
    snapshot: str, ref: dict[str, torch.Tensor]
) -> None:
    stats = LoadStats()
    sd = load_state_dict(snapshot, options=LoaderOptions(views="shard"), stats=stats)
    maps = _file_mappings()
    inodes = _blob_inodes(snapshot)
    assert set(sd) == set(ref)
    for name, t in sd.items():
        assert torch.equal(t, ref[name]), name
        if t.numel():
            assert _mapped_inode(t, maps) in inodes, f"{name} is not a view of a store blob"
    assert set(stats.verification.values()) == {"trusted"}
    assert stats.mapped_bytes == sum(t.numel() * t.element_size() for t in ref.values())
    # the headers were read; every tensor byte is attributed to the views that cover it
    assert stats.bytes_read == stats.mapped_bytes + stats.bytes_by_split["header"]["read"]


def test_a_mapped_hit_records_t3_t4_t5(snapshot: str, tmp_path: Path) -> None:
    import json

    log = tmp_path / "events.jsonl"
    load_state_dict(snapshot, options=LoaderOptions(views="full"), events=str(log), start_id="zc")
    names = [json.loads(line)["event"] for line in log.read_text().splitlines()]
    assert [n for n in names if n.startswith("loader.") and n.endswith(("_start", "_done"))] == [
        "loader.read_start",
        "loader.read_done",
        "loader.device_done",
    ]


def test_default_is_fresh_memory(snapshot: str) -> None:
    sd = load_state_dict(snapshot)
    maps = _file_mappings()
    assert all(_mapped_inode(t, maps) is None for t in sd.values() if t.numel())


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_shard_views_and_full_views(snapshot: str, ref: dict[str, torch.Tensor], tp: int) -> None:
    inodes = _blob_inodes(snapshot)
    plan_rules: dict[str, ShardRule] = {}
    for rank in range(tp):
        sd = load_state_dict(
            snapshot,
            tp_size=tp,
            tp_rank=rank,
            options=LoaderOptions(views="shard"),
            on_plan=lambda p: plan_rules.update((t.name, t.rule) for t in p.tensors),
        )
        maps = _file_mappings()
        for name, t in sd.items():
            assert torch.equal(t, expected_shard(ref[name], plan_rules[name], tp, rank)), name
            assert _mapped_inode(t, maps) in inodes, name
        full = dict(iter_tensors(snapshot, tp_size=tp, tp_rank=rank, options=LoaderOptions(views="full")))
        for name, t in full.items():
            assert torch.equal(t, ref[name]), name  # the whole tensor: the engine narrows it itself


def test_hashed_files_and_plain_directories_are_read_not_mapped(
    snapshot: str, ckpt: Path, ref: dict[str, torch.Tensor]
) -> None:
    victim = sorted(n for n in os.listdir(snapshot) if n.endswith(".safetensors"))[0]
    os.chmod(os.path.join(snapshot, victim), 0o644)  # a writable blob is hashed on every load
    stats = LoadStats()
    sd = load_state_dict(snapshot, options=LoaderOptions(views="shard"), stats=stats)
    assert stats.verification[victim] == "hashed"
    maps = _file_mappings()
    from safetensors import safe_open

    with safe_open(os.path.join(snapshot, victim), "pt") as f:
        in_victim = set(f.keys())
    for name, t in sd.items():
        assert torch.equal(t, ref[name])
        if name in in_victim and t.numel():
            assert _mapped_inode(t, maps) is None, name
    plain = load_state_dict(str(ckpt), allow_unverified=True, options=LoaderOptions(views="shard"))
    maps = _file_mappings()
    assert all(_mapped_inode(t, maps) is None for t in plain.values() if t.numel())


def test_out_destinations_are_filled_not_replaced(snapshot: str, ref: dict[str, torch.Tensor]) -> None:
    name = next(iter(ref))
    out = {name: torch.empty_like(ref[name])}
    sd: dict[str, Any] = load_state_dict(snapshot, out=out, options=LoaderOptions(views="shard"))
    assert sd[name] is out[name] and torch.equal(out[name], ref[name])


@pytest.mark.parametrize("tp", [1, 2])
def test_full_shape_stream_for_vllm_is_views_of_the_blobs(
    snapshot: str, ref: dict[str, torch.Tensor], tp: int
) -> None:
    from modelpack.serving.full_shape import iter_full_shape

    inodes = _blob_inodes(snapshot)
    for rank in range(tp):
        stats = LoadStats()
        got = dict(
            iter_full_shape(
                snapshot, tp_size=tp, tp_rank=rank, options=LoaderOptions(views="full"), stats=stats
            )
        )
        maps = _file_mappings()
        assert set(got) == set(ref)
        for name, t in got.items():
            assert torch.equal(t, ref[name]), name
            assert _mapped_inode(t, maps) in inodes, name
        assert stats.mapped_bytes == sum(t.numel() * t.element_size() for t in ref.values())
