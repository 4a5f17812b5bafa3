"""Node cache on an OCI-layout source: store layout, verified commit, resume, snapshots, markers.

The registry-backed fault tests are in ``test_cache_registry.py``; these cover the guarantees
that need no server (and run fast) from
docs/node.md#guarantees-and-the-tests-that-try-to-break-them:
the store's layout, verified commit and resume, interrupted downloads and temp files, atomic
publish, tags resolved once.
"""

from __future__ import annotations

import os
import stat
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from modelpack.mount import NodeCache

from modelpack import api
from modelpack.errors import DigestMismatchError, ModelpackError, NotFoundError, SnapshotInUseError
from modelpack.events import read_events
from modelpack.files import TEMP_PREFIX
from modelpack.oci.descriptor import Manifest
from modelpack.oci.digest import sha256_file
from modelpack.targets.layout import OCILayoutTarget
from tests.mount.test_cache_support import FaultySource, Interrupted, pack_layout


def _ev(cache: NodeCache, name: str) -> list[dict[str, Any]]:
    return [e for e in read_events(cache.events_path) if e["event"] == name]


@pytest.fixture
def layout(checkpoint: Path, tmp_path: Path) -> tuple[OCILayoutTarget, Manifest]:
    return pack_layout(checkpoint, tmp_path)


