"""A push rides out lost sessions, 500s and 429s; one retry budget per command.

Every case is a real registry (Debian's ``docker-registry``) behind the FaultProxy:

- the registry restarted between two PATCHes with its ``_uploads`` purged, or with a new
  ``http.secret``: the next PATCH is answered ``404 BLOB_UPLOAD_UNKNOWN`` /
  ``BLOB_UPLOAD_INVALID`` (before the fix, the push exited 1; a rerun succeeded);
- one ``500`` on one PATCH (before: the whole push failed);
- a ``429`` with ``Retry-After: 2`` on a PATCH (before: the next request came 0.2 s later);
- ``--retry-for`` as one budget for the command: four blobs in a row each meeting a 1 s outage
  fit a per-blob budget of 2.5 s, and exhaust a per-command one (before: the push succeeded);
- ten concurrent pushes of one model: distribution 2.8 answers some identical manifest PUTs with
  ``400 DIGEST_INVALID`` (before: 1–4 of 10 failed);
- ``-j 1``: after a blob's upload failed, the next queued blob is never sent (before: every
  queued blob still opened an upload session).
"""

from __future__ import annotations

import re
import shutil
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from modelpack.api import transfer
from modelpack.cli import main
from modelpack.errors import RegistryError
from modelpack.targets.opener import TargetOptions
from modelpack.testdata.synthetic import SyntheticSpec, write_checkpoint
from tests.fixtures.faultproxy import Fault, FaultProxy, request
from tests.fixtures.registry import RegistryFactory, RegistryServer, restart_registry

pytestmark = pytest.mark.timeout(240)

CHUNK = 256 * 1024
UPLOAD_PATH = r"/blobs/uploads/[0-9a-f-]{36}"


def _checkpoint(tmp_path: Path, shards: int = 2, seed: int = 5) -> Path:
    """Shards of ~1.1 MiB each: several 256 KiB PATCHes per shard."""
    ckpt = tmp_path / f"ckpt-{shards}-{seed}"
    write_checkpoint(
        str(ckpt), SyntheticSpec(hidden=384, intermediate=1024, layers=2, shards=shards, seed=seed)
    )
    return ckpt


def _same_files(server: RegistryServer, repo: str, ckpt: Path, tmp_path: Path) -> None:
    res = transfer.pull(server.ref(repo, "v1"), str(tmp_path / "back"), progress="off")
    assert res.files
    for rel in res.files:
        assert (tmp_path / "back" / rel).read_bytes() == (ckpt / rel).read_bytes(), rel


def _losing_sessions(server: RegistryServer, *, new_secret: bool) -> None:
    """Stop the registry, lose every upload session it had, start it again on its port."""
    server.stop()
    for uploads in server.storage.glob("docker/registry/v2/repositories/**/_uploads"):
        shutil.rmtree(uploads)
    if new_secret:
        text = server.config_path.read_text()
        server.config_path.write_text(re.sub(r"secret: \S+", "secret: " + "5e" * 16, text))
    restart_registry(server)


@pytest.mark.parametrize("how", ["uploads-purged", "new-http-secret"])
def test_a_session_lost_between_two_patches_restarts_that_blob(
    registry_factory: RegistryFactory, tmp_path: Path, how: str
) -> None:
    server = registry_factory.start()
    proxy = FaultProxy(server.host)
    try:
        ckpt = _checkpoint(tmp_path)
        # after two acknowledged PATCHes, the registry restarts before the third reaches it
        restart = Fault(
            match=request("PATCH", UPLOAD_PATH),
            skip=2,
            times=1,
            before=lambda: _losing_sessions(server, new_secret=how == "new-http-secret"),
        )
        proxy.add(restart)
        opts = TargetOptions(extra={"chunk_size": CHUNK})
        pushed = transfer.push(
            str(ckpt), f"{proxy.host}/lost/{how}:v1", target_options=opts, jobs=1, progress="off"
        )
        assert proxy.fired[0] == 1
        # the third PATCH met the restarted registry, which no longer knew the session
        refused = [(m, s) for _, m, p, s in proxy.log if m == "PATCH" and s in (400, 404)]
        assert refused == [("PATCH", 404)], proxy.log
        assert pushed.copy.blobs_copied >= 3
    finally:
        proxy.close()
    _same_files(server, f"lost/{how}", ckpt, tmp_path)


