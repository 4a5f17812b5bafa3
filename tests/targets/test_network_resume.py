"""A registry read or write that loses its connection resumes within the run.

Every case starts from the fault: a proxy that cuts a body mid-way (``FaultProxy(cut_after=…)``),
refuses a PATCH, PUT or POST after reading it, or a registry killed and restarted in the middle of
a pull or a push. Before the fix each ended in a urllib3 ``ProtocolError`` traceback (reads) or a
push that failed at the first cut PATCH; now reads continue from the byte they reached with a
``Range`` request (the proxy's byte counters show each blob crossed the wire once) and uploads ask
the registry where the session stands. When the retry budget (``--retry-for``) is spent the
error is typed and names the registry and the blob.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from modelpack.loader.readers import TargetReader
from modelpack.mount import NodeCache

from modelpack.api import transfer
from modelpack.cli import main
from modelpack.errors import RegistryConnectionError
from modelpack.oci.reference import parse_reference
from modelpack.targets.fetch import fetch_manifest
from modelpack.targets.opener import TargetOptions, open_readable
from modelpack.targets.retry import RetryBudget, parse_duration
from modelpack.testdata.synthetic import SyntheticSpec, write_checkpoint
from tests.fixtures.faultproxy import Fault, FaultProxy, blob_get, manifest_get, request
from tests.fixtures.registry import RegistryFactory, RegistryServer

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def proxy(registry: RegistryServer):  # type: ignore[no-untyped-def]
    p = FaultProxy(registry.host)
    yield p
    p.close()


def _pushed(registry: RegistryServer, checkpoint: Path, repo: str) -> tuple[str, list]:  # type: ignore[type-arg]
    """Push ``checkpoint`` straight to the registry; (digest, layers largest first)."""
    res = transfer.push(str(checkpoint), registry.ref(repo, "v1"), progress="off")
    target = open_readable(registry.ref(repo, None))
    manifest, _ = fetch_manifest(target, res.digest)
    return res.digest, sorted(manifest.layers, key=lambda d: -d.size)


def _same_files(pulled: Path, checkpoint: Path, names: list[str]) -> None:
    assert names
    for rel in names:
        assert (pulled / rel).read_bytes() == (checkpoint / rel).read_bytes(), rel


def _gets(proxy: FaultProxy, digest: str) -> int:
    return sum(1 for m, path, _ in proxy.requests if m == "GET" and path.endswith(f"/blobs/{digest}"))


def test_pull_to_a_directory_resumes_cut_blobs_from_the_byte_reached(
    registry: RegistryServer, proxy: FaultProxy, checkpoint: Path, tmp_path: Path
) -> None:
    digest, layers = _pushed(registry, checkpoint, "resume/dir")
    big = layers[0]
    third = big.size // 3
    proxy.add(Fault(match=blob_get(str(big.digest)), cut_after=third, times=2))  # cut twice
    proxy.add(Fault(match=blob_get(str(layers[1].digest)), cut_after=1000, times=1))
    res = transfer.pull(f"{proxy.host}/resume/dir:v1", str(tmp_path / "out"), progress="off")
    assert res.digest == digest
    _same_files(tmp_path / "out", checkpoint, list(res.files))
    proxy.settle()
    assert sum(proxy.fired.values()) == 3
    # resumed where the cut left it: each byte crossed the wire once, in three requests
    assert proxy.blob_bytes[str(big.digest)] == big.size
    assert _gets(proxy, str(big.digest)) == 3
    assert proxy.blob_bytes[str(layers[1].digest)] == layers[1].size


def test_pull_into_the_node_cache_resumes_a_cut_blob(
    registry: RegistryServer, proxy: FaultProxy, checkpoint: Path, tmp_path: Path
) -> None:
    digest, layers = _pushed(registry, checkpoint, "resume/cache")
    big = layers[0]
    proxy.add(Fault(match=blob_get(str(big.digest)), cut_after=big.size // 2, times=1))
    cache = NodeCache(str(tmp_path / "cache"))
    result = cache.pull(f"{proxy.host}/resume/cache:v1", TargetOptions())
    assert str(result.digest) == digest and result.state == "cold"
    proxy.settle()
    assert proxy.fired and proxy.blob_bytes[str(big.digest)] == big.size
    assert _gets(proxy, str(big.digest)) == 2
    snapshot = Path(result.path)
    for f in checkpoint.glob("*.safetensors"):
        assert (snapshot / f.name).read_bytes() == f.read_bytes()


def test_manifest_get_and_loader_range_reads_survive_cuts(
    registry: RegistryServer, proxy: FaultProxy, checkpoint: Path
) -> None:
    digest, layers = _pushed(registry, checkpoint, "resume/ranges")
    proxy.add(Fault(match=manifest_get("v1"), cut_after=40, times=2))
    target = open_readable(f"{proxy.host}/resume/ranges:v1")
    assert str(target.resolve("v1").digest) == digest

    big = layers[0]
    whole = open_readable(registry.ref("resume/ranges", None)).fetch_range(big, 0, big.size)
    proxy.add(Fault(match=blob_get(str(big.digest)), cut_after=5000, times=3))
    reader = TargetReader(target, big)
    buf = bytearray(300_000)
    reader.read_into(1234, memoryview(buf))
    assert bytes(buf) == whole[1234 : 1234 + len(buf)]
    proxy.settle()
    # the range was continued, not restarted: 3 cut requests of 5000 bytes + the rest
    assert proxy.blob_bytes[str(big.digest)] == len(buf)
    assert _gets(proxy, str(big.digest)) == 4


def test_push_continues_after_refused_patch_put_and_post(
    registry: RegistryServer, proxy: FaultProxy, tmp_path: Path
) -> None:
    ckpt = tmp_path / "ckpt"
    write_checkpoint(str(ckpt), SyntheticSpec(shards=2, seed=3))
    # the proxy reads each of these requests whole, then drops the connection without an answer
    proxy.add(Fault(match=request("PATCH", r"/blobs/uploads/"), refuse=True, times=2))
    proxy.add(Fault(match=request("PUT", r"/blobs/uploads/.*digest="), refuse=True, times=2))
    proxy.add(Fault(match=request("POST", r"/blobs/uploads/$"), refuse=True, times=1))
    mark = registry.log_mark()
    opts = TargetOptions(extra={"chunk_size": 256 * 1024})
    pushed = transfer.push(
        str(ckpt), f"{proxy.host}/resume/push:v1", target_options=opts, jobs=1, progress="off"
    )
    assert sum(proxy.fired.values()) == 5
    # refused chunks were followed by an upload-status GET and continued in the same session:
    # one POST per uploaded blob (plus the refused one the registry never saw)
    seen = registry.requests_since(mark)
    posts = [p for m, p, s in seen if m == "POST" and s == 202]
    assert len(posts) == pushed.copy.blobs_copied
    assert any(m == "GET" and "/blobs/uploads/" in p for m, p, _ in seen)
    res = transfer.pull(registry.ref("resume/push", "v1"), str(tmp_path / "back"), progress="off")
    assert res.digest == pushed.digest
    _same_files(tmp_path / "back", ckpt, list(res.files))


def _bigger_checkpoint(tmp_path: Path) -> Path:
    ckpt = tmp_path / "big"
    write_checkpoint(str(ckpt), SyntheticSpec(hidden=512, intermediate=1376, layers=4, vocab=4096, shards=4))
    return ckpt


def test_pull_rides_out_a_registry_restart(registry_factory: RegistryFactory, tmp_path: Path) -> None:
    server = registry_factory.start()
    ckpt = _bigger_checkpoint(tmp_path)
    pushed = transfer.push(str(ckpt), server.ref("restart/pull", "v1"), progress="off")
    slow = FaultProxy(server.host, rate=4 * 1024 * 1024)  # a few seconds for the whole model
    outcome: list[BaseException | None] = []

    def pull() -> None:
        try:
            transfer.pull(f"{slow.host}/restart/pull:v1", str(tmp_path / "out"), jobs=2, progress="off")
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    try:
        worker = threading.Thread(target=pull)
        worker.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and sum(slow.blob_bytes.values()) < 2 * 1024 * 1024:
            time.sleep(0.01)
        assert worker.is_alive(), "the pull finished before the registry could be killed"
        server.kill()
        time.sleep(1.5)  # down for a while: reads and reconnects fail, then are retried
        registry_factory.restart(server)
        worker.join(timeout=150)
    finally:
        slow.close()
    assert outcome == [None], outcome
    pulled = transfer.pull(server.ref("restart/pull", "v1"), str(tmp_path / "check"), progress="off")
    assert pulled.digest == pushed.digest
    _same_files(tmp_path / "out", ckpt, list(pulled.files))


def test_push_rides_out_a_registry_restart(registry_factory: RegistryFactory, tmp_path: Path) -> None:
    server = registry_factory.start()
    ckpt = _bigger_checkpoint(tmp_path)
    opts = TargetOptions(extra={"chunk_size": 256 * 1024})
    outcome: list[BaseException | None] = []

    def push() -> None:
        try:
            transfer.push(
                str(ckpt), server.ref("restart/push", "v1"), target_options=opts, jobs=1, progress="off"
            )
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    worker = threading.Thread(target=push)
    worker.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and worker.is_alive():
        if sum(1 for m, _, _ in server.requests_since(0) if m == "PATCH") >= 3:
            break
        time.sleep(0.002)
    assert worker.is_alive(), "the push finished before the registry could be killed"
    server.kill()
    time.sleep(1.0)
    registry_factory.restart(server)
    worker.join(timeout=150)
    assert outcome == [None], outcome
    res = transfer.pull(server.ref("restart/push", "v1"), str(tmp_path / "back"), progress="off")
    _same_files(tmp_path / "back", ckpt, list(res.files))


def test_spent_budget_is_a_typed_error_naming_registry_and_blob(
    registry: RegistryServer, proxy: FaultProxy, checkpoint: Path, tmp_path: Path
) -> None:
    _, layers = _pushed(registry, checkpoint, "resume/budget")
    big = layers[0]
    proxy.add(Fault(match=blob_get(str(big.digest)), cut_after=100, times=None))  # always cut
    ref = f"{proxy.host}/resume/budget:v1"
    target = open_readable(ref, TargetOptions(retry_for=0.5))
    stream = target.fetch_blob(big)
    started = time.monotonic()
    with pytest.raises(RegistryConnectionError) as exc:
        while stream.read(1 << 20):
            pass
    assert time.monotonic() - started < 10
    assert proxy.host in str(exc.value) and str(big.digest) in str(exc.value)

    r = CliRunner().invoke(main, ["pull", ref, str(tmp_path / "cli"), "--retry-for", "1s"])
    assert r.exit_code == 1, r.output
    assert "Traceback" not in r.output and "ProtocolError(" not in r.output
    assert str(big.digest) in r.output and proxy.host in r.output and "--retry-for" in r.output


def test_retry_budget_and_durations() -> None:
    assert parse_duration("90") == 90 and parse_duration("2m") == 120 and parse_duration("500ms") == 0.5
    with pytest.raises(ValueError):
        parse_duration("soon")
    off = RetryBudget(0)
    assert off.next_delay() is None
    budget = RetryBudget(5)
    delays = [budget.next_delay() for _ in range(4)]
    assert all(d is not None and 0 < d <= 8 for d in delays)
    assert delays[3] > delays[0]  # exponential, whatever the jitter
    budget.progressed()
    assert budget.attempts == 0
    assert parse_reference("127.0.0.1:5000/a:b").location == "127.0.0.1:5000"


def test_a_silent_connection_is_resumed_as_the_retry_settings_say(
    registry: RegistryServer, proxy: FaultProxy, checkpoint: Path, tmp_path: Path
) -> None:
    """A blob GET whose connection goes silent (headers, then nothing for 30 s)
    used to cost the 300 s socket read timeout before the Range resume; with ``--retry-for 4s``
    it is resumed after 2 s."""
    digest, layers = _pushed(registry, checkpoint, "resume/silent")
    big = layers[0]
    proxy.add(Fault(match=blob_get(str(big.digest)), stall=30, times=1))
    started = time.monotonic()
    res = transfer.pull(
        f"{proxy.host}/resume/silent:v1",
        str(tmp_path / "out"),
        target_options=TargetOptions(retry_for=4),
        progress="off",
    )
    took = time.monotonic() - started
    assert res.digest == digest
    _same_files(tmp_path / "out", checkpoint, list(res.files))
    assert proxy.fired[0] == 1
    assert _gets(proxy, str(big.digest)) == 2  # the silent one, then the resume
    assert 1.5 < took < 15, took
