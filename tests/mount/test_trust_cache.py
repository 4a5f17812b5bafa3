"""The node cache against another local user.

Each test starts from the attack: a second uid (``nobody``, via ``setpriv``; the tests run as
root) that can read the cache plants a blob, a marker or a trust record, or holds ``flock`` on
the cache's lock files; or someone edits a snapshot behind its ready marker. The cache must not
publish what it did not verify, must not wait forever, and ``cache verify`` must notice.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from modelpack.mount import NodeCache
from modelpack.mount.snapshots import remove_tree

from modelpack import api
from modelpack.errors import LockTimeoutError
from modelpack.oci.descriptor import Manifest
from modelpack.oci.digest import sha256_file
from modelpack.targets.layout import OCILayoutTarget
from modelpack.testdata.synthetic import SyntheticSpec, write_checkpoint
from tests.paths import REPO_ROOT

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root and setpriv"),
]

NOBODY = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
NOBODY_UID = 65534
PY = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable  # stdlib only


def as_nobody(script: str, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*NOBODY, PY, "-c", script, *args], capture_output=True, text=True, timeout=timeout, check=False
    )


PLANT = """
import os, sys
path, size = sys.argv[1], int(sys.argv[2])
try:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.write(fd, b"\\0" * size)
    os.close(fd)
    print("planted")
except OSError as exc:
    print("denied", exc.errno)
