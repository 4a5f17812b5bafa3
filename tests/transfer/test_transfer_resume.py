"""Interrupted pushes resume: from the registry's reported offset within a blob, and without
re-sending blobs that were already committed (client killed with SIGKILL mid-push)."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import BinaryIO

import pytest

from modelpack.api import transfer
from modelpack.errors import DigestMismatchError, RegistryConnectionError, RegistryError, UploadSourceError
from modelpack.oci.descriptor import Descriptor
from modelpack.oci.digest import Digest
from modelpack.targets.base import BlobSource, file_blob_source
from modelpack.targets.opener import TargetOptions, open_target
from modelpack.targets.registry.target import RegistryTarget
from modelpack.testdata.synthetic import SyntheticSpec, write_checkpoint
from tests.fixtures.registry import RegistryFactory, RegistryServer

MiB = 1024 * 1024


@pytest.fixture(autouse=True)
def _upload_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "upload-state"
    monkeypatch.setenv("MODELPACK_UPLOAD_STATE_DIR", str(d))
    return d


def _target(registry: RegistryServer, repo: str, chunk: int) -> RegistryTarget:
    opts = TargetOptions(extra={"chunk_size": chunk})
    t = open_target(registry.ref(repo, None), opts, for_write=True)
    assert isinstance(t, RegistryTarget)
    return t


class _FailAfter:
    """A file stream that fails with OSError once ``limit`` bytes were read (a dying source)."""

    def __init__(self, f: BinaryIO, limit: int) -> None:
        self._f = f
        self._left = limit

    def read(self, n: int = -1) -> bytes:
        if self._left <= 0:
            raise OSError("source went away")
        if n < 0 or n > self._left:
            n = self._left
        data = self._f.read(n)
        self._left -= len(data)
        return data

    def close(self) -> None:
        self._f.close()


def _blob(tmp_path: Path, size: int) -> tuple[Path, Descriptor]:
    path = tmp_path / "blob.bin"
    path.write_bytes(os.urandom(size))
    data = path.read_bytes()
    return path, Descriptor("application/octet-stream", Digest.from_bytes(data), size)


def test_chunked_upload_resumes_from_the_registry_offset(registry: RegistryServer, tmp_path: Path) -> None:
    path, desc = _blob(tmp_path, 5 * MiB + 123)
    target = _target(registry, "resume/offset", MiB)

    def dying(offset: int) -> BinaryIO:
        f = open(path, "rb")
        f.seek(offset)
        return _FailAfter(f, 3 * MiB)  # type: ignore[return-value]

    # a source that cannot be read is not a network cut: no retries, and the error says so
    with pytest.raises(UploadSourceError) as exc:
        target.push_blob(BlobSource(desc, dying))
    assert str(desc.digest) in str(exc.value) and "source went away" in str(exc.value)
    assert target.stats.get("upload_retries", 0) == 0
    assert not target.exists(desc)

    # a new process (fresh target object) picks the session up from the saved state
    again = _target(registry, "resume/offset", MiB)
    mark = registry.log_mark()
    again.push_blob(file_blob_source(desc, path))
    assert again.stats["resumed"] == 1
    after = registry.requests_since(mark)
    # (the aborted PATCH of the first attempt may be logged late, with an error status)
    patches = [r for r in after if r[0] == "PATCH" and r[2] == 202]
    assert len(patches) == 3  # 2 MiB + 123 B were left: 1 MiB chunks
    assert not [r for r in after if r[0] == "POST"]
    assert [r for r in after if r[0] == "GET" and "/blobs/uploads/" in r[1]]  # asked for the offset
    assert again.exists(desc)
    with again.fetch_blob(desc) as f:
        assert hashlib.sha256(f.read()).hexdigest() == desc.digest.hex


def test_source_that_does_not_match_its_digest_is_never_committed(
    registry: RegistryServer, tmp_path: Path
) -> None:
    path, desc = _blob(tmp_path, 3 * MiB)
    wrong = Descriptor(desc.media_type, Digest.from_bytes(b"something else"), desc.size)
    for chunk in (MiB, 64 * MiB):  # chunked and monolithic
        target = _target(registry, f"resume/wrong{chunk}", chunk)
        with pytest.raises(DigestMismatchError) as exc:
            target.push_blob(file_blob_source(wrong, path))
        assert str(wrong.digest) in str(exc.value) and str(path) in str(exc.value)
        assert not target.exists(wrong)


def _committed(registry: RegistryServer, mark: int = 0) -> list[str]:
    """Hex digests of blobs committed (final PUT ?digest=…, 201) after ``mark``."""
    out = []
    for method, path, status in registry.requests_since(mark):
        if method == "PUT" and "/blobs/uploads/" in path and "digest=sha256%3A" in path and status == 201:
            out.append(path.split("digest=sha256%3A", 1)[1][:64])
    return out


def test_push_killed_midway_resumes_without_resending_blobs(
    registry_factory: RegistryFactory, tmp_path: Path, _upload_state: Path
) -> None:
    registry = registry_factory.start()
    ckpt = tmp_path / "ckpt"
    write_checkpoint(str(ckpt), SyntheticSpec(hidden=512, intermediate=1376, layers=4, vocab=4096, shards=4))
    ref = registry.ref("resume/killed", "v1")
    env = {**os.environ, "MODELPACK_UPLOAD_STATE_DIR": str(_upload_state), "CI": "1"}
    cmd = [
        sys.executable,
        "-c",
        "from modelpack.cli import main; main()",
        "push",
        str(ckpt),
        ref,
        "--chunk-size",
        "256K",
        "-j",
        "1",
    ]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        # kill it once at least one blob is committed and another upload is under way
        while time.monotonic() < deadline and proc.poll() is None:
            done = _committed(registry)
            if len(done) >= 2 and any(r[0] == "PATCH" for r in registry.requests_since(0)[-2:]):
                break
            time.sleep(0.002)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL, "the push finished before it could be interrupted"
    before = set(_committed(registry))
    assert before

    mark = registry.log_mark()
    result = transfer.push(
        str(ckpt), ref, target_options=TargetOptions(extra={"chunk_size": 256 * 1024}), jobs=1, progress="off"
    )
    resent = set(_committed(registry, mark)) & before
    assert not resent, f"re-sent committed blobs: {resent}"
    assert result.copy.blobs_skipped >= len(before)
    assert result.copy.blobs_copied + result.copy.blobs_skipped == result.copy.blobs_total
    pulled = transfer.pull(ref, str(tmp_path / "pulled"), progress="off")
    assert pulled.digest == result.digest
    for rel in pulled.files:
        assert (tmp_path / "pulled" / rel).read_bytes() == (ckpt / rel).read_bytes()


def test_idempotent_requests_retry_across_a_registry_restart(
    registry_factory: RegistryFactory, checkpoint: Path, tmp_path: Path
) -> None:
    registry = registry_factory.start()
    pushed = transfer.push(str(checkpoint), registry.ref("retry/model", "v1"), progress="off")
    target = _target(registry, "retry/model", MiB)
    registry.kill()
    # a GET while the registry is down is retried with backoff and succeeds once it is back
    timer = threading.Timer(0.5, registry_factory.restart, args=(registry,))
    timer.start()
    try:
        assert target.resolve("v1").digest == pushed.digest
    finally:
        timer.join()
    # a POST (not idempotent) is not retried: it fails at once while the registry is down
    registry.kill()
    started = time.monotonic()
    with pytest.raises(RegistryConnectionError):
        target._uploads.start()
    assert time.monotonic() - started < 5
    registry_factory.restart(registry)


def test_push_survives_a_registry_restart_midway(registry_factory: RegistryFactory, tmp_path: Path) -> None:
    registry = registry_factory.start()
    ckpt = tmp_path / "ckpt"
    write_checkpoint(str(ckpt), SyntheticSpec(hidden=512, intermediate=1376, layers=4, vocab=4096, shards=4))
    ref = registry.ref("restart/model", "v1")
    opts = TargetOptions(extra={"chunk_size": 256 * 1024})
    outcome: list[BaseException | None] = []

    def push() -> None:
        try:
            transfer.push(str(ckpt), ref, target_options=opts, jobs=1, progress="off")
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    worker = threading.Thread(target=push)
    worker.start()
    deadline = time.monotonic() + 60
    # restart it while a chunked upload is under way (after two blobs were committed)
    while time.monotonic() < deadline and worker.is_alive():
        if len(_committed(registry)) >= 2 and registry.requests_since(0)[-1][0] == "PATCH":
            break
        time.sleep(0.002)
    assert worker.is_alive(), "the push finished before the registry could be restarted"
    registry_factory.restart(registry, kill=True)
    worker.join(timeout=120)
    # an in-flight PATCH is not idempotent, so the push fails with a typed error (not a hang);
    # if the restart fell between two requests, the retried HEAD/GET lets it finish instead
    assert outcome and (outcome[0] is None or isinstance(outcome[0], RegistryError)), outcome
    before = set(_committed(registry))
    mark = registry.log_mark()
    result = transfer.push(str(ckpt), ref, target_options=opts, jobs=1, progress="off")
    assert not set(_committed(registry, mark)) & before
    pulled = transfer.pull(ref, str(tmp_path / "pulled"), progress="off")
    assert pulled.digest == result.digest
    for rel in pulled.files:
        assert (tmp_path / "pulled" / rel).read_bytes() == (ckpt / rel).read_bytes()
