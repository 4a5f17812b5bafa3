"""``cache verify`` killed anywhere in its repair never lets a corrupt blob back in.

A real ``modelpack cache verify`` process is killed with SIGKILL by strace's fault injection
(``-e inject=SYSCALL:signal=KILL:when=K``: the signal is delivered on entry to the K-th call of
that syscall, before it runs), once at every filesystem mutation the repair makes (each
``unlink``, ``rename``, ``rmdir`` … in turn). After each kill, ``pull --cache`` must serve the
model's true bytes: before the fix, a kill between "unlink the ready marker" and "delete the bad
blob" left the blob in ``blobs/`` and the next pull published a READY snapshot from it without
re-hashing ("downloaded 0 B, reused 2.8 MiB"). A kill before the repair changed anything leaves
the damage as it was (the next verify finds it again); no kill may leave less than that.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from modelpack.cli import main
from tests.fixtures.registry import RegistryServer
from tests.mount.test_cache_support import push_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

MUTATIONS = ("unlink", "unlinkat", "rename", "renameat", "renameat2", "rmdir")
MODELPACK = str(Path(sys.executable).with_name("modelpack"))


def _pull(ref: str, cache: Path) -> dict:  # type: ignore[type-arg]
    r = CliRunner().invoke(main, ["pull", ref, "--cache", str(cache), "--json", "--plain-http"])
    assert r.exit_code == 0, r.output
    doc: dict = json.loads(r.stdout)  # type: ignore[type-arg]
    return doc


def _corrupt_largest_blob(cache: Path) -> str:
    blob = max((cache / "blobs" / "sha256").iterdir(), key=lambda p: p.stat().st_size)
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    with open(blob, "r+b") as f:  # root writes through the read-only mode; the snapshot shares the inode
        f.write(data)
    return "sha256:" + blob.name


def _verify_under_strace(cache: Path, log: Path, inject: str | None) -> int:
    cmd = ["strace", "-f", "-qq", "-o", str(log), "-e", "trace=" + ",".join(MUTATIONS)]
    if inject:
        cmd += ["-e", inject]
    cmd += [MODELPACK, "cache", "verify", "--cache", str(cache)]
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run(cmd, env=env, capture_output=True, timeout=120).returncode


def _sha256(path: Path) -> str:
    return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()


def test_kill_at_every_step_of_the_repair_never_republishes_a_bad_blob(
    registry: RegistryServer, checkpoint: Path, tmp_path: Path
) -> None:
    push_model(checkpoint, registry.host, "repair/kill")
    ref = registry.ref("repair/kill", "v1")
    pristine = tmp_path / "pristine"
    first = _pull(ref, pristine)
    truth = {p.relative_to(checkpoint).as_posix(): _sha256(p) for p in checkpoint.rglob("*") if p.is_file()}
    bad = _corrupt_largest_blob(pristine)

    # the repair's mutations, counted per syscall on an uninterrupted run
    full = tmp_path / "full"
    shutil.copytree(pristine, full, symlinks=True)
    rc = _verify_under_strace(full, tmp_path / "full.strace", None)
    assert rc == 1  # damage found (and repaired)
    calls = re.findall(r"^\d+\s+(\w+)\(", (tmp_path / "full.strace").read_text(), re.M)
    counts = {name: calls.count(name) for name in MUTATIONS if name in calls}
    assert counts, calls

    kills = untouched = 0
    for name, n in sorted(counts.items()):
        for k in range(1, n + 1):
            cache = tmp_path / f"c-{name}-{k}"
            shutil.copytree(pristine, cache, symlinks=True)
            rc = _verify_under_strace(cache, tmp_path / "k.strace", f"inject={name}:signal=KILL:when={k}")
            assert rc in (-9, 137), (name, k, rc)
            kills += 1
            doc = _pull(ref, cache)
            if doc["cache"]["state"] == "hit":
                # killed before the repair changed anything: the damage found before is still
                # there as it was (a hit trusts its marker), and the next verify finds it again
                assert _sha256(cache / "blobs" / "sha256" / bad.split(":")[1]) != bad, (name, k)
                untouched += 1
                assert _verify_under_strace(cache, tmp_path / "again.strace", None) == 1
                doc = _pull(ref, cache)
            snapshot = Path(doc["path"])
            got = {rel: _sha256(snapshot / rel) for rel in truth}
            assert got == truth, (name, k, doc["cache"])
            shutil.rmtree(cache)
    assert kills >= 2 and untouched < kills
    assert first["bytesDownloaded"] > 0