"""

HOLD = """
import fcntl, os, sys, time
try:
    fd = os.open(sys.argv[1], os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
except OSError as exc:
    print("denied", exc.errno, flush=True)
    sys.exit(0)
print("locked", flush=True)
time.sleep(float(sys.argv[2]) if len(sys.argv) > 2 else 120)
"""


@pytest.fixture
def shared_root() -> Iterator[Path]:
    """A directory every uid can traverse (pytest's tmp_path is root-only), for the cache."""
    base = tempfile.mkdtemp(prefix="mp-trust-", dir="/tmp")
    os.chmod(base, 0o755)
    try:
        yield Path(base)
    finally:
        remove_tree(base)


@pytest.fixture
def umask_000() -> Iterator[None]:
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


def _pack(tmp_path: Path, name: str, seed: int) -> tuple[str, Manifest]:
    ck = tmp_path / f"ck-{name}"
    write_checkpoint(str(ck), SyntheticSpec(seed=seed))
    api.pack(str(ck), f"oci:{tmp_path / name}:v1")
    target = OCILayoutTarget(str(tmp_path / name))
    manifest, _ = api.fetch_manifest(target, "v1")
    return f"oci:{tmp_path / name}:v1", manifest


def _files_match_manifest(path: str, manifest: Manifest) -> None:
    for layer in manifest.layers:
        title = layer.annotations["org.opencontainers.image.title"]
        digest, size = sha256_file(os.path.join(path, title))
        assert (digest, size) == (layer.digest, layer.size), title


# ----------------------------------------------------------------------------------- 11.4 modes
def test_modes_are_explicit_under_umask_000(umask_000: None, shared_root: Path, tmp_path: Path) -> None:
    ref, manifest = _pack(tmp_path, "a", 1)
    cache = NodeCache(str(shared_root / "cache"))
    res = cache.pull(ref)
    cache.open_snapshot(ref).__enter__()  # creates the lease file too
    writable = []
    for dirpath, dirnames, filenames in os.walk(cache.root):
        for name in [*dirnames, *filenames]:
            p = os.path.join(dirpath, name)
            if stat.S_IMODE(os.lstat(p).st_mode) & 0o022:
                writable.append(p)
    assert stat.S_IMODE(os.stat(cache.root).st_mode) & 0o022 == 0
    assert writable == [], f"writable by group/others under umask 000: {writable}"
    for layer in manifest.layers:
        assert stat.S_IMODE(os.stat(cache.store.blob_path(layer.digest)).st_mode) == 0o444
    # lock files and pull leases are the owner's business only
    assert stat.S_IMODE(os.stat(cache.store.locks_dir).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(cache.leases_dir).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(cache.store.ingest_dir).st_mode) == 0o700
    assert res.state == "cold"


def test_another_uid_cannot_plant_a_blob_the_next_pull_publishes(
    umask_000: None, shared_root: Path, tmp_path: Path
) -> None:
    ref_a, _ = _pack(tmp_path, "a", 1)
    ref_b, manifest_b = _pack(tmp_path, "b", 2)
    cache = NodeCache(str(shared_root / "cache"))
    cache.pull(ref_a)  # the cache exists, created under umask 000
    big = max(manifest_b.layers, key=lambda x: x.size)
    out = as_nobody(PLANT, cache.store.blob_path(big.digest), str(big.size))
    assert out.stdout.split()[0] == "denied", out
    res = cache.pull(ref_b)
    _files_match_manifest(res.path, manifest_b)


@pytest.mark.parametrize("planter", ["nobody", "owner-0666", "owner-0644"])
def test_a_foreign_or_writable_blob_is_never_present(planter: str, shared_root: Path, tmp_path: Path) -> None:
    """A cache left 0777 by an older version (or a blob chmodded writable): the wrong same-size
    blob already sits at the final path. It is not "present": the pull fetches and verifies."""
    ref_b, manifest_b = _pack(tmp_path, "b", 2)
    cache = NodeCache(str(shared_root / "cache"))
    big = max(manifest_b.layers, key=lambda x: x.size)
    blob = cache.store.blob_path(big.digest)
    if planter == "nobody":
        os.chmod(cache.root, 0o755)  # open to every local user (a new root is 0750)
        os.chmod(cache.store.blobs_dir, 0o777)
        out = as_nobody(PLANT, blob, str(big.size))
        assert out.stdout.split()[0] == "planted", out
    else:
        Path(blob).write_bytes(b"\0" * big.size)
        os.chmod(blob, 0o666 if planter == "owner-0666" else 0o644)
    res = NodeCache(str(shared_root / "cache")).pull(ref_b)
    _files_match_manifest(res.path, manifest_b)
    st = os.stat(blob)
    assert st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o444
    assert stat.S_IMODE(os.stat(cache.store.blobs_dir).st_mode) == 0o755  # the legacy mode repaired


def test_planted_markers_and_trust_records_are_not_trusted(shared_root: Path, tmp_path: Path) -> None:
    ref_a, manifest_a = _pack(tmp_path, "a", 1)
    cache = NodeCache(str(shared_root / "cache"))
    cache.pull(ref_a)
    digest = str(manifest_a.digest)
    # another uid replaces the marker and trust record while snapshots/ was left writable
    os.chmod(cache.root, 0o755)  # open to every local user (a new root is 0750)
    os.chmod(cache.snapshots.dir, 0o777)
    marker = cache.snapshots.marker_path(digest)
    doc = json.loads(Path(marker).read_bytes())
    plant = """
import os, sys
for path, data in zip(sys.argv[1::2], sys.argv[2::2]):
    tmp = path + ".x"
    with open(tmp, "w") as f:
        f.write(data)
    os.rename(tmp, path)
print("planted")
"""
    trust = {"digest": digest, "key_ids": ["attacker"], "directory_signature": "verified"}
    out = as_nobody(plant, marker, json.dumps(doc), cache.snapshots.trust_path(digest), json.dumps(trust))
    assert out.stdout.strip() == "planted", out
    fresh = NodeCache(str(shared_root / "cache"))
    assert fresh.snapshots.ready(digest) is None  # a marker another uid wrote vouches for nothing
    assert fresh.trust.read(digest) == {}
    res = fresh.pull(ref_a)  # a miss again: rebuilt and republished by the owner
    assert res.state == "cold" and os.stat(fresh.snapshots.marker_path(digest)).st_uid == os.geteuid()
    _files_match_manifest(res.path, manifest_a)


def test_a_world_writable_root_is_repaired_and_a_symlinked_root_still_works(tmp_path: Path) -> None:
    ref_a, manifest_a = _pack(tmp_path, "a", 1)
    real = tmp_path / "nvme" / "cache"
    real.mkdir(parents=True)
    os.chmod(real, 0o777)  # made by hand under umask 000
    (tmp_path / "link").symlink_to(real)
    res = NodeCache(str(tmp_path / "link")).pull(ref_a)
    assert stat.S_IMODE(os.stat(real).st_mode) == 0o755
    _files_match_manifest(res.path, manifest_a)


# ----------------------------------------------------------------------------------- 11.5 locks
def test_lock_files_are_not_lockable_by_another_uid(shared_root: Path, tmp_path: Path) -> None:
    ref_a, manifest_a = _pack(tmp_path, "a", 1)
    cache = NodeCache(str(shared_root / "cache"))
    cache.pull(ref_a)
    cache.gc()
    locks = [
        cache.gc_lock_path,
        os.path.join(cache.root, ".index.lock"),
        cache.store.lock_path(manifest_a.layers[0].digest),
        os.path.join(cache.store.locks_dir, "m-" + manifest_a.digest.hex + ".lock"),
    ]
    for lock in locks:
        assert os.path.exists(lock), lock
        out = as_nobody(HOLD, lock, "0")
        assert out.stdout.split()[0] == "denied", (lock, out.stdout, out.stderr)


PULL = """
import json, sys, time
from modelpack.mount import NodeCache
root, ref, op = sys.argv[1], sys.argv[2], sys.argv[3]
try:
    cache = NodeCache(root, lock_timeout=1.0)
except TypeError:  # before the fix there was no bound to give
    cache = NodeCache(root)
t = time.monotonic()
try:
    if op == "pull":
        cache.pull(ref)
    elif op == "gc":
        res = cache.gc(max_bytes=0, min_age=0)
        print(json.dumps({"ok": True, "evicted": res.evicted, "s": time.monotonic() - t}))
        sys.exit(0)
    elif op == "open":
        with cache.open_snapshot(ref):
            pass
    print(json.dumps({"ok": True, "s": time.monotonic() - t}))
except Exception as exc:
    print(json.dumps({"error": type(exc).__name__, "message": str(exc), "s": time.monotonic() - t}))
"""


def _op(root: str, ref: str, op: str, timeout: float = 40) -> dict[str, object]:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    try:
        out = subprocess.run(
            [sys.executable, "-c", PULL, root, ref, op],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            cwd=str(REPO_ROOT),
            check=False,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"cache {op} still blocked after {timeout}s: a lock wait is unbounded")
    assert out.stdout.strip(), out.stderr[-2000:]
    doc: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return doc


def _holder(path: str, *, uid: str = "root") -> subprocess.Popen[str]:
    cmd = [PY, "-c", HOLD, path, "120"]
    if uid == "nobody":
        cmd = [*NOBODY, *cmd]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    first = proc.stdout.readline().strip()
    if first != "locked":
        proc.kill()
        proc.wait()
        raise AssertionError(f"holder could not lock {path}: {first}")
    return proc


def _timed_out(doc: dict[str, object], lock: str, holder: subprocess.Popen[str]) -> None:
    assert doc.get("error") == LockTimeoutError.__name__, doc
    assert lock in str(doc["message"]) and f"pid {holder.pid}" in str(doc["message"]), doc
    assert float(str(doc["s"])) < 10


def test_a_held_gc_gate_bounds_pulls_and_gc(shared_root: Path, tmp_path: Path) -> None:
    """Whoever holds it (a stuck gc, or before the fix any local user), pulls and gc give up
    after the bound with an error naming the lock file and the holder's pid."""
    ref_a, _ = _pack(tmp_path, "a", 1)
    root = str(shared_root / "cache")
    cache = NodeCache(root)
    cache.gc()  # the gate exists from the first gc or pull on
    holder = _holder(cache.gc_lock_path)
    try:
        _timed_out(_op(root, ref_a, "pull"), cache.gc_lock_path, holder)
        _timed_out(_op(root, ref_a, "gc"), cache.gc_lock_path, holder)
    finally:
        holder.kill()
        holder.wait()
    assert _op(root, ref_a, "pull").get("ok"), "the pull works once the holder is gone"


def test_a_held_index_lock_bounds_pulls_and_gc_skips_it(shared_root: Path, tmp_path: Path) -> None:
    ref_a, manifest_a = _pack(tmp_path, "a", 1)
    ref_b, _ = _pack(tmp_path, "b", 2)
    root = str(shared_root / "cache")
    cache = NodeCache(root)
    cache.pull(ref_a)
    lock = os.path.join(root, ".index.lock")
    holder = _holder(lock)
    try:
        _timed_out(_op(root, ref_b, "pull"), lock, holder)
        doc = _op(root, ref_a, "gc")  # evicts a's snapshot; leaves index.json for the next gc
        assert doc.get("ok") and doc["evicted"] == [str(manifest_a.digest)], doc
        assert float(str(doc["s"])) < 10
    finally:
        holder.kill()
        holder.wait()
    assert str(manifest_a.digest) in cache.store.manifest_digests()  # skipped, not waited for
    cache.gc(min_age=0)
    assert cache.store.manifest_digests() == [] and cache.store.blob_digests() == []


def test_another_uid_holding_a_lease_cannot_stall_readers_and_gc_skips_it(
    shared_root: Path, tmp_path: Path
) -> None:
    ref_a, manifest_a = _pack(tmp_path, "a", 1)
    root = str(shared_root / "cache")
    cache = NodeCache(root)
    cache.pull(ref_a)
    os.chmod(root, 0o755)  # open to every local user (a new root is 0750; or chgrp a serving group)
    lease = cache.snapshots.lease_path(manifest_a.digest)
    holder = _holder(lease, uid="nobody")  # readers may lease: the lease file is readable
    try:
        doc = _op(root, ref_a, "open")
        assert doc.get("error") == LockTimeoutError.__name__, doc
        message = str(doc["message"])
        assert lease in message and f"pid {holder.pid}" in message and f"uid {NOBODY_UID}" in message
        doc = _op(root, ref_a, "gc")  # gc does not wait for it either: the snapshot counts as in use
        assert doc.get("ok"), doc
    finally:
        holder.kill()
        holder.wait()
    assert cache.snapshots.ready(manifest_a.digest) is not None
    with cache.open_snapshot(ref_a) as info:
        assert info.digest == manifest_a.digest


# ----------------------------------------------------------------------------------- 11.6 verify
def _rw(path: str) -> None:
    os.chmod(path, 0o755)


def _ro(path: str) -> None:
    os.chmod(path, 0o555)


@pytest.fixture
def pulled(tmp_path: Path) -> tuple[NodeCache, str, Manifest]:
    ref, manifest = _pack(tmp_path, "a", 1)
    cache = NodeCache(str(tmp_path / "cache"))
    cache.pull(ref)
    return cache, ref, manifest


def _verify_fails(cache: NodeCache, *needles: str) -> None:
    reports = cache.verify(repair=False)
    assert len(reports) == 1
    text = "\n".join(reports[0].problems)
    assert not reports[0].ok, "cache verify reported a tampered snapshot as ok"
    for needle in needles:
        assert needle in text, text


def test_verify_reports_a_file_planted_in_a_snapshot(pulled: tuple[NodeCache, str, Manifest]) -> None:
    cache, _, manifest = pulled
    snap = cache.snapshots.path(manifest.digest)
    _rw(snap)
    Path(snap, "extra.py").write_text("import os\n")
    os.makedirs(os.path.join(snap, "sub"))
    Path(snap, "sub", "x.safetensors").write_bytes(b"\0" * 16)
    _ro(snap)
    _verify_fails(cache, "extra.py", "sub/x.safetensors")


def test_verify_reports_a_file_dropped_from_the_marker(pulled: tuple[NodeCache, str, Manifest]) -> None:
    cache, _, manifest = pulled
    marker = cache.snapshots.marker_path(manifest.digest)
    doc = json.loads(Path(marker).read_bytes())
    dropped = doc["files"].pop()
    os.chmod(marker, 0o644)
    Path(marker).write_text(json.dumps(doc))
    os.chmod(marker, 0o444)
    _verify_fails(cache, dropped["path"])


def test_verify_reports_an_edited_marker(pulled: tuple[NodeCache, str, Manifest]) -> None:
    """Renaming a file and its marker entry together keeps every per-file hash consistent; only
    the manifest says the file belongs at another path."""
    cache, _, manifest = pulled
    marker = cache.snapshots.marker_path(manifest.digest)
    doc = json.loads(Path(marker).read_bytes())
    entry = next(f for f in doc["files"] if f["path"] == "config.json")
    entry["path"] = "configuration.json"
    snap = cache.snapshots.path(manifest.digest)
    _rw(snap)
    os.rename(os.path.join(snap, "config.json"), os.path.join(snap, "configuration.json"))
    _ro(snap)
    os.chmod(marker, 0o644)
    Path(marker).write_text(json.dumps(doc))
    os.chmod(marker, 0o444)
    _verify_fails(cache, "config.json")


def test_verify_holds_an_image_shaped_snapshot_to_its_tar_layers(checkpoint: Path, tmp_path: Path) -> None:
    api.pack(str(checkpoint), f"oci:{tmp_path / 'img'}:v1", format="image", compression="zstd")
    cache = NodeCache(str(tmp_path / "cache"))
    res = cache.pull(f"oci:{tmp_path / 'img'}:v1")
    reports = cache.verify(repair=False)
    assert [r.ok for r in reports] == [True], reports[0].problems
    assert reports[0].files == res.files > 0
    marker = cache.snapshots.marker_path(res.digest)
    doc = json.loads(Path(marker).read_bytes())
    doc["files"][0]["size"] += 1  # an edited entry, the file itself untouched
    os.chmod(marker, 0o644)
    Path(marker).write_text(json.dumps(doc))
    _verify_fails(cache, doc["files"][0]["path"], "the ready marker says")
