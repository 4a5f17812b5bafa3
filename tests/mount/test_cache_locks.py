"""Concurrency in the node cache: single-flight, file locks, stale holders, lock-free safety."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from modelpack.mount import NodeCache
from modelpack.mount.locks import SingleFlight, acquire, is_locked

from modelpack.events import read_events
from modelpack.oci.descriptor import Manifest
from modelpack.targets.layout import OCILayoutTarget
from tests.mount.test_cache_support import FaultySource, pack_layout

pytestmark = pytest.mark.timeout(120)


def _pull_all(caches: list[NodeCache], ref: str, src: FaultySource) -> list[str]:
    paths: list[str] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(caches))

    def run(c: NodeCache) -> None:
        try:
            barrier.wait()
            paths.append(c.pull(ref, source=src).path)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(c,)) for c in caches]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return paths


@pytest.fixture
def layout(checkpoint: Path, tmp_path: Path) -> tuple[OCILayoutTarget, Manifest]:
    return pack_layout(checkpoint, tmp_path)


def test_eight_threads_one_cache_fetch_each_blob_once(
    layout: tuple[OCILayoutTarget, Manifest], tmp_path: Path
) -> None:
    target, manifest = layout
    cache = NodeCache(str(tmp_path / "cache"))
    src = FaultySource(target)
    paths = _pull_all([cache] * 8, f"oci:{target.path}:v1", src)
    assert len(set(paths)) == 1
    sizes = {str(d.digest): d.size for d in [manifest.config, *manifest.layers]}
    assert src.served == sizes  # every blob served exactly once, fully


def test_separate_cache_objects_serialise_on_the_file_lock(
    layout: tuple[OCILayoutTarget, Manifest], tmp_path: Path
) -> None:
    target, manifest = layout
    caches = [NodeCache(str(tmp_path / "cache")) for _ in range(4)]  # no shared in-process state
    src = FaultySource(target)
    _pull_all(caches, f"oci:{target.path}:v1", src)
    sizes = {str(d.digest): d.size for d in [manifest.config, *manifest.layers]}
    assert src.served == sizes


def test_correctness_does_not_depend_on_the_lock(
    layout: tuple[OCILayoutTarget, Manifest], tmp_path: Path
) -> None:
    """With every lock treated as stale at once, writers race lock-free: still one valid result."""
    target, manifest = layout
    caches = [NodeCache(str(tmp_path / "cache"), stale_after=-1.0) for _ in range(4)]
    src = FaultySource(target)
    paths = _pull_all(caches, f"oci:{target.path}:v1", src)
    assert len(set(paths)) == 1
    cache = NodeCache(str(tmp_path / "cache"))
    assert [e.digest for e in cache.ls()] == [manifest.digest]
    assert all(r.ok for r in cache.verify())
    assert not [p for p in os.listdir(cache.store.ingest_dir) if not p.endswith(".partial")]


HOLDER = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
os.utime(sys.argv[1], (1, 1))  # last heartbeat long ago: a hung holder
print("locked", flush=True)
time.sleep(120)
"""


def test_a_hung_lock_holder_does_not_block_forever(
    layout: tuple[OCILayoutTarget, Manifest], tmp_path: Path
) -> None:
    target, manifest = layout
    cache = NodeCache(str(tmp_path / "cache"), stale_after=0.5)
    big = max(manifest.layers, key=lambda x: x.size)
    lock = cache.store.lock_path(big.digest)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, lock], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        assert is_locked(lock)
        res = cache.pull(f"oci:{target.path}:v1")
        assert res.state == "cold" and holder.poll() is None  # the holder is still alive and locked
        stale = [e for e in read_events(cache.events_path) if e["event"] == "cache.lock_stale"]
        assert stale and stale[0]["blob"] == big.digest
        assert all(r.ok for r in cache.verify())
    finally:
        holder.kill()
        holder.wait()


def test_a_killed_holder_releases_its_lock(tmp_path: Path) -> None:
    lock = str(tmp_path / "locks" / "x.lock")
    os.makedirs(os.path.dirname(lock))
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, lock], stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
    holder.kill()
    holder.wait()
    held = acquire(lock, stale_after=3600, timeout=5)
    try:
        assert held.exclusive and not held.stale
    finally:
        held.release()


def test_single_flight_shares_one_result_and_errors() -> None:
    sf: SingleFlight[int] = SingleFlight()
    calls = []
    gate = threading.Event()

    def work() -> int:
        calls.append(1)
        gate.wait(5)
        return 42

    out: list[tuple[int, bool]] = []
    threads = [threading.Thread(target=lambda: out.append(sf.do("k", work))) for _ in range(5)]
    for t in threads:
        t.start()
    time.sleep(0.2)
    gate.set()
    for t in threads:
        t.join()
    assert len(calls) == 1 and sorted(out) == [(42, False)] + [(42, True)] * 4

    def boom() -> int:
        raise ValueError("x")

    with pytest.raises(ValueError):
        sf.do("k", boom)
    assert sf.do("k", lambda: 7) == (7, False)  # a failure is not cached
