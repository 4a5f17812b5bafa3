"""``cache serve --fill`` under faults: variant indexes, a stalled origin, a stop mid-fill, bounds.

Real parts: a real origin registry (behind the fault proxy where the link must be slow or
stall), ``cache serve`` as a real subprocess where signals and CLI options are the point, or
``CacheServer`` in this process where the test reads the filler's counters; raw HTTP requests
play the requesters. What is checked: a pinned variant index fills every entry's manifest and
blobs (one origin GET per blob); one pinned manifest that stalls at the origin does not hold up
another model's fills; SIGTERM mid-fill leaves no temp file; ``--fill-quota`` and
``--fill-concurrency`` bound what they say.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from modelpack.mount.serve import CacheServer, ServeSettings
from modelpack.mount.serve_fill import FillSettings
from modelpack.mount.store import Store

from modelpack import api
from modelpack.api.variants import create_index
from modelpack.oci.descriptor import Descriptor, Manifest
from modelpack.targets.fetch import fetch_manifest
from modelpack.targets.opener import TargetOptions, open_readable
from modelpack.testdata.synthetic import SyntheticSpec, write_checkpoint
from tests.fixtures.faultproxy import Fault, FaultProxy, manifest_get
from tests.fixtures.registry import RegistryServer
from tests.mount.test_cache_serve import (
    Served,
    _cli,
    _env,
    _request,
    serve,  # noqa: F401 (the fixture)
)
from tests.mount.test_cache_serve_fill import _blob_gets, _push

pytestmark = pytest.mark.timeout(180)

PLAIN = TargetOptions(plain_http=True)


def _blobs(manifest: Manifest) -> list[Descriptor]:
    return [manifest.config, *manifest.layers]


def variant_index(registry: RegistryServer, tmp_path: Path, repo: str) -> tuple[str, dict[str, Manifest]]:
    """A bf16 and an f32 variant in ``repo`` and an index of them: (index digest, entries)."""
    spec = {"hidden": 64, "intermediate": 128, "vocab": 128, "layers": 1}
    entries: dict[str, Manifest] = {}
    for dtype in ("BF16", "F32"):
        d = tmp_path / dtype.lower()
        write_checkpoint(str(d), SyntheticSpec(dtype=dtype, **spec))  # type: ignore[arg-type]
        digest = str(api.push(str(d), registry.ref(repo, dtype.lower()), target_options=PLAIN).digest)
        entries[digest] = fetch_manifest(open_readable(registry.ref(repo, None)), digest)[0]
    made = create_index(
        registry.ref(repo, "v1"),
        [registry.ref(repo, "bf16"), registry.ref(repo, "f32")],
        overrides={1: {"accelerator": "cpu"}},
        target_options=PLAIN,
    )
    return str(made.digest), entries


@pytest.fixture
def in_process(tmp_path: Path) -> Iterator[Any]:
    """Start ``CacheServer`` over an empty cache in this process (its filler's counters readable)."""
    started: list[tuple[CacheServer, threading.Thread]] = []

    def start(*pinned: str, **fill: Any) -> CacheServer:
        cache = tmp_path / f"owner-{len(started)}"
        Store(str(cache))  # an empty cache, or the one already there
        server = CacheServer(
            str(cache), ServeSettings(port=0), FillSettings(references=pinned, plain_http=True, **fill)
        )
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        started.append((server, thread))
        return server

    yield start
    for server, thread in started:
        server.shutdown()
        thread.join(10)


def _get(server: CacheServer, path: str, timeout: float = 30) -> tuple[int, bytes]:
    port = int(server.url.rsplit(":", 1)[1])
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def test_a_pinned_variant_index_fills_every_entrys_manifest_and_blobs_once(
    registry: RegistryServer,
    tmp_path: Path,
    serve: Any,  # noqa: F811 (the fixture imported above)
) -> None:
    """``--fill REF@<index>``: the node fills each entry's manifest and every blob of every entry
    (peers of any platform pull through it); each blob crosses the origin's link once, and a
    node pulling the index through the owner gets its entry's blobs from the owner."""
    index, entries = variant_index(registry, tmp_path, "fill/variants")
    pinned = f"{registry.host}/fill/variants@{index}"
    owner_cache = tmp_path / "owner"
    Store(str(owner_cache))
    owner = serve(owner_cache, "--fill", pinned)
    mark = registry.log_mark()

    pull = subprocess.run(
        _cli("pull", "--cache", str(tmp_path / "node-b"), "--retry-for", "5s", "--mirror", owner.url, pinned),
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert pull.returncode == 0, pull.stderr
    for digest, manifest in entries.items():  # every entry's manifest, then every blob
        status, _h, body = _request(owner, "GET", f"/v2/any/name/manifests/{digest}")
        assert status == 200 and body, (digest, status)
        for d in _blobs(manifest):
            status, _h, body = _request(owner, "GET", f"/v2/any/name/blobs/{d.digest}")
            assert status == 200 and len(body) == d.size, (d.digest, status)
    wanted = {str(d.digest) for m in entries.values() for d in _blobs(m)}
    gets = _blob_gets(registry, mark)
    assert set(gets) == wanted, gets
    assert all(n == 1 for n in gets.values()), gets


def test_a_pinned_manifest_stalled_at_the_origin_does_not_hold_up_another_models_fill(
    registry: RegistryServer, checkpoint: Path, tmp_path: Path, in_process: Any
) -> None:
    """One pinned manifest whose origin GET stalls: requesters of another pinned model are
    filled at once (its manifest is fetched beside the stalled one, not behind it)."""
    stalled_digest, _ = _push(registry, checkpoint, "fill/stalled")
    other_dir = tmp_path / "other"
    write_checkpoint(str(other_dir), SyntheticSpec(shards=1, seed=11))
    other_digest, other = _push(registry, other_dir, "fill/other")
    proxy = FaultProxy(registry.host)
    proxy.add(Fault(match=manifest_get(stalled_digest), stall=20.0, times=None))
    try:
        owner = in_process(
            f"{proxy.host}/fill/stalled@{stalled_digest}", f"{proxy.host}/fill/other@{other_digest}"
        )
        layer = max(other.layers, key=lambda d: d.size)
        t0 = time.monotonic()
        status, body = _get(owner, f"/v2/any/name/blobs/{layer.digest}")
        took = time.monotonic() - t0
        assert status == 200 and len(body) == layer.size, status
        assert took < 5.0, took  # before: behind the stalled fetch (20 s and more)
    finally:
        proxy.close()


def test_sigterm_mid_fill_stops_the_fill_and_leaves_no_temp_file(
    registry: RegistryServer,
    checkpoint: Path,
    tmp_path: Path,
    serve: Any,  # noqa: F811
) -> None:
    """SIGTERM while a fill streams from a slow origin: ``cache serve`` exits 143 within seconds
    and its ``ingest/`` holds nothing (no orphan temp file); a restarted server fills again."""
    digest, manifest = _push(registry, checkpoint, "fill/term")
    proxy = FaultProxy(registry.host, rate=256 * 1024)  # the ~2 MB layer takes ~8 s
    try:
        cache = tmp_path / "owner"
        Store(str(cache))
        owner = serve(cache, "--fill", f"{proxy.host}/fill/term@{digest}", "--fill-plain-http")
        layer = max(manifest.layers, key=lambda d: d.size)
        conn = http.client.HTTPConnection("127.0.0.1", owner.port, timeout=30)
        conn.request("GET", f"/v2/any/name/blobs/{layer.digest}")
        resp = conn.getresponse()
        assert resp.status == 200
        resp.read(64 * 1024)  # the fill is streaming
        assert [p.name for p in (cache / "ingest").iterdir() if "fill-" in p.name]
        owner.proc.send_signal(signal.SIGTERM)
        assert owner.proc.wait(timeout=15) == 128 + signal.SIGTERM
        conn.close()
        assert [p.name for p in (cache / "ingest").iterdir()] == []
    finally:
        proxy.close()
    again = serve(cache, "--fill", f"{registry.host}/fill/term@{digest}")
    status, _h, body = _request(again, "GET", f"/v2/any/name/blobs/{layer.digest}")
    assert status == 200 and len(body) == layer.size


def test_fill_quota_refuses_a_fill_beyond_it_without_asking_the_origin(
    registry: RegistryServer,
    checkpoint: Path,
    tmp_path: Path,
    serve: Any,  # noqa: F811
) -> None:
    """``--fill-quota`` bounds the bytes fills take from the origin: a blob that would pass it is
    answered 503 (ask elsewhere) and never fetched; a blob within it is filled."""
    digest, manifest = _push(registry, checkpoint, "fill/quota")
    small = min(_blobs(manifest), key=lambda d: d.size)
    big = max(manifest.layers, key=lambda d: d.size)
    cache = tmp_path / "owner"
    Store(str(cache))
    owner: Served = serve(cache, "--fill", f"{registry.host}/fill/quota@{digest}", "--fill-quota", "64KiB")
    mark = registry.log_mark()
    assert _request(owner, "GET", f"/v2/any/name/blobs/{small.digest}")[0] == 200
    assert _request(owner, "GET", f"/v2/any/name/blobs/{big.digest}")[0] == 503
    assert _blob_gets(registry, mark) == {str(small.digest): 1}


def test_fill_concurrency_bounds_the_fills_running_at_once(
    registry: RegistryServer,
    checkpoint: Path,
    tmp_path: Path,
    serve: Any,  # noqa: F811
) -> None:
    """``--fill-concurrency 1``: misses for three blobs at once are filled one after the other
    (never two origin blob GETs in flight), and every requester still gets its blob."""
    digest, manifest = _push(registry, checkpoint, "fill/slots")
    proxy = FaultProxy(registry.host, rate=4 * 1024 * 1024)  # each ~2 MB layer: about half a second
    try:
        cache = tmp_path / "owner"
        Store(str(cache))
        owner = serve(
            cache,
            "--fill",
            f"{proxy.host}/fill/slots@{digest}",
            "--fill-plain-http",
            "--fill-concurrency",
            "1",
        )
        assert _request(owner, "GET", f"/v2/any/name/manifests/{digest}")[0] == 200  # manifests loaded
        peak = 0
        done = threading.Event()

        def sample() -> None:
            nonlocal peak
            while not done.is_set():
                peak = max(peak, proxy.active)
                time.sleep(0.005)

        sampler = threading.Thread(target=sample)
        sampler.start()
        blobs = _blobs(manifest)
        try:
            with concurrent.futures.ThreadPoolExecutor(len(blobs)) as pool:
                answers = list(
                    pool.map(lambda d: _request(owner, "GET", f"/v2/any/name/blobs/{d.digest}"), blobs)
                )
        finally:
            done.set()
            sampler.join()
        assert [s for s, _h, _b in answers] == [200] * len(blobs)
        assert peak == 1, peak
        assert sum(proxy.blob_gets.values()) == len(blobs)
    finally:
        proxy.close()


@pytest.mark.parametrize("leave", [4096, 256 * 1024], ids=["recording-the-pin", "filling-the-layer"])
def test_a_full_disk_during_a_fill_is_logged_naming_the_path_and_leaves_no_temp_file(
    registry: RegistryServer,
    checkpoint: Path,
    tmp_path: Path,
    serve: Any,  # noqa: F811
    leave: int,
) -> None:
    """The serving node's disk fills up (room for the pinned manifest's blob but not for its
    index.json record; or room for the manifests but not for a ~2 MB layer): the fill fails (the
    requester asks its next source), every disk-full line the node logs names the file it could
    not write, and no temp file is left."""
    from tests.mount.test_cache_enospc import _fill
    from tests.pull_dir_helpers import small_tmpfs, temp_entries

    digest, manifest = _push(registry, checkpoint, "fill/enospc")
    layer = max(manifest.layers, key=lambda d: d.size)
    with small_tmpfs(tmp_path / "fs", "4m") as fs:
        if fs is None:
            pytest.skip("mounting a tmpfs is not allowed here")
        cache = fs / "cache"
        Store(str(cache))
        _fill(fs, leave=leave)
        owner = serve(cache, "--fill", f"{registry.host}/fill/enospc@{digest}")
        status = _request(owner, "GET", f"/v2/any/name/blobs/{layer.digest}")[0]
        assert status in (404, 503), status
        owner.proc.send_signal(signal.SIGTERM)
        _out, err = owner.proc.communicate(timeout=15)
        lines = [line for line in err.splitlines() if str(layer.digest) in line and "fill" in line]
        assert lines, err
        full = [line for line in err.splitlines() if "space" in line.lower()]
        assert full and all(f"{cache}/" in line and "no space left" in line for line in full), full
        assert temp_entries(cache) == []


def test_a_restarted_server_removes_the_temp_files_of_fills_a_killed_one_left(
    registry: RegistryServer, checkpoint: Path, tmp_path: Path, in_process: Any
) -> None:
    """A ``kill -9`` mid-fill leaves its temp file (no cleanup runs); the next server over the
    cache removes it at start, and keeps a fill temp file whose writer still holds its lock
    (another live server's)."""
    import fcntl
    import os

    from modelpack.files import TEMP_PREFIX

    digest, _manifest = _push(registry, checkpoint, "fill/restart")
    ingest = tmp_path / "owner-0" / "ingest"
    Store(str(tmp_path / "owner-0"))
    dead = ingest / f"{TEMP_PREFIX}fill-0123456789abcdef-4242-deadbeef"
    live = ingest / f"{TEMP_PREFIX}fill-fedcba9876543210-4343-0badf00d"
    dead.write_bytes(b"x" * 1024)
    live.write_bytes(b"y" * 1024)
    fd = os.open(live, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        in_process(f"{registry.host}/fill/restart@{digest}")
        assert not dead.exists()
        assert live.exists()
    finally:
        os.close(fd)
