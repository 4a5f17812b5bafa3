"""Loader on local sources: bit-identical tensors, TP shards, bytes per rank, dtypes, events."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from modelpack.loader import LoaderOptions, LoadStats, iter_tensors, load_into, load_state_dict
from modelpack.loader.plan import ShardRule
from safetensors.torch import save_file

from modelpack.errors import SafetensorsError, TruncatedSourceError, UnverifiedSourceError
from modelpack.events import read_events
from modelpack.testdata.synthetic import SyntheticSpec, write_checkpoint
from tests.loader_helpers import expected_shard, reference_tensors

SPEC = SyntheticSpec(shards=2)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("ckpt")
    write_checkpoint(str(d), SPEC)
    return d


@pytest.fixture(scope="module")
def ref(ckpt: Path) -> dict[str, torch.Tensor]:
    return reference_tensors(ckpt)


def test_tp1_is_bit_identical_to_safetensors(ckpt: Path, ref: dict[str, torch.Tensor]) -> None:
    stats = LoadStats()
    sd = load_state_dict(str(ckpt), allow_unverified=True, stats=stats)
    assert sd.keys() == ref.keys()
    for name, t in ref.items():
        assert sd[name].dtype == t.dtype and torch.equal(sd[name], t), name
    assert stats.tensors == len(ref)
    assert stats.bytes_to_read == sum(t.numel() * t.element_size() for t in ref.values())


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("direct_io", [False, True], ids=["buffered", "staged"])
def test_every_rank_equals_slicing_and_reads_its_fraction(
    ckpt: Path, ref: dict[str, torch.Tensor], tp: int, direct_io: bool
) -> None:
    total = sum(t.numel() * t.element_size() for t in ref.values())
    opts = LoaderOptions(direct_io=direct_io, slot_bytes=64 * 1024)
    seen: dict[str, list[torch.Tensor]] = {}
    for rank in range(tp):
        stats = LoadStats()
        sd = load_state_dict(
            str(ckpt), tp_size=tp, tp_rank=rank, allow_unverified=True, stats=stats, options=opts
        )
        assert stats.plan is not None
        for t in stats.plan.tensors:
            want = expected_shard(ref[t.name], t.rule, tp, rank)
            assert sd[t.name].shape == want.shape and torch.equal(sd[t.name], want), (t.name, rank)
            seen.setdefault(t.name, []).append(sd[t.name])
        replicated = stats.plan.replicated_bytes
        headers = sum(8 + h.header_size for h in (fp.header for fp in stats.plan.files.values()))
        # O_DIRECT reads whole 4 KiB pages: at most two extra pages per staged piece
        padding = 2 * 4096 * len(stats.plan.tensors) if direct_io else 0
        # measured by the readers: ≈ model/TP (+5%) plus replicated tensors, plus the headers
        assert stats.bytes_read <= (total / tp) * 1.05 + replicated + headers + padding, stats.bytes_read
        assert stats.bytes_read >= (total - replicated) / tp
    # the ranks' shards put back together are the full tensors
    assert stats.plan is not None
    rules = {t.name: t.rule for t in stats.plan.tensors}
    for name, parts in seen.items():
        if rules[name] is ShardRule.DIM0:
            assert torch.equal(torch.cat(parts, 0), ref[name])
        elif rules[name] is ShardRule.DIM1:
            assert torch.equal(torch.cat(parts, 1), ref[name])


def test_dtypes_and_odd_shapes_round_trip(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(3)
    tensors = {
        "a.f32": torch.randn(7, 5, generator=g),
        "b.f16": torch.randn(3, 4, 2, generator=g).half(),
        "c.i64": torch.arange(11, dtype=torch.int64),
        "d.bool": torch.tensor([True, False, True]),
        "e.f8": torch.randn(16, generator=g).to(torch.float8_e4m3fn),
        "f.scalar": torch.tensor(3.5),
        "g.empty": torch.empty(0, 4),
        "h.u8": torch.randint(0, 255, (9, 9), dtype=torch.uint8, generator=g),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    sd = load_state_dict(str(tmp_path), allow_unverified=True)
    for k, v in tensors.items():
        assert sd[k].dtype == v.dtype and sd[k].shape == v.shape
        assert torch.equal(sd[k].reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)), k
    # uneven dims: torch.chunk-compatible on request
    save_file(
        {"x.q_proj.weight": torch.randn(10, 3), "x.o_proj.weight": torch.randn(3, 5)},
        str(tmp_path / "model.safetensors"),
    )
    full = reference_tensors(tmp_path)
    for rank in range(4):
        sd = load_state_dict(
            str(tmp_path),
            tp_size=4,
            tp_rank=rank,
            allow_unverified=True,
            options=LoaderOptions(uneven="chunk"),
        )
        assert torch.equal(
            sd["x.q_proj.weight"], expected_shard(full["x.q_proj.weight"], ShardRule.DIM0, 4, rank)
        )
        assert torch.equal(
            sd["x.o_proj.weight"], expected_shard(full["x.o_proj.weight"], ShardRule.DIM1, 4, rank)
        )


def test_plain_directory_needs_an_explicit_opt_in(ckpt: Path) -> None:
    with pytest.raises(UnverifiedSourceError, match="not a node-cache snapshot"):
        load_state_dict(str(ckpt))
    with pytest.raises(UnverifiedSourceError, match="no manifest digest"):
        load_state_dict(str(ckpt), allow_unverified=True, expected_digest="sha256:" + "0" * 64)


def test_truncated_file_is_refused_with_the_file_named(tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    write_checkpoint(str(d), SyntheticSpec(shards=2))
    victim = d / "model-00002-of-00002.safetensors"
    size = victim.stat().st_size
    os.truncate(victim, size - 100)
    with pytest.raises(SafetensorsError, match=r"model-00002-of-00002\.safetensors"):
        load_state_dict(str(d), allow_unverified=True)


def test_short_read_mid_load_raises_typed_and_serves_nothing(tmp_path: Path) -> None:
    """The file shrinks after the header was planned (a concurrent writer): typed error, no dict."""
    d = tmp_path / "ckpt"
    write_checkpoint(str(d), SyntheticSpec(shards=1))
    victim = d / "model.safetensors"
    from modelpack.packing.safetensors_format import read_header

    hdr = read_header(victim)
    cut = victim.stat().st_size // 2
    it = iter_tensors(
        str(d), allow_unverified=True, options=LoaderOptions(piece_bytes=4096, batch_bytes=4096, workers=1)
    )
    got = []
    with pytest.raises(TruncatedSourceError, match=r"model\.safetensors"):
        for i, (name, _) in enumerate(it):
            got.append(name)
            if i == 0:
                os.truncate(victim, cut)
    ends = {t.name: hdr.absolute(t)[1] for t in hdr.tensors}
    # everything handed out was whole before the cut; the tensors past it never appeared
    assert got and all(ends[n] <= cut for n in got)
    assert any(e > cut for e in ends.values()) and len(got) < len(ends)


def test_load_into_swaps_only_at_the_end_and_checks_shapes_first(
    ckpt: Path, ref: dict[str, torch.Tensor]
) -> None:
    module = torch.nn.Module()
    for name, t in ref.items():
        parent = module
        parts = name.split(".")
        for p in parts[:-1]:
            if not hasattr(parent, p):
                parent.add_module(p, torch.nn.Module())
            parent = getattr(parent, p)
        parent.register_parameter(parts[-1], torch.nn.Parameter(torch.zeros_like(t), requires_grad=False))
    before = {k: v.clone() for k, v in module.state_dict().items()}
    # a TP=2 shard does not fit a full-size module: refused before any data is read
    with pytest.raises(Exception, match="does not fit the module"):
        load_into(module, str(ckpt), tp_size=2, tp_rank=0, allow_unverified=True)
    for k, v in module.state_dict().items():
        assert torch.equal(v, before[k]), k
    stats = load_into(module, str(ckpt), allow_unverified=True)
    assert stats.tensors == len(ref)
    for k, v in module.state_dict().items():
        assert torch.equal(v, ref[k]), k


def test_out_fills_caller_destinations_in_place(ckpt: Path, ref: dict[str, torch.Tensor]) -> None:
    out = {k: torch.empty_like(v) for k, v in ref.items()}
    ptrs = {k: v.data_ptr() for k, v in out.items()}
    sd = load_state_dict(str(ckpt), allow_unverified=True, out=out)
    for k in ref:
        assert sd[k].data_ptr() == ptrs[k] and torch.equal(out[k], ref[k])


def test_events_record_t3_t4_t5(ckpt: Path, tmp_path: Path) -> None:
    log = tmp_path / "events.jsonl"
    stats = LoadStats()
    load_state_dict(
        str(ckpt), allow_unverified=True, events=str(log), start_id="s-1", state="hit", stats=stats
    )
    evs = read_events(str(log))
    stages = [e.get("stage") for e in evs]
    assert stages == ["t3", "t4", "t5"]
    for e in evs:
        assert e["start_id"] == "s-1" and e["state"] == "hit" and e["tp_size"] == 1
    assert evs[1]["bytes"] == stats.bytes_read > 0 and evs[2]["duration_ms"] >= evs[1]["duration_ms"] >= 0
