"""The node cache on a shared host.

Each test starts from an attack or a fault, run with the real CLI in subprocesses: a second uid
(``nobody`` via ``setpriv``; the tests run as root) that owns the cache root or its parent, plants
symlinks where the cache's tree walks go, pins snapshots with a shared lock on a reader lease, or
plants the event log; a read-only cache (a private read-only bind mount, ``unshare -m``); and
clocks that stepped back (lock and lease mtimes in the future).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from modelpack.mount import NodeCache
from modelpack.mount.snapshots import remove_tree

from modelpack import api
from modelpack.files import TEMP_PREFIX
from modelpack.oci.descriptor import Manifest
from modelpack.targets.layout import OCILayoutTarget
from modelpack.testdata.synthetic import SyntheticSpec, write_checkpoint

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(180),
    pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root and setpriv"),
]

NOBODY = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
NOBODY_UID = 65534
NOGROUP_GID = 65534
MODELPACK = str(Path(sys.executable).with_name("modelpack"))
PY = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable  # stdlib only
TINY = {"hidden": 16, "intermediate": 32, "layers": 1, "heads": 2, "kv_heads": 1, "vocab": 32}


def cli(*args: str, user: str = "root", timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """The real ``modelpack`` command, as root or as nobody."""
    cmd = [MODELPACK, *args]
    if user == "nobody":
        cmd = [*NOBODY, *cmd]
    env = {**os.environ, "MODELPACK_LOCK_TIMEOUT": "5", "HOME": "/tmp"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, check=False)


def as_nobody(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*NOBODY, PY, "-c", script, *args], capture_output=True, text=True, timeout=30)


@pytest.fixture
def shared() -> Iterator[Path]:
    """A directory every uid can traverse, with a sticky world-writable ``tmp/`` like /tmp."""
    base = Path(tempfile.mkdtemp(prefix="mp-shared-", dir="/tmp"))
    os.chmod(base, 0o755)
    (base / "tmp").mkdir()
    os.chmod(base / "tmp", 0o1777)
    try:
        yield base
    finally:
        remove_tree(str(base))


def pack(base: Path, name: str, seed: int) -> tuple[str, Manifest]:
    """A tiny model in an OCI layout under ``base`` (readable by every uid)."""
    ck = base / f"ck-{name}"
    write_checkpoint(str(ck), SyntheticSpec(seed=seed, **TINY))  # type: ignore[arg-type]
    api.pack(str(ck), f"oci:{base / name}:v1")
    for dirpath, dirnames, filenames in os.walk(base / name):
        for n in [*dirnames, *filenames]:
            os.chmod(os.path.join(dirpath, n), 0o755 if n in dirnames else 0o644)
    manifest, _ = api.fetch_manifest(OCILayoutTarget(str(base / name)), "v1")
    return f"oci:{base / name}:v1", manifest


# ------------------------------------------------------------------------ 22.6 the cache owner
def test_a_cache_root_owned_by_another_uid_is_refused_with_the_fix(shared: Path) -> None:
    """nobody makes the cache root; root's pull must not fill a directory nobody can rearrange
    (swap ``snapshots/`` for tampered copies that would then be "the owner's" and a hit)."""
    ref, _manifest = pack(shared, "a", 1)
    root = shared / "tmp" / "mpc"
    out = as_nobody("import os, sys; os.mkdir(sys.argv[1], 0o755)", str(root))
    assert out.returncode == 0, out.stderr
    res = cli("pull", ref, "--cache", str(root))
    assert res.returncode == 1, f"root pulled into a cache root owned by nobody: {res.stdout}{res.stderr}"
    assert str(root) in res.stderr and f"uid {NOBODY_UID}" in res.stderr and "chown" in res.stderr
    assert "Traceback" not in res.stderr
    assert not (root / "snapshots").exists() and not (root / "blobs").exists()
    # maintenance commands refuse it too, naming the same fix
    for args in (["cache", "ls"], ["cache", "verify", "--no-repair"], ["cache", "gc", "--min-age", "0"]):
        out = as_nobody(
            "import os, sys; open(os.path.join(sys.argv[1], 'oci-layout'), 'w').write("
            '\'{"imageLayoutVersion":"1.0.0"}\')',
            str(root),
        )
        res = cli(*args, "--cache", str(root))
        assert res.returncode == 1 and "chown" in res.stderr, (args, res.stdout, res.stderr)


def test_a_cache_under_a_parent_another_uid_can_rearrange_is_refused(shared: Path) -> None:
    """Root's own cache root inside nobody's directory: nobody can rename it away and put its own
    directory (with tampered snapshots) at the same path, so the path is refused from the start."""
    ref, _ = pack(shared, "a", 1)
    parent = shared / "tmp" / "nobodys"
    assert as_nobody("import os, sys; os.mkdir(sys.argv[1], 0o755)", str(parent)).returncode == 0
    res = cli("pull", ref, "--cache", str(parent / "cache"))
    assert res.returncode == 1, f"pulled into a cache whose parent nobody owns: {res.stderr}"
    assert str(parent) in res.stderr and f"uid {NOBODY_UID}" in res.stderr, res.stderr


def test_a_cache_path_through_another_uids_symlink_is_refused(shared: Path) -> None:
    """nobody's symlink in a sticky directory names root's cache now and nobody's tree later."""
    ref, _ = pack(shared, "a", 1)
    roots = shared / "roots"
    assert cli("pull", ref, "--cache", str(roots)).returncode == 0
    link = shared / "tmp" / "cache-link"
    assert (
        as_nobody("import os, sys; os.symlink(sys.argv[1], sys.argv[2])", str(roots), str(link)).returncode
        == 0
    )
    for args in (["pull", ref], ["cache", "gc", "--min-age", "0"]):
        res = cli(*args, "--cache", str(link))
        assert res.returncode == 1 and f"uid {NOBODY_UID}" in res.stderr, (args, res.stderr)
    res = cli("pull", ref, "--cache", str(link / "snapshots"))  # a symlink on the way counts too
    assert res.returncode == 1 and f"uid {NOBODY_UID}" in res.stderr, res.stderr


