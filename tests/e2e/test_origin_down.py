"""Origin-down and offline starts, end to end with real processes.

Real parts: a real origin registry killed for the outage, ``modelpack push --sign-key`` (manifest
signature, directory signature, signed chunk table), node caches filled by ``modelpack pull
--cache --key``, real ``modelpack cache serve`` peers on loopback, ``modelpack load`` streaming
by range reads with every chunk checked against the signed chunk table, and KServe's storage
initializer run the way KServe runs it (uid 1000, its environment, ``tests/kserve_support.py``).

Before this change a chunk-verified ``modelpack load REF@sha256:… --trusted-key K --mirror PEER``
with the origin down was refused ("no chunk table signed by a trusted key"): the peer served the
weights but not the signed table.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.kserve_support import Pod, kserve_env, pod_volumes, run_initializer
from tests.origin_down_support import events, push_signed, run, serve, signed_peer, warm_node  # noqa: F401 (the fixture)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


@pytest.fixture
def pods() -> Iterator[list[Pod]]:
    """Two pods' volumes (each its own node cache), removed afterwards."""
    gens = [pod_volumes(), pod_volumes()]
    got = [next(g) for g in gens]
    yield got
    for g in gens:
        for _ in g:
            pass


def test_a_chunk_verified_streamed_load_succeeds_from_a_peer_with_the_origin_down(
    registry_factory: Any,
    checkpoint: Path,
    tmp_path: Path,
    serve: Any,  # noqa: F811
) -> None:
    origin, model, peer = signed_peer(registry_factory, checkpoint, tmp_path, serve, "down/load")
    origin.kill()
    log = tmp_path / "load-events.jsonl"
    started = time.monotonic()
    loaded = run(
        tmp_path,
        "load", model.pinned, "--trusted-key", model.pub, "--mirror", peer.url, "--retry-for", "2s",
        "--events", str(log), "--json",
    )  # fmt: skip
    assert loaded.returncode == 0, loaded.stderr
    doc = json.loads(loaded.stdout)
    assert doc["digest"] == model.digest and doc["tensors"] > 0
    assert doc["verification"] and set(doc["verification"].values()) == {"chunks"}, doc["verification"]
    assert set(doc["bytesBySource"]) == {peer.host}, doc
    assert time.monotonic() - started < 60
    # every byte is in an event naming its source: ranges (weights) and whole blobs (config.json)
    fetches = [e for e in events(log) if e["event"] in ("registry.range_sources", "registry.blob_sources")]
    assert any(e["event"] == "registry.range_sources" for e in fetches)
    assert all(set(e["source_urls"].values()) == {peer.url} for e in fetches), fetches
    assert sum(e["bytes"] for e in fetches) == sum(doc["bytesBySource"].values())


def test_offline_starts_from_the_local_cache_and_the_kserve_initializer_through_a_peer(
    registry_factory: Any,
    checkpoint: Path,
    tmp_path: Path,
    serve: Any,  # noqa: F811
    pods: list[Pod],
) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: the KServe initializer runs as uid 1000 in a mount namespace")
    origin = registry_factory.start()
    model = push_signed(origin, checkpoint, tmp_path, "down/offline")
    node = tmp_path / "node"
    warm_node(tmp_path, node, model)
    pod_a, pod_b = pods
    uri = f"modelpack://{model.pinned}"
    policy = model.key_policy(f"{model.host}/down/*")
    env_a = kserve_env(pod_a, MODELPACK_CACHE=str(pod_a.node_cache), MODELPACK_POLICY_YAML=policy)
    assert run_initializer(pod_a, [uri, str(pod_a.dest("warm"))], env_a).returncode == 0
    peer = serve(node)
    origin.kill()

    # everything down but the local caches: pinned pull (signature trusted from the cache's
    # record), a load of the snapshot, and the initializer (under the policy) all succeed
    # without a network
    again = run(
        tmp_path,
        "pull",
        "--cache",
        str(node),
        "--key",
        model.pub,
        "--retry-for",
        "1s",
        "--json",
        model.pinned,
    )
    assert again.returncode == 0, again.stderr
    hit = json.loads(again.stdout)
    assert hit["cache"]["state"] == "hit" and hit["signature"] == "verified"
    loaded = run(tmp_path, "load", hit["path"], "--expected-digest", model.digest, "--json")
    assert loaded.returncode == 0, loaded.stderr
    assert json.loads(loaded.stdout)["tensors"] > 0
    offline = run_initializer(pod_a, [uri, str(pod_a.dest("offline"))], env_a)
    assert offline.returncode == 0, offline.stderr
    assert sorted(p.name for p in pod_a.dest("offline").glob("*.safetensors")) == sorted(
        p.name for p in checkpoint.glob("*.safetensors")
    )

    # another pod, empty cache, origin down: the initializer gets the model and its signatures
    # from the peer, and checks them under its own policy
    env_b = kserve_env(
        pod_b,
        MODELPACK_CACHE=str(pod_b.node_cache),
        MODELPACK_MIRRORS=peer.url,
        MODELPACK_POLICY_YAML=policy,
        MODELPACK_RETRY_FOR="2s",
    )
    by_peer = run_initializer(pod_b, [uri, str(pod_b.dest("models"))], env_b)
    assert by_peer.returncode == 0, by_peer.stderr
    for f in checkpoint.glob("*.safetensors"):
        assert (pod_b.dest("models") / f.name).read_bytes() == f.read_bytes()
    # and a tag with the origin down is a typed error naming the origin, never a peer's answer
    tag = run_initializer(pod_b, [f"modelpack://{model.tagged}", str(pod_b.dest("tag"))], env_b)
    assert tag.returncode != 0 and origin.host in tag.stderr and "Traceback" not in tag.stderr
