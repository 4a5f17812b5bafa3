"""GC's one plan: what it keeps for peers, what a live writer is writing, and that a dry run
predicts the real run exactly.

Real parts: a real origin registry, real signed pushes, real ``pull --cache`` / ``cache gc`` /
``cache serve`` subprocesses, a real node cache and its blob writer. What is attacked: a GC that
evicts nothing must not take the signatures a peer serves; a download whose temp file has an
old mtime (a clock step, a restored backup) must not lose it to GC; a dry run must not under-
or over-state what the real run deletes; blobs a node filled for its peers stay while pinned.
"""

from __future__ import annotations

import fcntl
import io
import json
import os
import threading
import time
from pathlib import Path
from typing import Any, BinaryIO

import pytest
from modelpack.mount.cache import NodeCache
from modelpack.mount.ingest import BlobIngest
from modelpack.mount.kept_referrers import kept_referrers

from modelpack.files import TEMP_PREFIX
from modelpack.oci.descriptor import Descriptor
from modelpack.testdata.synthetic import SyntheticSpec, write_checkpoint
from tests.mount.test_cache_serve import serve  # noqa: F401 (the fixture)
from tests.origin_down_support import push_signed, run, signed_peer, warm_node
from tests.signing_helpers import pack_layout

pytestmark = pytest.mark.timeout(300)

HOUR = 3600.0


def test_gc_that_evicts_nothing_keeps_the_signatures_a_peer_serves_with_the_origin_down(
    registry_factory: Any,
    checkpoint: Path,
    tmp_path: Path,
    serve: Any,  # noqa: F811
) -> None:
    """A plain ``cache gc`` on node A (nothing to evict) keeps the signature referrers A kept for
    its peers: with the origin down, a signed pull through A's ``cache serve`` still verifies."""
    origin, model, peer = signed_peer(registry_factory, checkpoint, tmp_path, serve, "gc/keeps")
    node_a = tmp_path / "node-a"
    before = len(kept_referrers(NodeCache(str(node_a)).store, model.digest))
    assert before == 3

    dry = run(tmp_path, "cache", "gc", "--cache", str(node_a), "--dry-run", "--json")
    real = run(tmp_path, "cache", "gc", "--cache", str(node_a), "--json")
    assert dry.returncode == 0 and real.returncode == 0, (dry.stderr, real.stderr)
    assert json.loads(real.stdout)["bytesFreed"] == json.loads(dry.stdout)["bytesFreed"] == 0
    assert len(kept_referrers(NodeCache(str(node_a)).store, model.digest)) == before

    origin.kill()
    b = run(
        tmp_path,
        "pull", "--cache", str(tmp_path / "node-b"), "--key", model.pub, "--mirror", peer.url,
        "--retry-for", "2s", "--json", model.pinned,
    )  # fmt: skip
    assert b.returncode == 0, b.stderr
    assert json.loads(b.stdout)["signature"] == "verified"


def _stale_temp(cache: NodeCache, name: str, size: int) -> Path:
    """A temp file nobody writes any more, last touched an hour ago."""
    path = Path(cache.store.ingest_dir) / f"{TEMP_PREFIX}{name}"
    path.write_bytes(b"x" * size)
    os.utime(path, (time.time() - 2 * HOUR, time.time() - 2 * HOUR))
    return path