def test_a_shared_sticky_directory_is_not_made_a_cache_root(shared: Path) -> None:
    """``--cache /tmp`` as root must not strip the write bits of everybody's /tmp."""
    ref, _ = pack(shared, "a", 1)
    res = cli("pull", ref, "--cache", str(shared / "tmp"))
    assert res.returncode == 1 and "sticky" in res.stderr, res.stderr
    assert stat.S_IMODE(os.stat(shared / "tmp").st_mode) == 0o1777


def test_the_swap_attack_never_yields_a_verified_hit(shared: Path) -> None:
    """Root's cache at a path nobody controls: whatever nobody swaps in, root never reports a hit
    on files that are not the verified ones (end to end: pull, swap, pull again)."""
    ref, _manifest = pack(shared, "a", 1)
    root = shared / "tmp" / "mpc"
    assert as_nobody("import os, sys; os.mkdir(sys.argv[1], 0o755)", str(root)).returncode == 0
    first = cli("pull", ref, "--cache", str(root), "--json")
    if first.returncode == 0:  # the code before the fix: swap snapshots/ for tampered copies
        swap = """
import os, shutil, sys
root = sys.argv[1]
os.rename(os.path.join(root, "snapshots"), os.path.join(root, "old"))
shutil.copytree(os.path.join(root, "old"), os.path.join(root, "snapshots"), symlinks=True)
for dirpath, dirs, files in os.walk(os.path.join(root, "snapshots")):
    os.chmod(dirpath, 0o755)
    for f in files:
        p = os.path.join(dirpath, f)
        os.chmod(p, 0o644)
        if f.endswith(".safetensors"):
            with open(p, "r+b") as fh:
                fh.seek(-1, 2)
                fh.write(b"\\x7f")
for dirpath, dirs, files in os.walk(os.path.join(root, "snapshots")):
    for f in files:
        os.chmod(os.path.join(dirpath, f), 0o444)
    os.chmod(dirpath, 0o755)
print("swapped")
"""
        assert "swapped" in as_nobody(swap, str(root)).stdout
    second = cli("pull", ref, "--cache", str(root), "--json")
    assert second.returncode == 1, f"pull after nobody swapped the snapshots: {second.stdout}"


