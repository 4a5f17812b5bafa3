"""Blob owners with bounded load, the same on every node.

Rendezvous hashing alone gave one node of 16 four of the model's 16 shards (a quarter of the
model to send to 15 nodes through one link) and six nodes none. The balanced assignment (blobs
by size, each to the first node in its rendezvous order whose load stays under its share) must
still be computed alike by every node from the same manifest and peer set, or owners differ
between nodes and the origin serves a blob once per owner.
"""

from __future__ import annotations

import hashlib
import math
import random
from typing import Any

import pytest

from modelpack.oci.descriptor import Descriptor
from modelpack.oci.digest import Digest
from modelpack.targets.registry.owners import balanced_owners


def _blobs(sizes: list[int], seed: int = 0) -> list[Descriptor]:
    return [
        Descriptor("application/octet-stream", Digest.from_bytes(b"%d-%d" % (seed, i)), size)
        for i, size in enumerate(sizes)
    ]


def _peers(n: int) -> list[str]:
    return [f"10.231.0.{i}:5050" for i in range(1, n + 1)]


def _storm_model() -> list[Descriptor]:
    """benchmarks/storm.py's model: 16 shards of 6.3 MB, config and tokenizer files."""
    return _blobs([6_300_000] * 16 + [1_700, 400, 300, 80, 40])


def test_every_node_computes_the_same_owners_whatever_its_peer_order() -> None:
    blobs, peers = _storm_model(), _peers(16)
    first = balanced_owners(peers, blobs)
    rng = random.Random(1)
    for _ in range(20):  # each node lists the peers in its own (rendezvous) order
        shuffled = peers[:]
        rng.shuffle(shuffled)
        mixed = blobs[:]
        rng.shuffle(mixed)
        assert balanced_owners(shuffled, mixed) == first
    assert set(first) == {str(b.digest) for b in blobs}


@pytest.mark.parametrize("n", [2, 3, 5, 8, 16, 24])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_no_owner_carries_more_than_its_share_plus_the_largest_blob(n: int, seed: int) -> None:
    rng = random.Random(seed)
    sizes = [rng.choice([6_300_000, 1_000_000, 250_000, 4_000]) for _ in range(rng.randint(5, 40))]
    blobs, peers = _blobs(sizes, seed), _peers(n)
    owners = balanced_owners(peers, blobs)
    load = {p: 0 for p in peers}
    for b in blobs:
        load[owners[str(b.digest)]] += b.size
    bound = math.ceil(sum(sizes) / n) + max(sizes)
    assert max(load.values()) <= bound, (load, bound)


def test_the_storm_model_gives_every_node_one_shard() -> None:
    blobs = _storm_model()
    owners = balanced_owners(_peers(16), blobs)
    shards = [owners[str(b.digest)] for b in blobs if b.size == 6_300_000]
    assert len(set(shards)) == 16  # rendezvous alone: 10 nodes owned all 16 shards


def test_a_blob_keeps_its_rendezvous_owner_when_that_owner_has_room() -> None:
    """Balancing moves only what overflows: with one blob per peer-share, a blob whose
    rendezvous-first peer is free stays there (so owners are stable as the model changes)."""
    blobs, peers = _blobs([1000]), _peers(8)
    owners = balanced_owners(peers, blobs)
    best = max(peers, key=lambda p: hashlib.sha256(f"{blobs[0].digest}\0{p}".encode()).digest())
    assert owners[str(blobs[0].digest)] == best


def test_with_blob_order_the_planned_owner_is_asked_first(monkeypatch: pytest.MonkeyPatch) -> None:
    from modelpack.targets.registry.client import RegistryClient
    from modelpack.targets.registry.mirrors import MirroredBlobs, MirrorEndpoint
    from modelpack.targets.registry.repository import RepositoryAPI

    monkeypatch.setenv("MODELPACK_PEER_ORDER", "blob")
    blobs = _storm_model()
    endpoints = [MirrorEndpoint(host=p, plain_http=True, peer=True) for p in _peers(16)]
    mirrors = MirroredBlobs(
        RepositoryAPI(RegistryClient("origin.example:5000", plain_http=True), "m"), endpoints
    )
    mirrors.plan(blobs)
    owners = balanced_owners(_peers(16), blobs)
    for b in blobs:
        order = [m.name for m in mirrors._for_blob(b)]
        assert order[0] == owners[str(b.digest)]
        assert sorted(order) == sorted(_peers(16))  # the others stay as fallbacks


def test_a_manifest_read_through_open_readable_plans_its_owners(
    registry: Any, checkpoint: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hook itself: reading a manifest by digest through the target a pull opens (real
    registry, peers from a ``dns+`` name) plans that manifest's owners — the path every pulling
    node takes, not only ``MirroredBlobs.plan`` called by hand."""
    from modelpack.api import transfer
    from modelpack.oci.descriptor import Manifest
    from modelpack.targets.opener import TargetOptions, open_readable

    monkeypatch.setenv("MODELPACK_PEER_ORDER", "blob")
    monkeypatch.setattr(
        "modelpack.targets.registry.peers.resolve_all",
        lambda host, port: ["10.231.0.1", "10.231.0.2", "10.231.0.3"],
    )
    res = transfer.push(str(checkpoint), registry.ref("owners/plan", "v1"), progress="off")
    target = open_readable(
        registry.ref("owners/plan", None), TargetOptions(mirrors=["dns+http://peers.invalid:5050"])
    )
    mirrors = target.mirrors  # type: ignore[attr-defined]
    assert mirrors is not None and mirrors._owners == {}
    raw, media_type = target.fetch_manifest(str(res.digest))
    manifest = Manifest.parse(raw, media_type=media_type)
    blobs = [manifest.config, *manifest.layers]
    expected = balanced_owners([m.name for m in mirrors.mirrors if m.endpoint.peer], blobs)
    assert mirrors._owners == expected and len(set(expected.values())) > 1
    for b in blobs:
        assert mirrors._for_blob(b)[0].name == expected[str(b.digest)]
