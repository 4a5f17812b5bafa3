"""A fill streams to its waiting requesters as the origin's bytes land.

Before, a fill was store-and-forward: a requester of a blob the owner was filling got nothing
until the owner held (and had verified) the whole blob, so its client's throughput window passed
empty, it abandoned the owner, and the next-ranked peer filled the blob from the origin again.

Real parts: a real origin registry behind the fault proxy (throttled: a slow origin link; or
rewriting the blob: a lying origin), a real ``cache serve`` endpoint (``CacheServer``, in this
process so the test can shorten ``wait_s``) on loopback, raw HTTP requests from the test. What
is checked: the first byte reaches a requester before the fill has committed the blob; a fill
whose bytes fail the digest cuts every response short (the client never receives the last byte)
and commits nothing; concurrent requesters (GET, Range GET, HEAD) of one fill cost one origin GET.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from modelpack.mount.serve import CacheServer, ServeSettings
from modelpack.mount.serve_fill import FillSettings
from modelpack.mount.store import Store

from modelpack.api import transfer
from modelpack.oci.descriptor import Descriptor
from modelpack.targets.fetch import fetch_manifest
from modelpack.targets.opener import open_readable
from tests.fixtures.faultproxy import Fault, FaultProxy, blob_get
from tests.fixtures.registry import RegistryServer

pytestmark = pytest.mark.timeout(120)

#: the origin link's rate: the ~2 MB layer takes about 4 s to fill
RATE = 512 * 1024


class Owner:
    def __init__(self, server: CacheServer, cache: Path) -> None:
        self.server = server
        self.cache = cache
        self.port = int(server.url.rsplit(":", 1)[1])

    def committed(self, desc: Descriptor) -> bool:
        return (self.cache / "blobs" / "sha256" / desc.digest.hex).exists()

    def connect(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)


@pytest.fixture
def slow_origin(registry: RegistryServer) -> Iterator[FaultProxy]:
    proxy = FaultProxy(registry.host, rate=RATE)
    yield proxy
    proxy.close()


@pytest.fixture
def owner_for(tmp_path: Path) -> Iterator[Any]:
    started: list[tuple[CacheServer, threading.Thread]] = []

    def start(pinned: str) -> Owner:
        cache = tmp_path / "owner"
        Store(str(cache))  # an empty node cache: a storm at t=0
        # wait_s below the fill's ~4 s: before this change every requester got 503 (ask elsewhere)
        fill = FillSettings(references=(pinned,), plain_http=True, wait_s=2.0)
        server = CacheServer(str(cache), ServeSettings(port=0), fill)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        started.append((server, thread))
        return Owner(server, cache)

    yield start
    for server, thread in started:
        server.shutdown()
        thread.join(10)


def _pinned(
    registry: RegistryServer, proxy: FaultProxy, checkpoint: Path, repo: str
) -> tuple[str, Descriptor, bytes]:
    res = transfer.push(str(checkpoint), registry.ref(repo, "v1"), progress="off")
    manifest, _ = fetch_manifest(open_readable(registry.ref(repo, None)), res.digest)
    layer = max(manifest.layers, key=lambda d: d.size)
    want = (checkpoint / layer.annotations["org.opencontainers.image.title"]).read_bytes()  # type: ignore[index]
    return f"{proxy.host}/{repo}@{res.digest}", layer, want


def test_a_requester_gets_its_first_bytes_before_the_fill_completes(
    registry: RegistryServer, slow_origin: FaultProxy, checkpoint: Path, owner_for: Any
) -> None:
    pinned, layer, want = _pinned(registry, slow_origin, checkpoint, "stream/first")
    owner = owner_for(pinned)
    conn = owner.connect()
    t0 = time.monotonic()
    conn.request("GET", f"/v2/any/name/blobs/{layer.digest}")
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()[:200]
    assert int(resp.getheader("Content-Length") or -1) == layer.size  # the pinned size, up front
    first = resp.read(1)
    t_first = time.monotonic() - t0
    committed_at_first_byte = owner.committed(layer)
    rest = resp.read()
    t_done = time.monotonic() - t0
    conn.close()
    assert first + rest == want
    # the first byte left the owner while its fill was still running (store-and-forward: after)
    assert not committed_at_first_byte, (t_first, t_done)
    assert t_first < t_done / 2, (t_first, t_done)
    assert owner.committed(layer)
    assert slow_origin.blob_gets[str(layer.digest)] == 1
    assert owner.server.filler is not None and owner.server.filler.stats.filled == 1


def test_an_origin_sending_wrong_bytes_cuts_the_streamed_response_short_and_commits_nothing(
    registry: RegistryServer, slow_origin: FaultProxy, checkpoint: Path, owner_for: Any
) -> None:
    pinned, layer, want = _pinned(registry, slow_origin, checkpoint, "stream/lying")

    def forge(body: bytes, _range: str | None) -> bytes:  # same length, other bytes at the end
        return body[:-4096] + b"\0" * 4096

    slow_origin.add(Fault(match=blob_get(str(layer.digest)), rewrite=forge, times=None))
    owner = owner_for(pinned)

    def fetch(headers: dict[str, str]) -> tuple[int, int, bytes]:
        conn = owner.connect()
        try:
            conn.request("GET", f"/v2/any/name/blobs/{layer.digest}", headers=headers)
            resp = conn.getresponse()
            length = int(resp.getheader("Content-Length") or -1)
            try:
                body = resp.read()
            except http.client.IncompleteRead as exc:
                body = exc.partial
            return resp.status, length, body
        finally:
            conn.close()

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        whole = pool.submit(fetch, {})
        ranged = pool.submit(fetch, {"Range": "bytes=1000-"})
        (status, length, body), (r_status, r_length, r_body) = whole.result(), ranged.result()
    assert status == 200 and length == layer.size
    # cut before its last byte: the client sees fewer bytes than announced and abandons this source
    assert len(body) < length, len(body)
    assert body == forge(want, None)[: len(body)]  # what it did get are the origin's (unverified) bytes
    assert r_status == 206 and r_length == layer.size - 1000 and len(r_body) < r_length
    assert not owner.committed(layer)
    assert list((owner.cache / "ingest").iterdir()) == []  # no temp file left behind
    assert owner.server.filler is not None and owner.server.filler.stats.failed == 1
    assert slow_origin.blob_gets[str(layer.digest)] == 1


def test_concurrent_requesters_of_one_fill_cost_one_origin_get(
    registry: RegistryServer, slow_origin: FaultProxy, checkpoint: Path, owner_for: Any
) -> None:
    pinned, layer, want = _pinned(registry, slow_origin, checkpoint, "stream/many")
    owner = owner_for(pinned)
    path = f"/v2/any/name/blobs/{layer.digest}"

    def ask(job: tuple[str, dict[str, str]]) -> tuple[int, dict[str, str], bytes]:
        method, headers = job
        conn = owner.connect()
        try:
            conn.request(method, path, headers=headers)
            resp = conn.getresponse()
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
        finally:
            conn.close()

    jobs = [("GET", {})] * 5 + [("GET", {"Range": "bytes=1000-"}), ("HEAD", {})]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(ask, jobs))
    for status, _headers, body in answers[:5]:
        assert status == 200 and body == want
    r_status, r_headers, r_body = answers[5]
    assert r_status == 206 and r_body == want[1000:]
    assert r_headers["content-range"] == f"bytes 1000-{layer.size - 1}/{layer.size}"
    h_status, h_headers, _ = answers[6]
    assert h_status == 200 and int(h_headers["content-length"]) == layer.size
    assert slow_origin.blob_gets[str(layer.digest)] == 1
    assert owner.committed(layer)