def test_snapshot_is_hardlinked_read_only_and_the_store_is_an_oci_layout(
    layout: tuple[OCILayoutTarget, Manifest], checkpoint: Path, tmp_path: Path
) -> None:
    target, manifest = layout
    cache = NodeCache(str(tmp_path / "cache"))
    res = cache.pull(f"oci:{target.path}:v1")
    assert res.state == "cold" and res.digest == manifest.digest and res.files == len(manifest.layers)
    for name in os.listdir(checkpoint):
        snap_file = Path(res.path) / name
        assert snap_file.read_bytes() == (checkpoint / name).read_bytes()
        st = snap_file.stat()
        assert stat.S_IMODE(st.st_mode) == 0o444
        digest, _ = sha256_file(snap_file)
        assert st.st_ino == os.stat(cache.store.blob_path(digest)).st_ino  # a hard link, not a copy
    assert stat.S_IMODE(os.stat(res.path).st_mode) == 0o555
    # the store is an OCI image layout other tools read (one image in index.json: no ref needed)
    out = subprocess.run(
        ["skopeo", "copy", f"oci:{cache.root}", f"oci:{tmp_path / 'again'}:x"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert OCILayoutTarget(str(tmp_path / "again")).resolve("x").digest == manifest.digest


def test_pinned_hit_needs_no_source_and_does_no_hashing(
    layout: tuple[OCILayoutTarget, Manifest], tmp_path: Path
) -> None:
    target, manifest = layout
    cache = NodeCache(str(tmp_path / "cache"))
    cold = cache.pull(f"oci:{target.path}:v1")
    target.delete()  # the source is gone: a pinned hit must not need it
    hit = cache.pull(f"oci:{target.path}@{manifest.digest}")
    assert hit.state == "hit" and hit.path == cold.path and hit.bytes_downloaded == 0
    # no hashing on a hit: a silently damaged file is NOT noticed by the hit...
    big = max(manifest.layers, key=lambda x: x.size)
    blob = cache.store.blob_path(big.digest)
    os.chmod(blob, 0o644)
    with open(blob, "r+b") as f:
        f.seek(100)
        f.write(b"\x00\xff" * 8)
    assert cache.pull(f"oci:{target.path}@{manifest.digest}").state == "hit"
    # ...but `cache verify` finds it, writes an event and unpublishes the snapshot
    reports = cache.verify()
    assert len(reports) == 1 and not reports[0].ok
    assert _ev(cache, "cache.verify_failed")[-1]["digest"] == manifest.digest
    assert cache.snapshots.ready(manifest.digest) is None
    assert not os.path.exists(blob)
    with pytest.raises(NotFoundError):
        cache.snapshot_path(f"oci:{target.path}@{manifest.digest}")


def test_tag_is_resolved_once_and_readers_use_the_recorded_digest(
    layout: tuple[OCILayoutTarget, Manifest], checkpoint: Path, tmp_path: Path
) -> None:
    target, manifest = layout
    cache = NodeCache(str(tmp_path / "cache"))
    ref = f"oci:{target.path}:v1"
    cache.pull(ref)
    # the tag moves upstream; a reader on this node keeps what the pull resolved (no network)
    (checkpoint / "README.md").write_text("changed\n")
    newer = api.pack(str(checkpoint), f"oci:{target.path}:v1").artifact.digest
    assert newer != manifest.digest
    with cache.open_snapshot(ref) as snap:
        assert snap.digest == manifest.digest
    # the next pull resolves again and records the new digest
    res = cache.pull(ref)
    assert res.digest == newer and res.state == "cold"
    assert res.blobs_reused >= len(manifest.layers) - 1  # only the changed file was fetched
    assert cache.resolve_local(ref) == newer


def test_interrupted_download_is_never_a_hit_and_resumes_after_rehash(
    layout: tuple[OCILayoutTarget, Manifest], tmp_path: Path
) -> None:
    target, manifest = layout
    big = max(manifest.layers, key=lambda x: x.size)
    cache = NodeCache(str(tmp_path / "cache"))
    ref = f"oci:{target.path}:v1"
    cut = big.size // 3
    with pytest.raises(Interrupted):
        cache.pull(ref, source=FaultySource(target, big.digest, cut), jobs=1)
    assert cache.snapshots.ready(manifest.digest) is None and cache.ls() == []
    assert not cache.store.has(big)
    assert cache.store.partial_bytes(big.digest) == cut
    assert _ev(cache, "cache.pull_failed")

    src = FaultySource(target)
    res = cache.pull(ref, source=src)
    assert (str(big.digest), cut) in src.offsets  # asked for the rest only
    assert src.served[big.digest] == big.size - cut
    assert res.bytes_resumed == cut
    resume = _ev(cache, "cache.resume")
    assert resume[-1]["blob"] == big.digest and resume[-1]["offset"] == cut
    assert all(r.ok for r in cache.verify())


def test_a_damaged_partial_prefix_is_caught_and_refetched(
    layout: tuple[OCILayoutTarget, Manifest], tmp_path: Path
) -> None:
    target, manifest = layout
    big = max(manifest.layers, key=lambda x: x.size)
    cache = NodeCache(str(tmp_path / "cache"))
    ref = f"oci:{target.path}:v1"
    with pytest.raises(Interrupted):
        cache.pull(ref, source=FaultySource(target, big.digest, big.size // 2), jobs=1)
    partial = cache.store.partial_path(big.digest)
    with open(partial, "r+b") as f:  # torn write / bit rot in the prefix
        f.seek(10)
        f.write(b"garbage!")
    src = FaultySource(target)
    res = cache.pull(ref, source=src)
    assert res.state == "cold"
    assert src.served[big.digest] == big.size - big.size // 2 + big.size  # rest, then all again
    assert _ev(cache, "cache.resume_discarded")
    assert all(r.ok for r in cache.verify())


def test_corrupt_source_blob_is_refused_nothing_committed(
    layout: tuple[OCILayoutTarget, Manifest], tmp_path: Path
) -> None:
    target, manifest = layout
    big = max(manifest.layers, key=lambda x: x.size)
    path = target.blob_path(big.digest)
    data = bytearray(Path(path).read_bytes())
    data[-1] ^= 1
    os.chmod(path, 0o644)
    Path(path).write_bytes(bytes(data))
    cache = NodeCache(str(tmp_path / "cache"))
    with pytest.raises(DigestMismatchError):
        cache.pull(f"oci:{target.path}:v1")
    assert not cache.store.has(big) and cache.store.partial_bytes(big.digest) == 0
    assert cache.snapshots.ready(manifest.digest) is None
    ev = _ev(cache, "cache.verify_failed")
    assert ev and ev[0]["blob"] == big.digest and ev[0]["reference"].endswith(":v1")


def test_publish_is_atomic_and_an_unmarked_directory_is_never_trusted(
    layout: tuple[OCILayoutTarget, Manifest], tmp_path: Path
) -> None:
    target, manifest = layout
    cache = NodeCache(str(tmp_path / "cache"))
    # a crash between rename and marker leaves a complete-looking directory with no marker
    res = cache.pull(f"oci:{target.path}:v1")
    os.unlink(cache.snapshots.marker_path(manifest.digest))
    assert os.path.isdir(res.path)
    assert cache.snapshots.ready(manifest.digest) is None and cache.ls() == []
    with pytest.raises(NotFoundError), cache.open_snapshot(f"oci:{target.path}:v1"):
        pass
    # the next pull does not trust the folder either: it rebuilds and publishes again
    again = cache.pull(f"oci:{target.path}:v1")
    assert again.state == "cold" and again.bytes_downloaded == 0 and again.path == res.path
    assert cache.snapshots.ready(manifest.digest) is not None
    # the marker names the digest it vouches for: a marker copied to another name is refused
    other = "sha256:" + "0" * 64
    Path(cache.snapshots.marker_path(other)).write_bytes(
        Path(cache.snapshots.marker_path(manifest.digest)).read_bytes()
    )
    os.makedirs(cache.snapshots.path(other))
    with pytest.raises(ModelpackError):
        cache.snapshots.ready(other)


def test_stale_temp_files_are_swept_live_ones_kept(
    layout: tuple[OCILayoutTarget, Manifest], tmp_path: Path
) -> None:
    target, manifest = layout
    cache = NodeCache(str(tmp_path / "cache"))
    cache.pull(f"oci:{target.path}:v1")
    blobs = Path(cache.store.blobs_dir)
    old_tmp = blobs / f"{TEMP_PREFIX}dead"
    old_tmp.write_bytes(b"x")
    os.utime(old_tmp, (1, 1))
    fresh_tmp = blobs / f"{TEMP_PREFIX}alive"  # may belong to a writer right now
    fresh_tmp.write_bytes(b"y")
    dead = subprocess.Popen(["true"])
    dead.wait()
    dead_dir = Path(cache.snapshots.dir) / f"{TEMP_PREFIX}abcdef-{dead.pid}-1234abcd"
    dead_dir.mkdir()
    (dead_dir / "f").write_bytes(b"z")
    live_dir = Path(cache.snapshots.dir) / f"{TEMP_PREFIX}abcdef-{os.getppid()}-1234abcd"
    live_dir.mkdir()
    done_partial = Path(cache.store.partial_path(manifest.layers[0].digest))  # blob already committed
    done_partial.write_bytes(b"p")
    resumable = Path(cache.store.partial_path("sha256:" + "1" * 64))  # young: kept for resume
    resumable.write_bytes(b"q")
    stray_lease = Path(cache.snapshots.lease_path("sha256:" + "3" * 64))  # a reader asked for a missing one
    stray_lease.write_bytes(b"")
    res = cache.gc()
    assert not stray_lease.exists() and os.path.exists(cache.snapshots.lease_path(manifest.digest))
    assert str(old_tmp) in res.swept and not old_tmp.exists()
    assert not dead_dir.exists() and not done_partial.exists()
    assert fresh_tmp.exists() and live_dir.exists() and resumable.exists()
    assert res.evicted == [] and cache.snapshots.ready(manifest.digest) is not None


def test_rm_refuses_in_use_and_pinned_then_removes_everything(
    layout: tuple[OCILayoutTarget, Manifest], tmp_path: Path
) -> None:
    target, _manifest = layout
    cache = NodeCache(str(tmp_path / "cache"))
    ref = f"oci:{target.path}:v1"
    cache.pull(ref)
    with cache.open_snapshot(ref), pytest.raises(SnapshotInUseError):
        cache.rm(ref)
    cache.pin(ref)
    with pytest.raises(ModelpackError, match="pinned"):
        cache.rm(ref)
    cache.unpin(ref)
    cache.rm(ref)
    assert cache.ls() == [] and cache.store.blob_digests() == [] and cache.store.manifest_digests() == []
    assert not os.listdir(cache.refs_dir)
    assert _ev(cache, "cache.evict")[-1]["reason"] == "rm"


def test_a_complete_partial_is_verified_and_committed_without_fetching(
    layout: tuple[OCILayoutTarget, Manifest], tmp_path: Path
) -> None:
    """A process killed after the last byte but before the rename: the rerun fetches nothing."""
    target, manifest = layout
    big = max(manifest.layers, key=lambda x: x.size)
    cache = NodeCache(str(tmp_path / "cache"))
    Path(cache.store.partial_path(big.digest)).write_bytes(Path(target.blob_path(big.digest)).read_bytes())
    src = FaultySource(target)
    res = cache.pull(f"oci:{target.path}:v1", source=src)
    assert big.digest not in src.served and res.bytes_resumed == big.size
    assert res.bytes_downloaded == manifest.total_size - big.size
    assert all(r.ok for r in cache.verify())


def test_events_feed_the_timeline_per_state(
    layout: tuple[OCILayoutTarget, Manifest], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from modelpack.loader.timeline import timeline

    target, manifest = layout
    cache = NodeCache(str(tmp_path / "cache"))
    monkeypatch.setenv("MODELPACK_START_ID", "pod-uid-1")  # what the k8s recipes set from the pod UID
    cache.pull(f"oci:{target.path}:v1")
    monkeypatch.delenv("MODELPACK_START_ID")
    for _ in range(3):
        cache.pull(f"oci:{target.path}@{manifest.digest}")
    events = read_events(cache.events_path)
    assert {e["start_id"] for e in events if e["event"] == "cache.ready"} == {"pod-uid-1"}
    summary = timeline([cache.events_path])
    assert summary["starts"] == 4
    cold = summary["states"]["cold"]["stages"]
    hit = summary["states"]["hit"]["stages"]
    assert summary["states"]["cold"]["starts"] == 1 and summary["states"]["hit"]["starts"] == 3
    assert cold["t2"]["at"]["count"] == cold["t3"]["at"]["count"] == cold["t4"]["at"]["count"] == 1
    assert hit["t2"]["at"]["count"] == hit["t4"]["at"]["count"] == 3 and hit["t3"]["at"]["count"] == 0


def test_sweep_ages_leftovers_whose_mtime_is_in_the_future(tmp_path: Path) -> None:
    """The clock stepped back after a crash: a temp file or partial stamped "tomorrow" must age
    from now on and go at its TTL, not be kept forever."""
    nc = NodeCache(str(tmp_path / "cache"))
    tomorrow = time.time() + 86400
    temp = Path(nc.store.ingest_dir) / f"{TEMP_PREFIX}left-behind"
    partial = Path(nc.store.ingest_dir) / ("ab" * 32 + ".partial")
    for path in (temp, partial):
        path.write_bytes(b"x" * 10)
        os.utime(path, (tomorrow, tomorrow))
    nc.store.sweep()  # default TTLs: nothing is due yet, but the future stamps are taken back
    assert temp.stat().st_mtime <= time.time() + 1 and partial.stat().st_mtime <= time.time() + 1
    removed = nc.store.sweep(temp_ttl=0, partial_ttl=0)
    assert str(temp) in removed and str(partial) in removed
