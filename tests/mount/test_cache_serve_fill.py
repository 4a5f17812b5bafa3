"""``cache serve --fill`` — the owner peer fetches a missing blob once from the origin.

Real parts: a real origin registry, real ``cache serve`` and ``modelpack pull --cache``
subprocesses on loopback; the test plays the hostile requester with raw HTTP. What is attacked:
a request for a digest nobody pinned (must not reach the origin), a flood of requests (one
origin fetch per blob, bounded waiting), and an origin serving wrong bytes (nothing committed).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import http.client
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from modelpack.api import transfer
from modelpack.oci.descriptor import Manifest
from modelpack.targets.fetch import fetch_manifest
from modelpack.targets.opener import open_readable
from modelpack.testdata.synthetic import SyntheticSpec, write_checkpoint
from tests.fixtures.faultproxy import FaultProxy
from tests.fixtures.registry import RegistryServer
from tests.mount.test_cache_serve import (
    _cli,
    _env,
    _request,
    _same,
    serve,  # noqa: F401 (the fixture)
)

pytestmark = pytest.mark.timeout(180)


def _push(origin: RegistryServer, checkpoint: Path, repo: str) -> tuple[str, Manifest]:
    res = transfer.push(str(checkpoint), origin.ref(repo, "v1"), progress="off")
    manifest, _ = fetch_manifest(open_readable(origin.ref(repo, None)), res.digest)
    return str(res.digest), manifest


def _blob_gets(origin: RegistryServer, mark: int) -> dict[str, int]:
    """Origin GETs per blob digest after ``mark`` (the access log)."""
    out: dict[str, int] = {}
    for method, path, status in origin.requests_since(mark):
        if method == "GET" and "/blobs/sha256:" in path and status in (200, 206):
            digest = path.rsplit("/", 1)[1]
            out[digest] = out.get(digest, 0) + 1
    return out


def _empty_cache(tmp_path: Path, name: str) -> Path:
    """A node cache with nothing in it yet (a storm at t=0): a pull of nothing creates it."""
    from modelpack.mount.store import Store

    root = tmp_path / name
    Store(str(root))
    return root


def test_two_nodes_pulling_through_an_empty_owner_cost_the_origin_one_copy(
    registry: RegistryServer,
    checkpoint: Path,
    tmp_path: Path,
    serve: Any,  # noqa: F811 (the fixture imported above)
) -> None:
    digest, manifest = _push(registry, checkpoint, "fill/model")
    pinned = f"{registry.host}/fill/model@{digest}"
    owner_cache = _empty_cache(tmp_path, "owner")
    owner = serve(owner_cache, "--fill", pinned)
    mark = registry.log_mark()

    def pull(name: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            _cli("pull", "--cache", str(tmp_path / name), "--retry-for", "5s", "--mirror", owner.url, pinned),
            env=_env(tmp_path),
            capture_output=True,
            text=True,
            timeout=120,
        )

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        results = list(pool.map(pull, ["node-b", "node-c"]))
    for res in results:
        assert res.returncode == 0, res.stderr
        _same(res.stdout, checkpoint)
    gets = _blob_gets(registry, mark)
    wanted = {str(d.digest) for d in (manifest.config, *manifest.layers)}
    # every blob crossed the origin's link once (the owner's fill), never once per node
    assert set(gets) == wanted, gets
    assert all(n == 1 for n in gets.values()), gets
    # and the owner now holds the blobs, committed read-only like any pulled blob
    for d in manifest.layers:
        st = (owner_cache / "blobs" / "sha256" / d.digest.hex).stat()
        assert st.st_size == d.size and not st.st_mode & 0o222


def test_a_digest_nobody_pinned_is_never_fetched_and_a_flood_costs_one_fetch(
    registry: RegistryServer,
    checkpoint: Path,
    tmp_path: Path,
    serve: Any,  # noqa: F811 (the fixture imported above)
) -> None:
    digest, manifest = _push(registry, checkpoint, "fill/pinned")
    other_dir = tmp_path / "other"
    write_checkpoint(str(other_dir), SyntheticSpec(shards=1, seed=7))
    _other_digest, other = _push(registry, other_dir, "fill/pinned")  # same repo, not pinned
    cache = _empty_cache(tmp_path, "owner")
    owner = serve(cache, "--fill", f"{registry.host}/fill/pinned@{digest}")
    mark = registry.log_mark()

    unrelated = max(other.layers, key=lambda d: d.size)
    # the requester may name any repository: the fill never uses it, and never fetches this digest
    for path in (
        f"/v2/fill/pinned/blobs/{unrelated.digest}",
        f"/v2/elsewhere/blobs/{unrelated.digest}",
        f"/v2/fill/pinned/blobs/sha256:{hashlib.sha256(b'nothing').hexdigest()}",
        f"/v2/fill/pinned/manifests/{_other_digest}",
    ):
        assert _request(owner, "GET", path)[0] == 404, path
    assert not (cache / "blobs" / "sha256" / unrelated.digest.hex).exists()
    assert _blob_gets(registry, mark) == {}

    # a flood for one pinned blob: one origin fetch, every answer the right bytes or "ask elsewhere"
    layer = max(manifest.layers, key=lambda d: d.size)
    want = (checkpoint / layer.annotations["org.opencontainers.image.title"]).read_bytes()  # type: ignore[index]

    def get(_: int) -> tuple[int, bytes]:
        status, _h, body = _request(owner, "GET", f"/v2/any/name/blobs/{layer.digest}")
        return status, body

    with concurrent.futures.ThreadPoolExecutor(24) as pool:
        answers = list(pool.map(get, range(48)))
    assert all(s in (200, 503) for s, _ in answers), {s for s, _ in answers}
    assert any(s == 200 for s, _ in answers)
    assert all(body == want for s, body in answers if s == 200)
    assert _blob_gets(registry, mark) == {str(layer.digest): 1}


def test_an_origin_serving_wrong_bytes_commits_nothing_and_is_not_asked_again_at_once(
    registry_factory: Any,
    checkpoint: Path,
    tmp_path: Path,
    serve: Any,  # noqa: F811 (the fixture imported above)
) -> None:
    origin = registry_factory.start()
    digest, manifest = _push(origin, checkpoint, "fill/lying")
    layer = max(manifest.layers, key=lambda d: d.size)
    data_path = origin.blob_data_path(str(layer.digest))
    size = data_path.stat().st_size
    with open(data_path, "r+b") as f:  # same length, other bytes: only the digest can tell
        f.write(b"\0" * min(size, 4096))
    cache = _empty_cache(tmp_path, "owner")
    # a link slow enough that the fill is still running when its requester starts to stream (at
    # loopback speed the wrong blob could be fetched and refused before the request handler
    # followed the fill: a plain 404 then, and this test failed 2 runs in 5)
    link = FaultProxy(origin.host, rate=1024 * 1024)
    owner = serve(cache, "--fill", f"{link.host}/fill/lying@{digest}")
    mark = origin.log_mark()

    # the fill streams to its requester as the bytes land; failing the digest, it cuts the
    # response before its last byte (the requester never holds a complete wrong blob)
    try:
        with pytest.raises(http.client.IncompleteRead) as cut:
            _request(owner, "GET", f"/v2/fill/lying/blobs/{layer.digest}")
    finally:
        link.close()
    assert len(cut.value.partial) < size
    assert not (cache / "blobs" / "sha256" / layer.digest.hex).exists()
    assert [p.name for p in (cache / "ingest").iterdir()] == []  # no temp file left behind
    # asked again at once: refused without another origin fetch (a flood cannot multiply it)
    for _ in range(5):
        assert _request(owner, "GET", f"/v2/fill/lying/blobs/{layer.digest}")[0] == 404
    assert _blob_gets(origin, mark) == {str(layer.digest): 1}
    # and a puller through this owner is not misled: it finishes from the origin and refuses the bad bytes
    time.sleep(0.1)
    res = subprocess.run(
        _cli(
            "pull",
            "--cache",
            str(tmp_path / "node-b"),
            "--retry-for",
            "2s",
            "--mirror",
            owner.url,
            f"{origin.host}/fill/lying@{digest}",
        ),
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert str(layer.digest) in res.stderr
    assert not os.path.exists(tmp_path / "node-b" / "blobs" / "sha256" / layer.digest.hex)


def test_with_the_origin_down_a_flood_of_misses_is_answered_within_one_short_budget(
    registry_factory: Any,
    checkpoint: Path,
    tmp_path: Path,
    serve: Any,  # noqa: F811 (the fixture imported above)
) -> None:
    origin = registry_factory.start()
    digest, manifest = _push(origin, checkpoint, "fill/down")
    cache = _empty_cache(tmp_path, "owner")
    owner = serve(cache, "--fill", f"{origin.host}/fill/down@{digest}")
    origin.kill()
    layer = max(manifest.layers, key=lambda d: d.size)
    t0 = time.monotonic()
    for _ in range(10):
        assert _request(owner, "GET", f"/v2/fill/down/blobs/{layer.digest}")[0] == 404
    # one manifest fetch within the fill's 5 s origin budget, then misses without asking again
    assert time.monotonic() - t0 < 12
    assert owner.proc.poll() is None


def test_with_blob_order_every_node_asks_the_same_owner_first_and_owners_spread(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``MODELPACK_PEER_ORDER=blob``: the peers of a ``dns+`` name are ranked per blob, the same on
    every node (else each owner would be asked by only some nodes and the origin would serve
    each blob once per owner); a ``--mirror`` that is not a peer keeps its place; the node's own
    address stays in the set (it may own blobs)."""
    from modelpack.oci.descriptor import Descriptor
    from modelpack.oci.digest import Digest
    from modelpack.targets.registry.client import RegistryClient
    from modelpack.targets.registry.mirrors import MirroredBlobs, configured_mirrors
    from modelpack.targets.registry.repository import RepositoryAPI

    monkeypatch.setenv("MODELPACK_HOSTS_DIR", str(tmp_path / "none"))
    monkeypatch.setenv("MODELPACK_PEER_ORDER", "blob")
    monkeypatch.setenv("MODELPACK_NODE_IP", "127.0.0.1")
    blobs = [Descriptor("application/octet-stream", Digest.from_bytes(b"%d" % i), 1) for i in range(64)]

    def owners(node: str) -> list[str]:
        monkeypatch.setenv("MODELPACK_NODE_NAME", node)
        # localhost resolves to 127.0.0.1 (and maybe ::1): the own address is kept in blob order
        endpoints = configured_mirrors(
            "origin.example:5000", ["http://mirror.example:5000", "dns+http://localhost:5050"], None
        )
        assert endpoints[0].host == "mirror.example:5000" and not endpoints[0].peer
        assert any(e.host == "127.0.0.1:5050" and e.peer for e in endpoints)
        fake_peers = [
            type(endpoints[1])(host=f"10.231.0.{i}:5050", plain_http=True, peer=True) for i in range(1, 9)
        ]
        mirrors = MirroredBlobs(
            RepositoryAPI(RegistryClient("origin.example:5000", plain_http=True), "m"),
            [endpoints[0], *fake_peers],
        )
        order = [mirrors._for_blob(b) for b in blobs]
        assert all(o[0].name == "mirror.example:5000" for o in order)  # not a peer: first, as configured
        return [o[1].name for o in order]

    first = owners("node-a")
    assert owners("node-b") == first == owners("node-c")  # the same owner on every node
    counts = {name: first.count(name) for name in set(first)}
    assert len(counts) == 8 and max(counts.values()) <= 16, counts  # 64 blobs spread over 8 peers
    monkeypatch.setenv("MODELPACK_PEER_ORDER", "node")
    monkeypatch.setenv("MODELPACK_NODE_NAME", "node-a")
    node_order = configured_mirrors("origin.example:5000", ["dns+http://localhost:5050"], None)
    assert all(e.host != "127.0.0.1:5050" for e in node_order)  # node order leaves itself out