def test_a_dry_run_reports_exactly_what_the_real_run_deletes(
    registry_factory: Any, checkpoint: Path, tmp_path: Path
) -> None:
    """On a cache with a pinned signed model (and its kept referrers), an evictable snapshot, a
    stale temp file and a live writer's temp file, ``--dry-run`` lists the same items and bytes
    the real run then removes; the kept referrers and the live temp file survive both."""
    origin = registry_factory.start()
    signed = push_signed(origin, checkpoint, tmp_path, "gc/signed")
    second = tmp_path / "ckpt-2"
    write_checkpoint(str(second), SyntheticSpec(shards=1, seed=7))
    other = push_signed(origin, second, tmp_path, "gc/other")
    node = tmp_path / "node"
    warm_node(tmp_path, node, signed)
    warm_node(tmp_path, node, other, key=False)
    cache = NodeCache(str(node))
    cache.pin(signed.pinned)
    stale = _stale_temp(cache, "stale-1", 1000)
    live = Path(cache.store.ingest_dir) / f"{TEMP_PREFIX}live-{os.getpid()}-1"
    fd = os.open(live, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # a writer that is still writing
        os.write(fd, b"y" * 500)
        os.utime(live, (time.time() - 2 * HOUR, time.time() - 2 * HOUR))

        dry = cache.gc(max_bytes=1, min_age=0, dry_run=True)
        assert stale.exists()
        real = cache.gc(max_bytes=1, min_age=0)
    finally:
        os.close(fd)
    assert real.evicted == dry.evicted and real.evicted, (dry.to_json(), real.to_json())
    assert dry.to_json()["plan"] == real.to_json()["plan"]
    assert dry.bytes_freed == real.bytes_freed > 1000
    assert not stale.exists() and live.exists()
    assert len(kept_referrers(cache.store, signed.digest)) == 3


class _PausingSource:
    """A real OCI layout target whose blob stream stops after the first chunk until released."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.started = threading.Event()
        self.release = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def fetch_blob(self, descriptor: Descriptor, offset: int = 0) -> BinaryIO:
        data = self.inner.fetch_blob(descriptor, offset).read()
        outer = self

        class Stream(io.RawIOBase):
            pos = 0

            def readable(self) -> bool:
                return True

            def readinto(self, buf: Any) -> int:
                if self.pos > 0 and not outer.release.is_set():
                    outer.started.set()
                    outer.release.wait(60)
                n = min(len(buf), len(data) - self.pos, 4096)
                buf[:n] = data[self.pos : self.pos + n]
                self.pos += n
                return n

        return io.BufferedReader(Stream(), buffer_size=4096)  # type: ignore[return-value]


def test_gc_keeps_a_live_writers_temp_file_whatever_its_mtime(checkpoint: Path, tmp_path: Path) -> None:
    """A download writing to a private temp file (its digest lock was taken over from a stale
    holder) keeps that file through GC even when its mtime is an hour in the past: the writer's
    lock says it is live; the download then completes. An unlocked stale temp file goes."""
    lay = pack_layout(checkpoint, tmp_path / "layout")
    desc = max(lay.manifest.layers, key=lambda d: d.size)
    assert desc.size > 3 * 4096
    cache = NodeCache(str(tmp_path / "cache"))
    # a holder of the digest lock that stopped beating: the download takes it over after 0.2 s
    lock_fd = os.open(cache.store.lock_path(desc.digest), os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(lock_fd, fcntl.LOCK_EX)
    source = _PausingSource(lay.target)
    outcome: list[Any] = []

    def download() -> None:
        try:
            outcome.append(BlobIngest(cache.store, stale_after=0.2).ingest(desc, source))
        except Exception as exc:  # reported below
            outcome.append(exc)

    worker = threading.Thread(target=download)
    worker.start()
    try:
        assert source.started.wait(30)
        temps = [p for p in Path(cache.store.ingest_dir).iterdir() if p.name.startswith(TEMP_PREFIX)]
        assert len(temps) == 1, temps
        live = temps[0]
        os.utime(live, (time.time() - HOUR - 60, time.time() - HOUR - 60))
        stale = _stale_temp(cache, "dead-writer", 10)
        res = cache.gc(min_age=0)
        assert live.exists(), res.to_json()
        assert not stale.exists()
    finally:
        source.release.set()
        worker.join(60)
        os.close(lock_fd)
    assert len(outcome) == 1 and not isinstance(outcome[0], Exception), outcome
    assert cache.store.has(desc)


def test_blobs_a_node_filled_for_its_peers_stay_until_the_fill_pin_is_released(
    registry: Any,
    checkpoint: Path,
    tmp_path: Path,
    serve: Any,  # noqa: F811
) -> None:
    """``cache serve --fill REF@D`` pins D: a plain ``cache gc`` keeps the manifest and every blob
    the node filled for its peers (it never pulled them as a snapshot); ``cache unpin`` releases
    them and the next gc frees them."""
    from modelpack.mount.store import Store

    from tests.mount.test_cache_serve_fill import _push

    digest, manifest = _push(registry, checkpoint, "fill/kept")
    pinned = f"{registry.host}/fill/kept@{digest}"
    owner_cache = tmp_path / "owner"
    Store(str(owner_cache))
    owner = serve(owner_cache, "--fill", pinned)
    b = run(
        tmp_path,
        "pull",
        "--cache",
        str(tmp_path / "node-b"),
        "--retry-for",
        "5s",
        "--mirror",
        owner.url,
        pinned,
    )
    assert b.returncode == 0, b.stderr
    store = NodeCache(str(owner_cache)).store
    filled = [d for d in (manifest.config, *manifest.layers) if store.has(d)]
    assert len(filled) == 1 + len(manifest.layers)

    gc = run(tmp_path, "cache", "gc", "--cache", str(owner_cache), "--min-age", "0s", "--json")
    assert gc.returncode == 0, gc.stderr
    assert json.loads(gc.stdout)["blobsRemoved"] == 0
    assert all(store.has(d) for d in filled)

    assert run(tmp_path, "cache", "unpin", pinned, "--cache", str(owner_cache)).returncode == 0
    dry = json.loads(run(tmp_path, "cache", "gc", "--cache", str(owner_cache), "--dry-run", "--json").stdout)
    real = json.loads(run(tmp_path, "cache", "gc", "--cache", str(owner_cache), "--json").stdout)
    assert dry["plan"] == real["plan"] and real["blobsRemoved"] == len(filled) + 1  # and the manifest
    assert not any(store.has(d) for d in filled)


def test_an_index_a_node_fills_for_its_peers_keeps_every_entry_until_unpinned(
    registry: Any,
    tmp_path: Path,
    serve: Any,  # noqa: F811
) -> None:
    """``cache serve --fill REF@<index>`` keeps the index, every entry's manifest and every
    entry's blobs through a plain ``cache gc`` (the index pin keeps its entries); after
    ``cache unpin`` the dry run and the real run free the same: all of it."""
    from modelpack.mount.store import Store

    from tests.mount.test_cache_fill_faults import variant_index
    from tests.mount.test_cache_serve import _request

    index, entries = variant_index(registry, tmp_path, "fill/kept-index")
    pinned = f"{registry.host}/fill/kept-index@{index}"
    owner_cache = tmp_path / "owner"
    Store(str(owner_cache))
    owner = serve(owner_cache, "--fill", pinned)
    blobs = [d for m in entries.values() for d in (m.config, *m.layers)]
    for d in blobs:
        assert _request(owner, "GET", f"/v2/any/name/blobs/{d.digest}")[0] == 200
    store = NodeCache(str(owner_cache)).store
    kept = {*entries, index, *(str(d.digest) for d in blobs)}
    assert all(os.path.exists(store.blob_path(d)) for d in kept)

    gc = run(tmp_path, "cache", "gc", "--cache", str(owner_cache), "--min-age", "0s", "--json")
    assert gc.returncode == 0, gc.stderr
    assert json.loads(gc.stdout)["blobsRemoved"] == 0
    assert all(os.path.exists(store.blob_path(d)) for d in kept)

    assert run(tmp_path, "cache", "unpin", pinned, "--cache", str(owner_cache)).returncode == 0
    dry = json.loads(run(tmp_path, "cache", "gc", "--cache", str(owner_cache), "--dry-run", "--json").stdout)
    real = json.loads(run(tmp_path, "cache", "gc", "--cache", str(owner_cache), "--json").stdout)
    assert dry["plan"] == real["plan"] and real["blobsRemoved"] == len(kept)
    assert not any(os.path.exists(store.blob_path(d)) for d in kept)