def test_one_500_on_one_patch_is_retried_in_the_same_session(
    registry: RegistryServer, tmp_path: Path
) -> None:
    proxy = FaultProxy(registry.host)
    try:
        ckpt = _checkpoint(tmp_path, seed=6)
        proxy.add(Fault(match=request("PATCH", UPLOAD_PATH), skip=1, times=1, status=500))
        mark = registry.log_mark()
        opts = TargetOptions(extra={"chunk_size": CHUNK})
        pushed = transfer.push(
            str(ckpt), f"{proxy.host}/err500/m:v1", target_options=opts, jobs=1, progress="off"
        )
        assert proxy.fired[0] == 1
        seen = registry.requests_since(mark)
        # continued where the registry stood (an upload-status GET), no extra session
        assert len([1 for m, _, s in seen if m == "POST" and s == 202]) == pushed.copy.blobs_copied
        assert any(m == "GET" and "/blobs/uploads/" in p for m, p, _ in seen)
    finally:
        proxy.close()
    _same_files(registry, "err500/m", ckpt, tmp_path)


def test_a_429_retry_after_is_honoured_on_uploads(registry: RegistryServer, tmp_path: Path) -> None:
    proxy = FaultProxy(registry.host)
    try:
        ckpt = _checkpoint(tmp_path, seed=7)
        proxy.add(
            Fault(
                match=request("PATCH", UPLOAD_PATH), skip=1, times=1, status=429, headers={"Retry-After": "2"}
            )
        )
        opts = TargetOptions(extra={"chunk_size": CHUNK})
        transfer.push(str(ckpt), f"{proxy.host}/slowdown/m:v1", target_options=opts, jobs=1, progress="off")
        answered = [i for i, (_, _, _, s) in enumerate(proxy.log) if s == 429]
        assert len(answered) == 1
        i = answered[0]
        pause = proxy.log[i + 1][0] - proxy.log[i][0]
        assert pause >= 1.9, f"next request {pause:.2f} s after the 429"
    finally:
        proxy.close()
    _same_files(registry, "slowdown/m", ckpt, tmp_path)


def _first_patch_of_each_session() -> object:
    """A matcher for the first PATCH of every upload session (each blob's first chunk)."""
    seen: set[str] = set()
    lock = threading.Lock()
    rx = re.compile(UPLOAD_PATH)

    def match(method: str, path: str, headers: dict[str, str]) -> bool:
        m = rx.search(path)
        if method != "PATCH" or m is None:
            return False
        with lock:
            if m.group(0) in seen:
                return False
            seen.add(m.group(0))
            return True

    return match


def test_retry_for_is_one_budget_for_the_whole_command(registry: RegistryServer, tmp_path: Path) -> None:
    proxy = FaultProxy(registry.host)
    try:
        ckpt = _checkpoint(tmp_path, shards=4, seed=8)
        # every blob's first chunk meets a 1 s outage ("503, come back in 1 s"), one blob after
        # the other (-j 1): 1 s per blob fits a 2.5 s budget per blob, not one per command
        proxy.add(
            Fault(match=_first_patch_of_each_session(), times=None, status=503, headers={"Retry-After": "1"})  # type: ignore[arg-type]
        )
        started = time.monotonic()
        r = CliRunner().invoke(
            main,
            [
                "push",
                str(ckpt),
                f"{proxy.host}/budget/m:v1",
                "-j",
                "1",
                "--retry-for",
                "2.5s",
                "--chunk-size",
                str(CHUNK),
            ],
        )
        took = time.monotonic() - started
        assert r.exit_code == 1, r.output
        assert "--retry-for" in r.output and "Traceback" not in r.output
        # 1 s + 1 s + a pause cut short to the 0.5 s left: the fourth blob's outage finds it spent
        assert proxy.fired[0] == 4, proxy.fired
        assert took < 10, took
    finally:
        proxy.close()


def test_concurrent_identical_pushes_all_succeed(registry: RegistryServer, tmp_path: Path) -> None:
    ckpt = _checkpoint(tmp_path, seed=9)
    failures: list[BaseException] = []
    for round_ in range(2):
        barrier = threading.Barrier(10)

        def push(
            ref: str = registry.ref(f"race/r{round_}", "v1"), barrier: threading.Barrier = barrier
        ) -> None:
            barrier.wait(timeout=30)
            try:
                transfer.push(str(ckpt), ref, progress="off")
            except BaseException as exc:
                failures.append(exc)

        threads = [threading.Thread(target=push) for _ in range(10)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads)
    assert failures == []
    _same_files(registry, "race/r1", ckpt, tmp_path)


def test_with_one_job_no_blob_starts_after_one_failed(registry: RegistryServer, tmp_path: Path) -> None:
    proxy = FaultProxy(registry.host)
    try:
        ckpt = _checkpoint(tmp_path, shards=3, seed=10)
        denied = b'{"errors":[{"code":"DENIED","message":"requested access to the resource is denied"}]}'
        proxy.add(Fault(match=request("POST", r"/blobs/uploads/$"), times=None, status=403, body=denied))
        with pytest.raises(RegistryError):
            transfer.push(str(ckpt), f"{proxy.host}/stop/m:v1", jobs=1, progress="off")
        posts = [p for _, m, p, _ in proxy.log if m == "POST"]
        assert len(posts) == 1, posts
    finally:
        proxy.close()
