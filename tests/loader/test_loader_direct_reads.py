"""Verified streams read straight into the destination tensors.

A chunk-verified or whole-layer stream on the CPU used to receive each range into a fresh
``bytes``, copy it into a staging slot, hash it, and copy it again into the tensor. Now the
reader fills the tensors it feeds (``preadv`` / ``recv_into``), the chunks are hashed where the
bytes landed, and only strided (dim-1) blocks are still staged. These tests hold that to the
same guarantees: tensors equal ``safetensors``' load, every byte counted once, and a chunk or
layer that fails its check never reaches the consumer — not the tensor the bad byte is in, not
the neighbour that shares the bad chunk — although its bytes did land in their memory.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from modelpack.loader import LoaderOptions, LoadStats, iter_tensors, load_state_dict
from modelpack.loader.readers import FileReader, TargetReader
from modelpack.signing.chunks import compute_chunk_table

from modelpack import api
from modelpack.errors import ChunkDigestMismatch, DigestMismatchError, TruncatedSourceError
from modelpack.packing.safetensors_format import read_header
from modelpack.targets.fetch import fetch_manifest
from modelpack.targets.opener import open_readable
from modelpack.testdata.synthetic import SyntheticSpec, write_checkpoint
from tests.fixtures.faultproxy import Fault, FaultProxy, blob_get
from tests.loader_helpers import corrupt, expected_shard, reference_tensors

CHUNK = 64 * 1024  # tensors of 128–512 KiB: most span several chunks, most chunks two tensors


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("direct-ckpt")
    write_checkpoint(str(d), SyntheticSpec(shards=2, seed=73))
    return d


@pytest.fixture(scope="module")
def ref(ckpt: Path) -> dict[str, torch.Tensor]:
    return reference_tensors(ckpt)


@pytest.fixture
def pushed(registry: Any, ckpt: Path, request: pytest.FixtureRequest) -> tuple[str, Any, Any]:
    """(pinned reference, target, chunk table) of the checkpoint in a repository of its own."""
    repo = "direct/" + re.sub(r"[^a-z0-9]+", "-", request.node.name.lower())[:60].strip("-")
    res = api.pack(str(ckpt), registry.ref(repo, "v1"))
    pinned = f"{registry.host}/{repo}@{res.artifact.digest}"
    target = open_readable(pinned)
    manifest, _ = fetch_manifest(target, str(res.artifact.digest))
    return pinned, manifest, compute_chunk_table(target, manifest, chunk_size=CHUNK)


def _weight_bytes(ckpt: Path) -> int:
    return sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))


@pytest.mark.host_copier  # the CPU path that reads straight into the tensors
@pytest.mark.parametrize("with_table", [True, False], ids=["chunks", "whole"])
def test_tp1_stream_lands_in_the_tensors_without_staging(
    pushed: tuple[str, Any, Any], ckpt: Path, ref: dict[str, torch.Tensor], with_table: bool
) -> None:
    pinned, _, table = pushed
    stats = LoadStats()
    sd = load_state_dict(pinned, chunk_table=table if with_table else None, stats=stats)
    assert stats.verification and set(stats.verification.values()) == {"chunks" if with_table else "whole"}
    assert sd.keys() == ref.keys()
    for name, want in ref.items():
        assert torch.equal(sd[name], want), name
    assert stats.staged_bytes == 0  # every block went straight into its tensors
    # each byte fetched once (chunks: the header's chunks are kept for the data pass); a whole
    # layer is hashed from its first byte, so its header is fetched for parsing and again in it
    headers = (
        0
        if with_table
        else sum(8 + int.from_bytes(f.read_bytes()[:8], "little") for f in ckpt.glob("*.safetensors"))
    )
    assert stats.bytes_read == _weight_bytes(ckpt) + headers


def test_strided_shards_are_still_staged_and_equal(
    pushed: tuple[str, Any, Any], ref: dict[str, torch.Tensor]
) -> None:
    pinned, _, table = pushed
    for rank in range(2):
        stats = LoadStats()
        sd = load_state_dict(pinned, chunk_table=table, tp_size=2, tp_rank=rank, stats=stats)
        assert stats.plan is not None
        for t in stats.plan.tensors:
            assert torch.equal(sd[t.name], expected_shard(ref[t.name], t.rule, 2, rank)), t.name
        dim1 = sum(t.nbytes for t in stats.plan.tensors if t.rule.value == "dim1")
        assert dim1 > 0 and stats.staged_bytes >= dim1  # column shards cannot land in place


def _straddling_chunk(path: Path) -> tuple[str, str, int]:
    """Two neighbouring tensors A | B and a byte of A inside the chunk they share."""
    hdr = read_header(path)
    spans = sorted((hdr.absolute(t), t.name) for t in hdr.tensors)
    for ((_, a_end), a), ((b_start, _), b) in itertools.pairwise(spans):
        if a_end == b_start and a_end % CHUNK > 16 and (a_end - 1) // CHUNK == b_start // CHUNK:
            return a, b, a_end - 8
    raise AssertionError("no chunk is shared by two tensors")


@pytest.mark.host_copier  # the CPU path that reads straight into the tensors
def test_a_bad_chunk_from_the_registry_reaches_no_tensor_not_even_its_neighbour(
    registry: Any, pushed: tuple[str, Any, Any], ref: dict[str, torch.Tensor]
) -> None:
    pinned, manifest, table = pushed
    layer = next(
        x for x in manifest.layers if "00001" in (x.annotations or {}).get("org.cncf.model.filepath", "")
    )
    blob = registry.blob_data_path(str(layer.digest))
    a, b, offset = _straddling_chunk(blob)
    clean = LoadStats()
    load_state_dict(pinned, chunk_table=table, stats=clean)
    assert clean.staged_bytes == 0  # the attack below meets the direct path
    original = blob.read_bytes()
    corrupt(blob, offset)
    try:
        served: list[str] = []
        with pytest.raises(ChunkDigestMismatch, match=str(layer.digest)) as info:
            for name, tensor in iter_tensors(pinned, chunk_table=table):
                served.append(name)
                assert torch.equal(tensor, ref[name]), name  # what was served is the signed content
        assert info.value.index == offset // CHUNK
        assert a not in served and b not in served
        with pytest.raises(ChunkDigestMismatch):
            load_state_dict(pinned, chunk_table=table)  # and the collected dict never exists
        served.clear()
        with pytest.raises(DigestMismatchError):
            for name, _ in iter_tensors(pinned):
                served.append(name)
        layer_names = {t.name for t in read_header(blob).tensors}
        assert not set(served) & layer_names  # no tensor of the bad layer left, first bytes or not
    finally:
        blob.write_bytes(original)  # the registry is shared by the whole session


def test_file_scatter_reads_fill_every_view_and_refuse_a_short_file(tmp_path: Path) -> None:
    data = bytes(range(256)) * 1024
    path = tmp_path / "blob"
    path.write_bytes(data)
    reader = FileReader(str(path))
    views = [memoryview(bytearray(n)) for n in (1, 4095, 70_000, 3)]
    reader.read_scatter(1000, views)
    assert b"".join(bytes(v) for v in views) == data[1000 : 1000 + 74_099]
    assert reader.bytes_read == 74_099
    with pytest.raises(TruncatedSourceError):
        reader.read_scatter(len(data) - 10, [memoryview(bytearray(8)), memoryview(bytearray(8))])
    reader.close()


def test_registry_scatter_reads_resume_a_cut_range_across_views(
    registry: Any, pushed: tuple[str, Any, Any]
) -> None:
    pinned, manifest, _ = pushed
    big = max(manifest.layers, key=lambda d: d.size)
    whole = open_readable(pinned).fetch_range(big, 0, big.size)
    proxy = FaultProxy(registry.host)
    try:
        repo = pinned.split("/", 1)[1].split("@")[0]
        target = open_readable(f"{proxy.host}/{repo}@{manifest_digest(pinned)}")
        proxy.add(Fault(match=blob_get(str(big.digest)), cut_after=5000, times=3))
        reader = TargetReader(target, big)
        views = [memoryview(bytearray(n)) for n in (4000, 3000, 200_000)]
        reader.read_scatter(777, views)
        assert b"".join(bytes(v) for v in views) == whole[777 : 777 + 207_000]
        proxy.settle()
        assert proxy.blob_bytes[str(big.digest)] == 207_000  # continued from the byte reached
    finally:
        proxy.close()


def manifest_digest(pinned: str) -> str:
    return pinned.rsplit("@", 1)[1]


@pytest.mark.host_copier  # the CPU path that reads straight into the tensors
def test_options_that_stage_still_verify(pushed: tuple[str, Any, Any], ref: dict[str, torch.Tensor]) -> None:
    """A slot smaller than a tensor (many blocks per tensor) still lands each byte once."""
    pinned, _, table = pushed
    stats = LoadStats()
    sd = load_state_dict(
        pinned, chunk_table=table, stats=stats, options=LoaderOptions(slot_bytes=CHUNK, slots=3)
    )
    for name, want in ref.items():
        assert torch.equal(sd[name], want), name
    assert stats.staged_bytes == 0


def _idle_ports(target: Any) -> set[int]:
    """Local ports of the open sockets idling in the target's HTTP pools (urllib3's pools)."""
    ports = set()
    for adapter in target.client.session.adapters.values():
        for pool in adapter.poolmanager.pools._container.values():
            for conn in list(pool.pool.queue):
                sock = getattr(conn, "sock", None) if conn is not None else None
                if sock is not None:
                    ports.add(sock.getsockname()[1])
    return ports


def test_ranges_received_in_place_reuse_their_connection(pushed: tuple[str, Any, Any]) -> None:
    pinned, manifest, _ = pushed
    big = max(manifest.layers, key=lambda d: d.size)
    target = open_readable(pinned)
    reader = TargetReader(target, big)
    seen: list[set[int]] = []
    for i in range(6):
        reader.read_scatter(i * 5000, [memoryview(bytearray(3000)), memoryview(bytearray(2000))])
        seen.append(_idle_ports(target))
    # after every range the connection is back in the pool, open, and it is the same one
    assert all(ports == seen[0] and len(ports) == 1 for ports in seen), seen