def test_a_reader_of_another_uid_uses_roots_cache_and_nobody_uses_its_own(shared: Path) -> None:
    ref, _ = pack(shared, "a", 1)
    roots = shared / "roots"
    assert cli("pull", ref, "--cache", str(roots)).returncode == 0
    os.chmod(roots, 0o755)  # the operator opened it to every local user
    res = cli("pull", ref, "--cache", str(roots), "--json", user="nobody")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["cache"]["state"] == "hit"
    own = shared / "tmp" / "own"
    res = cli("pull", ref, "--cache", str(own), "--json", user="nobody")
    assert res.returncode == 0 and json.loads(res.stdout)["cache"]["state"] == "cold", res.stderr


# ------------------------------------------------------------------------ 22.7 tree walks
def _outside(shared: Path) -> tuple[Path, dict[str, int]]:
    """A directory outside the cache with a file and a subdirectory, and its modes."""
    out = shared / "outside"
    (out / "sub").mkdir(parents=True)
    (out / "keep.txt").write_text("precious")
    (out / "sub" / "deep.txt").write_text("precious")
    for p in (out, out / "sub"):
        os.chmod(p, 0o755)
    return out, _modes(out)


def _modes(top: Path) -> dict[str, int]:
    found = {".": stat.S_IMODE(os.lstat(top).st_mode)}
    for dirpath, dirnames, filenames in os.walk(top):
        for n in [*dirnames, *filenames]:
            p = os.path.join(dirpath, n)
            found[os.path.relpath(p, top)] = stat.S_IMODE(os.lstat(p).st_mode)
    return found


def test_gc_and_rm_never_chmod_or_delete_outside_the_cache(shared: Path) -> None:
    ref, manifest = pack(shared, "a", 1)
    ref_b, manifest_b = pack(shared, "b", 2)
    cache_root = shared / "cache"
    assert cli("pull", ref, "--cache", str(cache_root)).returncode == 0
    assert cli("pull", ref_b, "--cache", str(cache_root)).returncode == 0
    outside, before = _outside(shared)
    snapshots = cache_root / "snapshots"
    dead_pid = subprocess.Popen(["true"])
    dead_pid.wait()
    # 1. a dead builder's temp directory whose subdirectory is a symlink out of the cache
    build = snapshots / f"{TEMP_PREFIX}{manifest.digest.hex[:16]}-{dead_pid.pid}-deadbeef"
    build.mkdir()
    (build / "d").symlink_to(outside)
    os.chmod(build, 0o555)
    # 2. a temp directory that is itself a symlink out of the cache
    (snapshots / f"{TEMP_PREFIX}old-{manifest.digest.hex[:16]}-{dead_pid.pid}-abcdef").symlink_to(outside)
    # 3. a published snapshot with a symlinked subdirectory planted in it (evicted by gc)
    snap_b = snapshots / manifest_b.digest.hex
    os.chmod(snap_b, 0o755)
    (snap_b / "planted").symlink_to(outside / "sub")
    os.chmod(snap_b, 0o555)
    res = cli("cache", "gc", "--cache", str(cache_root), "--max-bytes", "1", "--min-age", "0", "--json")
    assert res.returncode == 0, res.stderr
    assert _modes(outside) == before, "gc changed modes outside the cache"
    assert (outside / "keep.txt").read_text() == "precious" and (outside / "sub" / "deep.txt").exists()
    assert not build.exists() and not snap_b.exists()
    # 4. the snapshot directory replaced by a symlink out of the cache, then rm
    assert cli("pull", ref, "--cache", str(cache_root)).returncode == 0
    snap_a = snapshots / manifest.digest.hex
    remove_tree(str(snap_a))
    snap_a.symlink_to(outside)
    res = cli("cache", "rm", ref, "--cache", str(cache_root), "--force")
    assert _modes(outside) == before, f"rm changed modes outside the cache: {res.stderr}"
    assert (outside / "keep.txt").read_text() == "precious" and (outside / "sub" / "deep.txt").exists()
    assert not os.path.lexists(snap_a)


