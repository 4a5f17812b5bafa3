"""Node-cache fault tests against a real registry (distribution 2.8 on 127.0.0.1).

Each test tries to break one guarantee of docs/node.md#guarantees-and-the-tests-that-try-to-break-them and then checks that nothing was lost and
nothing false was marked ready. Bytes on the wire are counted by a loopback proxy in front of
the registry (``FaultProxy``) and, where it matters, by the registry's own access log.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from modelpack.mount import NodeCache

from modelpack.errors import DigestMismatchError, InsufficientSpaceError, NotFoundError, QuotaExceededError
from modelpack.events import read_events
from modelpack.targets.opener import TargetOptions
from modelpack.testdata.synthetic import SyntheticSpec, write_checkpoint
from tests.fixtures.faultproxy import FaultProxy
from tests.mount.test_cache_support import (
    committed,
    finish,
    kill_9_once_partial,
    partial_bytes,
    pull_process,
    push_model,
)

PLAIN = TargetOptions(plain_http=True)
pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def proxy(registry):  # type: ignore[no-untyped-def]
    p = FaultProxy(registry.host)
    yield p
    p.close()


def _model(tmp_path: Path, seed: int = 0, layers: int = 2) -> Path:
    d = tmp_path / f"ckpt-{seed}"
    write_checkpoint(str(d), SyntheticSpec(shards=2, seed=seed, layers=layers))
    return d


def _events(cache: Path, name: str) -> list[dict]:  # type: ignore[type-arg]
    return [e for e in read_events(str(cache / "events.jsonl")) if e["event"] == name]


def _blob_gets(registry, mark: int) -> dict[str, int]:  # type: ignore[no-untyped-def]
    counts: dict[str, int] = {}
    for method, path, status in registry.requests_since(mark):
        if method == "GET" and "/blobs/sha256:" in path and status in (200, 206):
            d = path.rsplit("/", 1)[1]
            counts[d] = counts.get(d, 0) + 1
    return counts


def test_pinned_hit_makes_no_request_and_tag_hit_only_resolves(registry, proxy, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    digest = push_model(_model(tmp_path), registry.host, "cache/hit")
    cache = NodeCache(str(tmp_path / "cache"))
    cold = cache.pull(f"{proxy.host}/cache/hit:v1", PLAIN)
    assert cold.state == "cold" and str(cold.digest) == digest
    assert proxy.total_blob_bytes() == cold.bytes_downloaded == cold.bytes_total

    proxy.clear()
    hit = cache.pull(f"{proxy.host}/cache/hit@{digest}", PLAIN)
    assert hit.state == "hit" and hit.path == cold.path
    assert proxy.requests == []  # pinned by digest: no network at all

    hit2 = cache.pull(f"{proxy.host}/cache/hit:v1", PLAIN)
    assert hit2.state == "hit"
    assert proxy.requests and all("/manifests/v1" in path for _, path, _ in proxy.requests)
    assert not proxy.blob_gets
    hits = _events(tmp_path / "cache", "cache.hit")
    assert [e["stage"] for e in hits] == ["t4", "t4"] and all(e["digest"] == digest for e in hits)
    confirmed = _events(tmp_path / "cache", "cache.version_confirmed")
    assert {e["state"] for e in confirmed} == {"cold", "hit"} and all(e["stage"] == "t2" for e in confirmed)


def test_kill_9_mid_blob_then_rerun_resumes_only_the_missing_part(registry, proxy, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    push_model(_model(tmp_path, seed=1, layers=4), registry.host, "cache/kill")
    cache_dir = tmp_path / "cache"
    ref = f"{proxy.host}/cache/kill:v1"
    proxy.rate = 512 * 1024  # per response: several seconds for the model
    proc = pull_process(cache_dir, ref)
    kill_9_once_partial(proc, cache_dir, 300_000)
    partials = partial_bytes(cache_dir)
    assert partials and sum(partials.values()) > 300_000
    before = committed(cache_dir)

    cache = NodeCache(str(cache_dir))
    # interrupted: never a hit, never visible
    assert cache.ls() == []
    with pytest.raises(NotFoundError), cache.open_snapshot(ref):
        pass

    proxy.rate = None
    proxy.wait_idle()
    proxy.clear()
    result = cache.pull(ref, PLAIN)
    assert result.state == "cold"
    sizes = {str(d.digest): d.size for d in [*_manifest(cache, result.digest).layers]}
    sizes[str(_manifest(cache, result.digest).config.digest)] = _manifest(cache, result.digest).config.size
    missing_before = {d: s for d, s in sizes.items() if d not in before}
    expected_download = sum(missing_before.values()) - sum(partials.get(d, 0) for d in missing_before)
    assert result.bytes_resumed == sum(partials.get(d, 0) for d in missing_before) > 0
    assert result.bytes_downloaded == expected_download
    assert proxy.total_blob_bytes() == expected_download  # the wire agrees with the counters
    for d, n in partials.items():
        if n:
            assert proxy.blob_bytes[d] == sizes[d] - n  # a Range request for the rest only
    assert _events(cache_dir, "cache.resume")
    assert all(r.ok for r in cache.verify())
    assert not partial_bytes(cache_dir)


def _manifest(cache: NodeCache, digest: str):  # type: ignore[no-untyped-def]
    from modelpack.oci.descriptor import Manifest

    return Manifest.parse(cache.store.read_small(digest))


def test_eight_processes_one_download_per_blob(registry, proxy, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    digest = push_model(_model(tmp_path, seed=2), registry.host, "cache/eight")
    cache_dir = tmp_path / "cache"
    ref = f"{proxy.host}/cache/eight:v1"
    proxy.rate = 1024 * 1024  # long enough for the processes to overlap
    mark = registry.log_mark()
    procs = [pull_process(cache_dir, ref) for _ in range(8)]
    results = [finish(p) for p in procs]
    assert {r["digest"] for r in results} == {digest}
    assert len({r["path"] for r in results}) == 1
    total = results[0]["cache"]["bytes"]["total"]
    assert sum(r["bytesDownloaded"] for r in results) == total  # downloaded once in all
    assert proxy.blob_gets and all(n == 1 for n in proxy.blob_gets.values())
    assert proxy.total_blob_bytes() == total
    gets = _blob_gets(registry, mark)
    assert gets and all(n == 1 for n in gets.values()), gets
    # they really overlapped: others waited on the lock of the one downloading, then reused it
    assert len(_events(cache_dir, "cache.lock_wait")) >= 1
    assert sum(r["cache"]["state"] == "cold" for r in results) >= 1
    cache = NodeCache(str(cache_dir))
    assert [e.digest for e in cache.ls()] == [digest]
    assert all(r.ok for r in cache.verify())


def test_corrupted_blob_in_registry_is_refused_with_event_and_no_snapshot(
    registry, proxy, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    digest = push_model(_model(tmp_path, seed=3), registry.host, "cache/corrupt")
    from modelpack.oci.reference import parse_reference
    from modelpack.targets.registry.target import RegistryTarget

    target = RegistryTarget.from_reference(parse_reference(registry.ref("cache/corrupt", "v1")), PLAIN)
    raw, _ = target.fetch_manifest(digest)
    from modelpack.oci.descriptor import Manifest

    layer = max(Manifest.parse(raw).layers, key=lambda x: x.size)
    data_path = registry.blob_data_path(layer.digest)
    original = data_path.read_bytes()
    tampered = bytearray(original)
    tampered[len(tampered) // 2] ^= 0xFF
    data_path.write_bytes(bytes(tampered))  # same size: only the hash can tell

    cache_dir = tmp_path / "cache"
    cache = NodeCache(str(cache_dir))
    with pytest.raises(DigestMismatchError) as exc:
        cache.pull(f"{proxy.host}/cache/corrupt:v1", PLAIN)
    assert str(layer.digest) in str(exc.value)
    failed = _events(cache_dir, "cache.verify_failed")
    assert failed and failed[0]["blob"] == str(layer.digest) and failed[0]["digest"] == digest
    assert _events(cache_dir, "cache.pull_failed")
    assert cache.ls() == [] and cache.snapshots.ready(digest) is None
    assert str(layer.digest) not in committed(cache_dir)
    assert not partial_bytes(cache_dir)
    assert not any((cache_dir / "snapshots").iterdir())

    data_path.write_bytes(original)  # repaired upstream: the next pull succeeds, nothing poisoned
    ok = cache.pull(f"{proxy.host}/cache/corrupt:v1", PLAIN)
    assert ok.state == "cold" and all(r.ok for r in cache.verify())


def test_no_space_and_quota_fail_before_download(registry, proxy, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    push_model(_model(tmp_path, seed=4), registry.host, "cache/space")
    cache_dir = tmp_path / "cache"
    st = os.statvfs(tmp_path)
    full = NodeCache(str(cache_dir), reserve_bytes=st.f_bavail * st.f_frsize)
    with pytest.raises(InsufficientSpaceError) as exc:
        full.pull(f"{proxy.host}/cache/space:v1", PLAIN)
    assert str(cache_dir) in str(exc.value) and "free" in str(exc.value)
    assert proxy.total_blob_bytes() == 0 and not proxy.blob_gets
    refused = _events(cache_dir, "cache.refused")
    assert refused[-1]["reason"] == "disk_full" and refused[-1]["bytes"] > 0

    quota = NodeCache(str(cache_dir), max_cache_bytes=100_000)
    with pytest.raises(QuotaExceededError) as qexc:
        quota.pull(f"{proxy.host}/cache/space:v1", PLAIN)
    assert "quota" in str(qexc.value)
    assert proxy.total_blob_bytes() == 0
    assert _events(cache_dir, "cache.refused")[-1]["reason"] == "quota"
    assert committed(cache_dir) == set() and quota.ls() == []


def test_gc_during_pull_and_while_in_use_deletes_neither(registry, proxy, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    old = push_model(_model(tmp_path, seed=5), registry.host, "cache/gc", "old")
    used = push_model(_model(tmp_path, seed=6), registry.host, "cache/gc", "used")
    new = push_model(_model(tmp_path, seed=7, layers=4), registry.host, "cache/gc", "new")
    cache_dir = tmp_path / "cache"
    cache = NodeCache(str(cache_dir))
    cache.pull(f"{proxy.host}/cache/gc:old", PLAIN)
    cache.pull(f"{proxy.host}/cache/gc:used", PLAIN)
    proxy.rate = 256 * 1024
    before = committed(cache_dir)
    proc = pull_process(cache_dir, f"{proxy.host}/cache/gc:new")
    try:
        with cache.open_snapshot(f"{proxy.host}/cache/gc:used") as snap:
            deadline = time.monotonic() + 60
            # wait until the pull has committed some blobs and is midway through others
            while not (committed(cache_dir) - before) or not partial_bytes(cache_dir):
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.02)
            res = cache.gc(max_bytes=0, min_age=0)
            assert old in res.evicted
            assert used in res.kept_in_use and used not in res.evicted
            assert new in res.kept_pulling
            assert committed(cache_dir) - before  # the pull's committed blobs survived GC
            assert partial_bytes(cache_dir)
            assert os.path.isfile(os.path.join(snap.path, "config.json"))
        proxy.rate = None
        done = finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert done["digest"] == new and done["cache"]["state"] == "cold"
    ready = {e.digest for e in cache.ls()}
    assert ready == {used, new}
    assert all(r.ok for r in cache.verify())
    evicts = _events(cache_dir, "cache.evict")
    assert [e["digest"] for e in evicts] == [old]


def test_a_hit_under_a_policy_is_verified_before_it_is_returned(registry, proxy, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A model cached without a policy must not satisfy a later pull that requires a signature."""
    from modelpack.signing import TrustPolicy, generate_key, sign_artifact

    from modelpack.errors import SignatureRefused
    from modelpack.oci.reference import parse_reference
    from modelpack.targets.registry.target import RegistryTarget

    digest = push_model(_model(tmp_path, seed=8), registry.host, "cache/trust")
    key = generate_key()
    policy = TrustPolicy.from_keys([key.public])
    cache_dir = tmp_path / "cache"
    cache = NodeCache(str(cache_dir))
    pinned = f"{proxy.host}/cache/trust@{digest}"
    assert cache.pull(pinned, PLAIN).state == "cold"  # no policy: not checked
    with pytest.raises(SignatureRefused):
        cache.pull(pinned, PLAIN, policy=policy)  # unsigned: the hit is refused
    assert _events(cache_dir, "cache.signature_refused")[-1]["digest"] == digest

    target = RegistryTarget.from_reference(
        parse_reference(registry.ref("cache/trust", "v1")), PLAIN, for_write=True
    )
    sign_artifact(target, target.resolve("v1"), key, chunk_table=False, directory_signature=False)
    ok = cache.pull(pinned, PLAIN, policy=policy)
    assert ok.state == "hit" and ok.signature == "verified"
    proxy.clear()
    again = cache.pull(pinned, PLAIN, policy=policy)  # verified before with this key: no network
    assert again.state == "hit" and again.signature == "verified" and proxy.requests == []
    assert _events(cache_dir, "cache.signature_verified")[-1]["cached"] is True
    other = TrustPolicy.from_keys([generate_key().public])
    with pytest.raises(SignatureRefused):
        cache.pull(pinned, PLAIN, policy=other)  # another key: checked again, and refused
