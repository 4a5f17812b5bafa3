"""GC: LRU order, keep-versions per repository, max-bytes, pins, leases, deletion order."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from modelpack.mount import NodeCache

from modelpack import api
from modelpack.events import read_events
from modelpack.testdata.synthetic import SyntheticSpec, write_checkpoint


def _versions(tmp_path: Path, n: int, repo: str = "layout") -> tuple[str, list[str]]:
    """``n`` versions of one model in one layout (tags v0…); they share most blobs' shapes but
    not bytes (different seeds), like successive fine-tunes."""
    layout = tmp_path / repo
    digests = []
    for i in range(n):
        ck = tmp_path / f"{repo}-ck{i}"
        write_checkpoint(str(ck), SyntheticSpec(seed=i))
        digests.append(str(api.pack(str(ck), f"oci:{layout}:v{i}").artifact.digest))
    return str(layout), digests


def _touch_order(cache: NodeCache, digests: list[str]) -> None:
    """Make ``digests`` used in this order (oldest first) with distinct, increasing mtimes."""
    for i, d in enumerate(digests):
        os.utime(cache.snapshots.lease_path(d), (1_000_000 + i, 1_000_000 + i))


def test_keep_versions_is_per_repository_and_lru(tmp_path: Path) -> None:
    layout_a, a = _versions(tmp_path, 3, "a")
    layout_b, b = _versions(tmp_path, 2, "b")
    cache = NodeCache(str(tmp_path / "cache"))
    for i in range(3):
        cache.pull(f"oci:{layout_a}:v{i}")
    for i in range(2):
        cache.pull(f"oci:{layout_b}:v{i}")
    # in repository a, v1 was used last, then v2, then v0: LRU keeps v1 and v2
    _touch_order(cache, [a[0], a[2], a[1], b[0], b[1]])
    res = cache.gc(keep_versions=2, min_age=0)
    assert res.evicted == [a[0]]
    assert {e.digest for e in cache.ls()} == {a[1], a[2], b[0], b[1]}
    res = cache.gc(keep_versions=1, min_age=0)
    assert sorted(res.evicted) == sorted([a[2], b[0]])
    # blobs of evicted versions are gone; the kept ones are intact
    assert all(r.ok for r in cache.verify())
    live = set(cache.store.blob_digests())
    for d in (a[0], a[2], b[0]):
        assert d not in live
    events = [e for e in read_events(cache.events_path) if e["event"] == "cache.evict"]
    assert [e["digest"] for e in events] == [a[0], a[2], b[0]]  # least recently used first
    assert all(e["reason"] == "keep_versions" for e in events)


def test_max_bytes_evicts_least_recently_used_first_and_stops_when_under(tmp_path: Path) -> None:
    layout, d = _versions(tmp_path, 3)
    cache = NodeCache(str(tmp_path / "cache"))
    for i in range(3):
        cache.pull(f"oci:{layout}:v{i}")
    _touch_order(cache, [d[1], d[0], d[2]])
    per_model = cache.usage() // 3
    res = cache.gc(max_bytes=2 * per_model + per_model // 2, min_age=0)  # room for two
    assert res.evicted == [d[1]]
    assert res.bytes_after <= 2 * per_model + per_model // 2 < res.bytes_before
    dry = cache.gc(max_bytes=0, dry_run=True, min_age=0)
    assert sorted(dry.evicted) == sorted([d[0], d[2]]) and len(cache.ls()) == 2  # nothing deleted


def test_pinned_and_in_use_survive_max_bytes_zero(tmp_path: Path) -> None:
    layout, d = _versions(tmp_path, 3)
    cache = NodeCache(str(tmp_path / "cache"))
    for i in range(3):
        cache.pull(f"oci:{layout}:v{i}")
    cache.pin(f"oci:{layout}:v0")
    with cache.open_snapshot(f"oci:{layout}:v1") as snap:
        res = cache.gc(max_bytes=0, keep_versions=0, min_age=0)
        assert res.evicted == [d[2]]
        assert res.kept_pinned == [d[0]] and res.kept_in_use == [d[1]]
        assert (Path(snap.path) / "config.json").read_bytes()  # still readable mid-GC
    assert {e.digest for e in cache.ls()} == {d[0], d[1]}
    # refs of the evicted model went first; its snapshot and blobs too
    assert not os.path.exists(cache.snapshots.path(d[2]))
    assert len(os.listdir(cache.refs_dir)) == 2
    res = cache.gc(max_bytes=0, min_age=0)  # lease released: v1 goes now, the pinned v0 stays
    assert res.evicted == [d[1]] and [e.digest for e in cache.ls()] == [d[0]]
    cache.unpin(f"oci:{layout}:v0")
    assert cache.gc(max_bytes=0, min_age=0).evicted == [d[0]]
    assert cache.store.blob_digests() == [] and cache.usage() == 0


def test_gc_removes_orphans_of_a_crashed_pull_but_not_its_partials(tmp_path: Path) -> None:
    layout, d = _versions(tmp_path, 1)
    cache = NodeCache(str(tmp_path / "cache"))
    res = cache.pull(f"oci:{layout}:v0")
    # simulate a pull that died after committing blobs and storing its manifest, before publishing
    os.unlink(cache.snapshots.marker_path(d[0]))
    partial = Path(cache.store.partial_path("sha256:" + "2" * 64))
    partial.write_bytes(b"resume me")
    out = cache.gc()
    assert out.evicted == [] and cache.store.manifest_digests() == []
    assert cache.store.blob_digests() == []
    assert partial.exists()  # a young partial stays for the next pull to resume
    assert not os.path.exists(res.path) and res.path in out.swept  # never ready: removed
    again = cache.pull(f"oci:{layout}:v0")
    assert again.state == "cold" and all(r.ok for r in cache.verify())


# ------------------------------------------------------------------ linear GC
TINY = {"hidden": 16, "intermediate": 32, "layers": 1, "heads": 2, "kv_heads": 1, "vocab": 32}


def _tiny_versions(tmp_path: Path, start: int, n: int) -> str:
    layout = tmp_path / "tiny"
    for i in range(start, start + n):
        ck = tmp_path / f"tiny-ck{i}"
        write_checkpoint(str(ck), SyntheticSpec(seed=i, **TINY))  # type: ignore[arg-type]
        api.pack(str(ck), f"oci:{layout}:v{i}")
    return str(layout)


def _gc_stat_calls(cache_root: str, tmp_path: Path) -> int:
    """stat-family system calls of one real ``cache gc`` process that would evict everything."""
    out = tmp_path / "strace.txt"
    modelpack = str(Path(sys.executable).with_name("modelpack"))
    args = ["cache", "gc", "--cache", cache_root, "--max-bytes", "1", "--min-age", "0", "--dry-run", "--json"]
    subprocess.run(
        ["strace", "-f", "-qq", "-c", "-e", "trace=%stat,%lstat,%fstat", "-o", str(out), modelpack, *args],
        check=True,
        capture_output=True,
        timeout=120,
    )
    total = [line.split() for line in out.read_text().splitlines() if line.strip().endswith("total")]
    return int(total[0][3])


def test_gc_stat_work_grows_linearly_with_the_number_of_snapshots(tmp_path: Path) -> None:
    """Before: every candidate re-counted every snapshot's blobs (O(n²) stats under the lock)."""
    cache = NodeCache(str(tmp_path / "cache"))
    base = _gc_stat_calls(cache.root, tmp_path)  # interpreter start-up and imports
    small, large = 15, 45
    layout = _tiny_versions(tmp_path, 0, small)
    for i in range(small):
        cache.pull(f"oci:{layout}:v{i}")
    per_snapshot_small = (_gc_stat_calls(cache.root, tmp_path) - base) / small
    _tiny_versions(tmp_path, small, large - small)
    for i in range(small, large):
        cache.pull(f"oci:{layout}:v{i}")
    per_snapshot_large = (_gc_stat_calls(cache.root, tmp_path) - base) / large
    print(
        f"stat calls per snapshot: {per_snapshot_small:.1f} at {small}, {per_snapshot_large:.1f} at {large}"
    )
    assert per_snapshot_large <= 1.25 * per_snapshot_small + 2, (per_snapshot_small, per_snapshot_large)
    res = cache.gc(max_bytes=1, min_age=0)
    assert len(res.evicted) == large and cache.store.blob_digests() == []