def test_remove_tree_does_not_follow_a_symlink_swapped_in_for_a_directory(shared: Path) -> None:
    """The walk holds directory fds: a directory replaced by a symlink mid-walk is not entered."""
    outside, before = _outside(shared)
    tree = shared / "tree"
    for i in range(50):
        d = tree / f"d{i}" / "x"
        d.mkdir(parents=True)
        (d / "f").write_text("x")
        (tree / f"d{i}" / "link").symlink_to(outside)
    for dirpath, _dirs, _files in os.walk(tree, topdown=False):
        os.chmod(dirpath, 0o555)
    remove_tree(str(tree))
    assert not tree.exists()
    assert _modes(outside) == before
    assert (outside / "keep.txt").exists()


# ------------------------------------------------------------------------ 22.8 foreign leases, modes
HOLD_SHARED = """
import ctypes, fcntl, os, sys, time
if len(sys.argv) > 2 and sys.argv[2] == "undumpable":  # /proc/<pid> then shows root as its owner
    assert ctypes.CDLL(None).prctl(4, 0, 0, 0, 0) == 0  # PR_SET_DUMPABLE, 0
fd = os.open(sys.argv[1], os.O_RDONLY)
fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
print("locked", flush=True)
if len(sys.argv) > 2 and sys.argv[2] == "setuid":  # the lock passes to a setuid-root program
    os.set_inheritable(fd, True)
    os.execv("/usr/bin/su", ["su", "root", "-c", "true"])  # waits for a password on stdin
time.sleep(120)
"""


