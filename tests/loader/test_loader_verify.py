"""Loader safeguards: pinned digest, fingerprint (fail closed), chunk and whole-layer verification."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from modelpack.loader import Fingerprint, LoaderOptions, LoadStats, iter_tensors, load_state_dict, prepare
from modelpack.loader.plan import ShardRule
from modelpack.signing.chunks import compute_chunk_table, push_chunk_table
from modelpack.signing.keys import generate_key

from modelpack.errors import (
    ChunkDigestMismatch,
    ChunkTableError,
    DigestMismatchError,
    ExpectedDigestError,
    FingerprintFileError,
    FingerprintMismatchError,
    UnpinnedReferenceError,
)
from modelpack.testdata.synthetic import SyntheticSpec, write_checkpoint
from tests.loader_helpers import Layout, corrupt, expected_shard, pack_layout, reference_tensors

CHUNK = 64 * 1024


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("ckpt")
    # a seed of its own: one test below corrupts these blobs in the session-wide registry
    write_checkpoint(str(d), SyntheticSpec(shards=2, seed=61))
    return d


@pytest.fixture(scope="module")
def ref(ckpt: Path) -> dict[str, torch.Tensor]:
    return reference_tensors(ckpt)


@pytest.fixture
def layout(ckpt: Path, tmp_path: Path) -> Layout:
    return pack_layout(ckpt, tmp_path / "layout")


# --------------------------------------------------------------------------- pinning
def test_wrong_expected_digest_is_refused(layout: Layout) -> None:
    other = "sha256:" + "ab" * 32
    with pytest.raises(ExpectedDigestError, match=other):
        load_state_dict(f"oci:{layout.path}:v1", expected_digest=other)
    with pytest.raises(ExpectedDigestError):
        load_state_dict(layout.ref, expected_digest=other)
    with pytest.raises(ExpectedDigestError):
        load_state_dict((layout.target, "v1"), expected_digest=other)


def test_a_moving_tag_without_a_pin_is_refused(layout: Layout) -> None:
    with pytest.raises(UnpinnedReferenceError, match="pin the manifest digest"):
        load_state_dict(f"oci:{layout.path}:v1")
    # the tag plus the right pin is fine
    sd = load_state_dict(f"oci:{layout.path}:v1", expected_digest=layout.digest)
    assert sd


# --------------------------------------------------------------------------- fingerprint
def test_fingerprint_each_field_mismatch_is_named(layout: Layout, tmp_path: Path) -> None:
    prep = prepare(layout.ref, tp_size=2, tp_rank=1)
    fp = prep.fingerprint
    prep.close()
    assert fp.manifest_digest == layout.digest and fp.tp_size == 2 and fp.tp_rank == 1
    assert fp.dtype == "BF16" and fp.quantization == "none" and fp.device_arch.startswith("cpu-")
    # the right fingerprint (object, dict, digest, recorded file) lets the load through
    recorded = tmp_path / "compiled" / "modelpack.fingerprint.json"
    fp.write(str(recorded))
    for good in (fp, fp.to_dict(), fp.digest, str(recorded)):
        assert load_state_dict(layout.ref, tp_size=2, tp_rank=1, fingerprint=good)
    changed: dict[str, Any] = {
        "manifest_digest": "sha256:" + "0" * 64,
        "dtype": "F16",
        "quantization": "awq-4bit",
        "tp_size": 4,
        "tp_rank": 0,
        "rank_layout": "sha256:" + "1" * 64,
        "device_arch": "cuda-sm_90-NVIDIA H200",
        "loader_format_version": "modelpack-loader/0",
    }
    for field, value in changed.items():
        bad = dataclasses.replace(fp, **{field: value})
        with pytest.raises(FingerprintMismatchError) as info:
            load_state_dict(layout.ref, tp_size=2, tp_rank=1, fingerprint=bad)
        assert info.value.fields == [field]
        assert field in str(info.value)
    # fail closed: an empty expected field is a mismatch, not a wildcard
    for field in ("manifest_digest", "quantization", "device_arch"):
        with pytest.raises(FingerprintMismatchError) as info:
            load_state_dict(layout.ref, tp_size=2, tp_rank=1, fingerprint={**fp.to_dict(), field: ""})
        assert info.value.fields == [field]
    with pytest.raises(FingerprintMismatchError, match="tp_rank"):
        load_state_dict(
            layout.ref,
            tp_size=2,
            tp_rank=1,
            fingerprint={k: v for k, v in fp.to_dict().items() if k != "tp_rank"},
        )
    # two fields differ → both named
    with pytest.raises(FingerprintMismatchError) as info:
        load_state_dict(
            layout.ref, tp_size=2, tp_rank=1, fingerprint=dataclasses.replace(fp, dtype="F8_E4M3", tp_size=8)
        )
    assert sorted(info.value.fields) == ["dtype", "tp_size"]
    # a tampered recorded file is refused as such
    doc = json.loads(recorded.read_text())
    doc["fingerprint"]["tp_rank"] = 0
    recorded.write_text(json.dumps(doc))
    with pytest.raises(FingerprintFileError, match="does not match its fields"):
        load_state_dict(layout.ref, tp_size=2, tp_rank=1, fingerprint=str(recorded))


def test_fingerprint_of_a_plain_directory_fails_closed(ckpt: Path) -> None:
    prep = prepare(str(ckpt), allow_unverified=True)
    fp = prep.fingerprint
    prep.close()
    assert fp.manifest_digest == ""
    with pytest.raises(FingerprintMismatchError) as info:
        load_state_dict(str(ckpt), allow_unverified=True, fingerprint=fp)
    assert info.value.fields == ["manifest_digest"]


# --------------------------------------------------------------------------- chunk tables
def _table(layout: Layout) -> Any:
    return compute_chunk_table(layout.target, layout.manifest, chunk_size=CHUNK)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_chunk_verified_ranks_equal_slicing(layout: Layout, ref: dict[str, torch.Tensor], tp: int) -> None:
    table = _table(layout)
    for rank in range(tp):
        stats = LoadStats()
        sd = load_state_dict(layout.ref, tp_size=tp, tp_rank=rank, chunk_table=table, stats=stats)
        assert stats.plan is not None
        for t in stats.plan.tensors:
            assert torch.equal(sd[t.name], expected_shard(ref[t.name], t.rule, tp, rank)), t.name
        # reads are whole chunks: a multiple of the chunk size except each file's short tail
        assert stats.bytes_read >= stats.bytes_to_read


def test_signed_chunk_table_is_found_through_trusted_keys(
    layout: Layout, ref: dict[str, torch.Tensor]
) -> None:
    key = generate_key()
    push_chunk_table(layout.target, layout.desc, _table(layout), key)
    sd = load_state_dict(layout.ref, trusted_keys=[key.public], tp_size=2, tp_rank=0)
    assert torch.equal(sd["model.norm.weight"], ref["model.norm.weight"])
    with pytest.raises(ChunkTableError, match="not signed by a trusted key"):
        load_state_dict(layout.ref, trusted_keys=[generate_key().public])


def _corrupt_middle_tensor(layout: Layout) -> tuple[str, int]:
    """Flip a byte inside a tensor in the middle of the first weight file; returns (name, offset)."""
    from modelpack.packing.safetensors_format import read_header

    _, blob = layout.weight_blob("00001")
    hdr = read_header(blob)
    victim = hdr.tensors[len(hdr.tensors) // 2]
    start, end = hdr.absolute(victim)
    offset = (start + end) // 2
    corrupt(blob, offset)
    return victim.name, offset


def test_corrupted_chunk_is_refused_before_any_byte_is_served(
    layout: Layout, ref: dict[str, torch.Tensor]
) -> None:
    table = _table(layout)
    victim, offset = _corrupt_middle_tensor(layout)
    with pytest.raises(ChunkDigestMismatch) as info:
        load_state_dict(layout.ref, chunk_table=table)
    assert info.value.index == offset // CHUNK
    served = []
    with pytest.raises(ChunkDigestMismatch):
        for name, tensor in iter_tensors(
            layout.ref, chunk_table=table, options=LoaderOptions(slots=2, workers=1)
        ):
            served.append(name)
            assert torch.equal(tensor, ref[name]), name  # what was served is the signed content
    assert victim not in served


def test_without_a_table_the_whole_layer_must_match(layout: Layout) -> None:
    victim, _ = _corrupt_middle_tensor(layout)
    served = []
    with pytest.raises(DigestMismatchError, match=r"model-00001-of-00002\.safetensors"):
        for name, _ in iter_tensors(layout.ref, options=LoaderOptions(slot_bytes=64 * 1024)):
            served.append(name)
    # no tensor of the corrupted layer was handed out, not even the ones before the bad byte
    from modelpack.packing.safetensors_format import read_header

    _, blob = layout.weight_blob("00001")
    layer_names = {t.name for t in read_header(blob).tensors}
    assert victim in layer_names and not (set(served) & layer_names)


def test_truncated_blob_is_refused(layout: Layout) -> None:
    import os

    _, blob = layout.weight_blob("00002")
    os.chmod(blob, 0o644)
    os.truncate(blob, blob.stat().st_size - 10)
    with pytest.raises(Exception, match=r"00002|truncated|expected") as info:
        load_state_dict(layout.ref)
    from modelpack.errors import ModelpackError

    assert isinstance(info.value, ModelpackError)


# --------------------------------------------------------------------------- registry streaming
@pytest.fixture
def pushed(registry: Any, ckpt: Path, request: pytest.FixtureRequest) -> tuple[str, str]:
    import re

    from modelpack import api

    repo = "loader/" + re.sub(r"[^a-z0-9]+", "-", request.node.name.lower())[:60].strip("-")
    res = api.pack(str(ckpt), registry.ref(repo, "v1"))
    return f"{registry.host}/{repo}", str(res.artifact.digest)


@pytest.mark.parametrize("tp", [1, 2])
def test_registry_streaming_by_ranges_equals_slicing(
    pushed: tuple[str, str], ref: dict[str, torch.Tensor], tp: int
) -> None:
    from modelpack.targets.fetch import fetch_manifest
    from modelpack.targets.opener import open_readable

    repo, digest = pushed
    target = open_readable(f"{repo}@{digest}")
    manifest, _ = fetch_manifest(target, digest)
    table = compute_chunk_table(target, manifest, chunk_size=CHUNK)
    for mode_table in (table, None):
        for rank in range(tp):
            stats = LoadStats()
            sd = load_state_dict(
                f"{repo}@{digest}", tp_size=tp, tp_rank=rank, chunk_table=mode_table, stats=stats
            )
            assert stats.state == "streamed"
            assert stats.plan is not None
            for t in stats.plan.tensors:
                want = expected_shard(ref[t.name], t.rule, tp, rank)
                assert torch.equal(sd[t.name], want), t.name
            if mode_table is not None and tp > 1:
                assert stats.bytes_read < stats.plan.total_bytes  # ranges, not whole blobs
            assert stats.plan.tensors[0].rule in (ShardRule.DIM0, ShardRule.REPLICATE)


def test_chunk_corrupted_in_the_registry_mid_stream(
    registry: Any, pushed: tuple[str, str], ref: dict[str, torch.Tensor]
) -> None:
    from modelpack.packing.safetensors_format import read_header
    from modelpack.targets.fetch import fetch_manifest
    from modelpack.targets.opener import open_readable

    repo, digest = pushed
    target = open_readable(f"{repo}@{digest}")
    manifest, _ = fetch_manifest(target, digest)
    table = compute_chunk_table(target, manifest, chunk_size=CHUNK)
    layer = next(
        x for x in manifest.layers if "00001" in (x.annotations or {}).get("org.cncf.model.filepath", "")
    )
    data_path = registry.blob_data_path(str(layer.digest))
    hdr = read_header(data_path)
    victim = hdr.tensors[len(hdr.tensors) // 2]
    start, end = hdr.absolute(victim)
    original = data_path.read_bytes()
    corrupt(data_path, (start + end) // 2)
    try:
        served = []
        with pytest.raises(ChunkDigestMismatch, match=str(layer.digest)):
            for name, tensor in iter_tensors(
                f"{repo}@{digest}", chunk_table=table, options=LoaderOptions(remote_inflight=2)
            ):
                served.append(name)
                assert torch.equal(tensor, ref[name])
        assert victim.name not in served
        # and with no table: the layer's digest check refuses it, nothing of the layer is served
        with pytest.raises(DigestMismatchError):
            load_state_dict(f"{repo}@{digest}")
    finally:
        data_path.write_bytes(original)  # the registry is shared by the whole session


# --------------------------------------------------------------------------- node-cache snapshots
def test_snapshot_is_pinned_and_leased_while_loading(
    layout: Layout, tmp_path: Path, ref: dict[str, torch.Tensor]
) -> None:
    from modelpack.mount.cache import NodeCache

    cache = NodeCache(str(tmp_path / "cache"))
    pinned = f"oci:{layout.path}@{layout.digest}"
    snap = cache.pull(pinned).path
    other = "sha256:" + "ab" * 32
    with pytest.raises(ExpectedDigestError, match=other):
        load_state_dict(snap, expected_digest=other)
    with pytest.raises(ExpectedDigestError, match=other):
        load_state_dict((cache, pinned), expected_digest=other)
    it = iter_tensors((cache, pinned), expected_digest=layout.digest)
    first, tensor = next(it)
    assert torch.equal(tensor, ref[first])
    assert cache.snapshots.in_use(layout.digest)  # GC cannot take the files away mid-load
    rest = dict(it)
    assert not cache.snapshots.in_use(layout.digest)
    assert {first, *rest} == set(ref) and all(torch.equal(v, ref[k]) for k, v in rest.items())


def test_load_command_records_and_enforces_the_fingerprint(layout: Layout, tmp_path: Path) -> None:
    from click.testing import CliRunner

    from modelpack.cli import main

    runner = CliRunner()
    fp_file = tmp_path / "fp.json"
    res = runner.invoke(
        main,
        [
            "load",
            layout.ref,
            "--tp-size",
            "2",
            "--tp-rank",
            "1",
            "--record-fingerprint",
            str(fp_file),
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    assert doc["digest"] == layout.digest and doc["tensors"] > 0 and doc["bytesRead"] >= doc["bytesToRead"]
    assert Fingerprint.read(str(fp_file)).digest == doc["fingerprintDigest"]
    ok = runner.invoke(
        main, ["load", layout.ref, "--tp-size", "2", "--tp-rank", "1", "--fingerprint", str(fp_file)]
    )
    assert ok.exit_code == 0, ok.output
    bad = runner.invoke(
        main, ["load", layout.ref, "--tp-size", "2", "--tp-rank", "0", "--fingerprint", str(fp_file)]
    )
    assert bad.exit_code == 1 and "fingerprint mismatch" in bad.output
    assert "tp_rank: expected 1, got 0" in bad.output
    unpinned = runner.invoke(main, ["load", f"oci:{layout.path}:v1"])
    assert unpinned.exit_code == 1 and "pin the manifest digest" in unpinned.output