def test_fill_on_a_node_with_no_cache_yet_creates_it_as_pull_does_and_serves(
    registry: RegistryServer,
    checkpoint: Path,
    tmp_path: Path,
    serve: Any,  # noqa: F811 (the fixture imported above)
) -> None:
    """``cache serve --fill`` on a node whose cache directory does not exist yet (a DaemonSet's
    first rollout) creates the cache with the owner and modes ``pull --cache`` gives it, starts,
    and fills a pinned blob; without ``--fill`` (read-only) a missing cache is still refused."""
    digest, manifest = _push(registry, checkpoint, "fill/fresh")
    cache = tmp_path / "node" / "cache"
    peer = serve(cache, "--fill", f"{registry.ref('fill/fresh', None)}@{digest}")
    assert _request(peer, "GET", "/v2/")[0] == 200
    layer = manifest.layers[0]
    status, _, body = _request(peer, "GET", f"/v2/fill/fresh/blobs/{layer.digest}")
    assert status == 200 and hashlib.sha256(body).hexdigest() == str(layer.digest).split(":", 1)[1]
    pulled = tmp_path / "pulled"
    subprocess.run(
        [*_cli("pull", registry.ref("fill/fresh", "v1"), "--cache", str(pulled))],
        check=True,
        capture_output=True,
        env=_env(tmp_path),
        timeout=120,
    )
    for rel in ("", "blobs", "blobs/sha256", "ingest", "locks", "oci-layout", "index.json"):
        assert (cache / rel).stat().st_mode & 0o7777 == (pulled / rel).stat().st_mode & 0o7777, rel
        assert (cache / rel).stat().st_uid == os.getuid()
    read_only = subprocess.run(
        _cli("cache", "serve", "--cache", str(tmp_path / "none"), "--listen", "127.0.0.1:0"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert read_only.returncode == 1 and "no node cache here" in read_only.stderr
    assert not (tmp_path / "none").exists()