def _hold_as(user: str, path: str, how: str = "") -> subprocess.Popen[str]:
    cmd = [PY, "-c", HOLD_SHARED, path, how]
    proc = subprocess.Popen(
        [*NOBODY, *cmd] if user == "nobody" else cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
    return proc


@pytest.mark.parametrize("how", ["", "undumpable", "setuid"])
def test_another_uid_cannot_pin_a_snapshot_against_gc_forever(shared: Path, how: str) -> None:
    ref, manifest = pack(shared, "a", 1)
    cache_root = shared / "cache"
    assert cli("pull", ref, "--cache", str(cache_root)).returncode == 0
    os.chmod(cache_root, 0o755)  # readers of every uid (before the fix, the default)
    cache = NodeCache(str(cache_root))
    lease = cache.snapshots.lease_path(manifest.digest)
    holder = _hold_as("nobody", lease, how)
    try:
        # a foreign reader that arrived just now keeps the snapshot (bounded, not forever)
        res = cli("cache", "gc", "--cache", str(cache_root), "--max-bytes", "1", "--min-age", "0", "--json")
        assert res.returncode == 0 and json.loads(res.stdout)["keptInUse"] == [str(manifest.digest)]
        # the owner has not used it for two hours: a foreign lease no longer pins it
        two_hours_ago = time.time() - 7200
        os.utime(lease, (two_hours_ago, two_hours_ago))
        res = cli("cache", "gc", "--cache", str(cache_root), "--max-bytes", "1", "--min-age", "0", "--json")
        assert res.returncode == 0, res.stderr
        doc = json.loads(res.stdout)
        assert doc["evicted"] == [str(manifest.digest)], f"nobody's shared lock pinned the snapshot: {doc}"
        assert cache.store.blob_digests() == []
        # and the next pull has room again
        assert cli("pull", ref, "--cache", str(cache_root), "--max-cache-bytes", "1M").returncode == 0
    finally:
        holder.kill()
        holder.wait()


def test_the_owners_own_lease_keeps_a_snapshot_however_old(shared: Path) -> None:
    ref, manifest = pack(shared, "a", 1)
    cache_root = shared / "cache"
    assert cli("pull", ref, "--cache", str(cache_root)).returncode == 0
    lease = NodeCache(str(cache_root)).snapshots.lease_path(manifest.digest)
    holder = _hold_as("root", lease)
    try:
        long_ago = time.time() - 30 * 86400
        os.utime(lease, (long_ago, long_ago))
        res = cli("cache", "gc", "--cache", str(cache_root), "--max-bytes", "1", "--min-age", "0", "--json")
        assert res.returncode == 0 and json.loads(res.stdout)["keptInUse"] == [str(manifest.digest)]
    finally:
        holder.kill()
        holder.wait()


def test_a_new_cache_root_is_not_world_readable_and_a_serving_group_reads_it(shared: Path) -> None:
    ref, _manifest = pack(shared, "a", 1)
    cache_root = shared / "cache"
    assert cli("pull", ref, "--cache", str(cache_root)).returncode == 0
    assert stat.S_IMODE(os.stat(cache_root).st_mode) == 0o750
    res = cli("cache", "path", ref, "--cache", str(cache_root), user="nobody")
    assert res.returncode == 1 and str(cache_root) in res.stderr, "another user read a 0750 cache"
    # the recipe in docs/node.md: the serving group may read (and lease), never write
    os.chown(cache_root, 0, NOGROUP_GID)
    res = cli("pull", ref, "--cache", str(cache_root), "--json", user="nobody")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["cache"]["state"] == "hit"
    assert stat.S_IMODE(os.stat(cache_root).st_mode) == 0o750


# ------------------------------------------------------------------------ 22.9 event logs
def test_event_logs_do_not_follow_planted_symlinks_or_write_foreign_files(shared: Path) -> None:
    ref, _ = pack(shared, "a", 1)
    victim = shared / "victim"
    victim.write_text("root's file\n")
    planted = shared / "tmp" / "events.jsonl"
    out = as_nobody("import os, sys; os.symlink(sys.argv[1], sys.argv[2])", str(victim), str(planted))
    assert out.returncode == 0, out.stderr
    res = cli("pull", ref, "--cache", str(shared / "cache"), "--events", str(planted))
    assert victim.read_text() == "root's file\n", "an event was appended through nobody's symlink"
    assert res.returncode == 1 and str(planted) in res.stderr and "Traceback" not in res.stderr, res.stderr
    os.unlink(planted)
    foreign = shared / "tmp" / "foreign.jsonl"
    out = as_nobody("import sys; open(sys.argv[1], 'w').close()", str(foreign))
    res = cli("cache", "ls", "--cache", str(shared / "cache"))  # the cache exists
    res = cli("cache", "gc", "--cache", str(shared / "cache"), "--events", str(foreign))
    assert foreign.read_text() == "", "root wrote events into nobody's file"
    assert res.returncode == 1 and str(foreign) in res.stderr and f"uid {NOBODY_UID}" in res.stderr
    # a hard link to root's file (what another user can make where fs.protected_hardlinks=0)
    linked = shared / "tmp" / "linked.jsonl"
    os.link(victim, linked)
    res = cli("cache", "gc", "--cache", str(shared / "cache"), "--events", str(linked))
    assert victim.read_text() == "root's file\n" and res.returncode == 1 and "hard links" in res.stderr
    # the cache's own log: a symlink in its place is never followed
    cache_events = shared / "cache" / "events.jsonl"
    os.unlink(cache_events)
    cache_events.symlink_to(victim)
    res = cli("pull", ref, "--cache", str(shared / "cache"))
    assert victim.read_text() == "root's file\n"


# ------------------------------------------------------------------------ 24.6 read-only caches
def _read_only(cache_root: Path, *commands: list[str]) -> subprocess.CompletedProcess[str]:
    """Run ``commands`` with ``cache_root`` bind-mounted read-only in a private mount namespace."""
    script = f"mount --bind {cache_root} {cache_root} && mount -o remount,bind,ro {cache_root}"
    for c in commands:
        script += " && " + " ".join([MODELPACK, *c])
    env = {**os.environ, "MODELPACK_LOCK_TIMEOUT": "5"}
    return subprocess.run(
        ["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, env=env, timeout=60
    )


def test_a_read_only_cache_serves_hits_and_verifies_without_its_event_log(shared: Path) -> None:
    ref, manifest = pack(shared, "a", 1)
    cache_root = shared / "cache"
    assert cli("pull", ref, "--cache", str(cache_root)).returncode == 0
    pinned = ref.rsplit(":", 1)[0] + "@" + str(manifest.digest)
    res = _read_only(
        cache_root,
        ["pull", pinned, "--cache", str(cache_root)],
        ["pull", ref, "--cache", str(cache_root)],  # a tag: resolved again, nothing to record
        ["cache", "verify", "--no-repair", "--cache", str(cache_root)],
        ["cache", "ls", "--cache", str(cache_root)],
    )
    assert res.returncode == 0, f"a read of a read-only cache failed: {res.stdout}{res.stderr}"
    assert str(cache_root / "snapshots" / manifest.digest.hex) in res.stdout
    # --events elsewhere still gets the events
    events = shared / "ev.jsonl"
    res = _read_only(cache_root, ["pull", pinned, "--cache", str(cache_root), "--events", str(events)])
    assert res.returncode == 0, res.stderr
    assert any(json.loads(line)["event"] == "cache.hit" for line in events.read_text().splitlines())
    # a reader of another uid (no write access to events.jsonl) gets its hit too
    os.chmod(cache_root, 0o755)
    res = cli("pull", pinned, "--cache", str(cache_root), "--events", "-", user="nobody")
    assert res.returncode == 0, res.stderr
    assert '"cache.hit"' in res.stderr


def test_an_events_file_that_cannot_take_events_fails_naming_it(shared: Path) -> None:
    ref, _ = pack(shared, "a", 1)
    res = cli("pull", ref, "--cache", str(shared / "cache"), "--events", "/proc/version")
    assert res.returncode == 1 and "/proc/version" in res.stderr and "Traceback" not in res.stderr, res.stderr
    res = cli(
        "pull", ref, "--cache", str(shared / "cache"), "--events", str(shared / "no" / "such" / "dir" / "e")
    )
    assert res.returncode in (0, 1)
    if res.returncode == 1:
        assert str(shared / "no") in res.stderr


# ------------------------------------------------------------------------ 24.7 clock jumps
HOLD_EX = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR)
fcntl.flock(fd, fcntl.LOCK_EX)
future = time.time() + 3600
os.utime(fd, (future, future))  # the clock stepped back after the last heartbeat
print("locked", flush=True)
time.sleep(120)
"""

PULL_WITH_STALE = """
import json, sys, time
from modelpack.mount import NodeCache
cache = NodeCache(sys.argv[1], stale_after=float(sys.argv[3]))
t = time.monotonic()
res = cache.pull(sys.argv[2])
print(json.dumps({"state": res.state, "s": time.monotonic() - t}))
"""


@pytest.mark.parametrize("which", ["manifest", "blob"])
def test_a_lock_with_a_future_mtime_does_not_stall_a_pull(shared: Path, which: str) -> None:
    ref, manifest = pack(shared, "a", 1)
    cache_root = shared / "cache"
    cache = NodeCache(str(cache_root))
    big = max(manifest.layers, key=lambda x: x.size)
    lock = (
        os.path.join(cache.store.locks_dir, "m-" + manifest.digest.hex + ".lock")
        if which == "manifest"
        else cache.store.lock_path(big.digest)
    )
    os.close(os.open(lock, os.O_RDWR | os.O_CREAT, 0o600))
    holder = subprocess.Popen([PY, "-c", HOLD_EX, lock], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        try:
            out = subprocess.run(
                [sys.executable, "-c", PULL_WITH_STALE, str(cache_root), ref, "2"],
                capture_output=True,
                text=True,
                timeout=40,
                check=False,
            )
        except subprocess.TimeoutExpired:
            pytest.fail(f"a pull waited forever on a {which} lock whose mtime is in the future")
        assert out.returncode == 0, out.stderr[-2000:]
        doc = json.loads(out.stdout.strip().splitlines()[-1])
        assert doc["state"] == "cold" and doc["s"] < 20, doc
    finally:
        holder.kill()
        holder.wait()


def test_a_lease_mtime_in_the_future_does_not_make_a_snapshot_unevictable(shared: Path) -> None:
    ref, manifest = pack(shared, "a", 1)
    cache_root = shared / "cache"
    assert cli("pull", ref, "--cache", str(cache_root)).returncode == 0
    lease = NodeCache(str(cache_root)).snapshots.lease_path(manifest.digest)
    future = time.time() + 10 * 365 * 86400
    os.utime(lease, (future, future))
    res = cli("cache", "gc", "--cache", str(cache_root), "--max-bytes", "1", "--min-age", "0", "--json")
    assert res.returncode == 0 and json.loads(res.stdout)["evicted"] == [str(manifest.digest)], res.stdout
    # with a --min-age, the future mtime counts from the first gc that sees it, not from 10 years on
    assert cli("pull", ref, "--cache", str(cache_root)).returncode == 0
    os.utime(lease, (future, future))
    res = cli("cache", "gc", "--cache", str(cache_root), "--max-bytes", "1", "--min-age", "2s", "--json")
    assert res.returncode == 0 and json.loads(res.stdout)["keptYoung"] == [str(manifest.digest)]
    time.sleep(2.2)
    res = cli("cache", "gc", "--cache", str(cache_root), "--max-bytes", "1", "--min-age", "2s", "--json")
    assert json.loads(res.stdout)["evicted"] == [str(manifest.digest)], res.stdout


def test_a_hold_and_a_temp_file_from_before_a_clock_step_do_not_last_forever(shared: Path) -> None:
    ref, manifest = pack(shared, "a", 1)
    cache = NodeCache(str(shared / "cache"))
    res = cache.pull(ref, hold=2)
    # the clock stepped back a year after the hold was made: its deadline is a year ahead
    doc = json.loads(Path(res.hold_path).read_text())
    doc["until"] = time.time() + 365 * 86400
    Path(res.hold_path).write_text(json.dumps(doc))
    first = cache.gc(max_bytes=1, min_age=0)
    assert first.kept_held == [str(manifest.digest)]  # still within the 2 s it was asked for
    time.sleep(2.2)
    second = cache.gc(max_bytes=1, min_age=0)
    assert second.evicted == [str(manifest.digest)], "a hold outlived its length by a clock step"
    # a temp file whose mtime lies in the future ages from the first sweep that sees it
    temp = shared / "cache" / "snapshots" / f"{TEMP_PREFIX}marker-xyz"
    temp.write_text("{}")
    future = time.time() + 365 * 86400
    os.utime(temp, (future, future))
    assert cache.snapshots.sweep(temp_ttl=1) == [] and temp.exists()
    time.sleep(1.2)
    assert cache.snapshots.sweep(temp_ttl=1) == [str(temp)]
