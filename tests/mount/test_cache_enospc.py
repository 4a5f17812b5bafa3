"""A full disk while the node cache commits a manifest leaks nothing and says where.

A real tmpfs holds the cache; every blob of the model is already committed (an earlier pull whose
snapshot and manifest blob are gone), and the filesystem is then filled to the last byte, so the
last write of the next ``pull --cache`` is the manifest's commit (``Store.put_bytes``). Before
the fix it left ``ingest/.tmp-modelpack-…`` behind, past a successful rerun, and the message
("No space left on device") named no path; so did a full disk at the pull's first write.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from modelpack.cli import main
from tests.fixtures.faultproxy import FaultProxy
from tests.fixtures.registry import RegistryServer
from tests.mount.test_cache_support import partial_bytes, push_model
from tests.pull_dir_helpers import small_tmpfs, temp_entries

pytestmark = pytest.mark.timeout(180)

MODELPACK = str(Path(sys.executable).with_name("modelpack"))


def _fill(directory: Path, leave: int = 0) -> None:
    """Write zeros into ``directory`` until its filesystem has no byte left, then give back
    ``leave`` bytes."""
    fd = os.open(directory / "filler", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        block = 64 * 1024
        while block:
            try:
                os.write(fd, b"\0" * block)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
                block //= 2
        os.ftruncate(fd, os.fstat(fd).st_size - leave)
    finally:
        os.close(fd)


@pytest.mark.parametrize("leave", [4096, 0], ids=["manifest-commit", "first-write"])
def test_full_disk_while_committing_the_manifest(
    registry: RegistryServer, checkpoint: Path, tmp_path: Path, leave: int
) -> None:
    digest = push_model(checkpoint, registry.host, f"enospc/m{leave}")
    ref = registry.ref(f"enospc/m{leave}", "v1")
    with small_tmpfs(tmp_path / "fs", "24m") as fs:
        assert fs is not None, "tests run as root and may mount a tmpfs"
        cache = fs / "cache"
        events = tmp_path / "events.jsonl"  # the event log lives off the full disk
        args = ["pull", ref, "--cache", str(cache), "--plain-http", "--events", str(events)]
        r = CliRunner().invoke(main, [*args, "--json"])
        assert r.exit_code == 0, r.output
        snapshot = Path(json.loads(r.stdout)["path"])
        # keep every blob, lose the snapshot and the manifest blob
        os.unlink(str(snapshot) + ".ready")
        shutil.rmtree(snapshot)
        manifest_blob = cache / "blobs" / "sha256" / digest.split(":")[1]
        manifest_blob.unlink()
        # one page left: the pull's lease record fits, the manifest does not; none: the first
        # write (the lease record) fails, and that error names its file too
        _fill(fs, leave=leave)

        r = CliRunner().invoke(main, args)
        assert r.exit_code == 1, r.output
        assert "Traceback" not in r.output
        named = str(manifest_blob) if leave else str(cache)
        assert r.stderr.startswith(f"error: {named}") and "no space left" in r.stderr.lower(), r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert temp_entries(cache) == []

        (fs / "filler").unlink()
        r = CliRunner().invoke(main, args)
        assert r.exit_code == 0, r.output
        assert manifest_blob.is_file()
        assert temp_entries(cache) == []


def test_full_disk_mid_download_keeps_the_partial_and_names_it(
    registry: RegistryServer, checkpoint: Path, tmp_path: Path
) -> None:
    """The disk fills up (another writer) while a blob downloads: one line naming the partial,
    which stays; once there is room, the next pull resumes it instead of starting over."""
    push_model(checkpoint, registry.host, "enospc/download")
    proxy = FaultProxy(registry.host, rate=512 * 1024)  # seconds for the model
    try:
        with small_tmpfs(tmp_path / "fs", "24m") as fs:
            assert fs is not None, "tests run as root and may mount a tmpfs"
            cache = fs / "cache"
            args = [MODELPACK, "pull", f"{proxy.host}/enospc/download:v1", "--cache", str(cache), "--json"]
            env = {**os.environ, "CI": "1"}
            proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            deadline = time.monotonic() + 60
            while not any(n > 64 * 1024 for n in partial_bytes(cache).values()):
                assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
                time.sleep(0.02)
            _fill(fs)  # the racing writer
            _, err = proc.communicate(timeout=120)
            assert proc.returncode == 1, err
            partials = list((cache / "ingest").glob("*.partial"))
            # one per blob in flight that held bytes (an empty partial resumes nothing and is
            # removed): the one the test watched grow is among them
            assert partials and all(p.stat().st_size > 0 for p in partials)
            # the error names the blob that met the full disk first, and tells the truth about it:
            # its partial kept for a resume, or (when its first write failed) nothing kept
            named = [p for p in partials if err.startswith(f"error: {p}")]
            if named:
                assert "kept in" in err and "resume" in err, err
            else:
                assert err.startswith(f"error: {cache / 'ingest'}") and "nothing was kept" in err, err
            assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
            assert temp_entries(cache) == []

            (fs / "filler").unlink()
            again = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120)
            assert again.returncode == 0, again.stderr
            doc = json.loads(again.stdout)
            assert doc["cache"]["bytes"]["resumed"] > 0, doc["cache"]
    finally:
        proxy.close()
