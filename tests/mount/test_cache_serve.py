"""``modelpack cache serve`` — a node cache as a read-only OCI mirror.

Real parts: a real origin registry (killed for the outage), real ``modelpack pull --cache`` and
``modelpack cache serve`` subprocesses, raw HTTP requests from the test playing a hostile peer.
Before this change there was no ``cache serve``: a pinned start with the origin down failed
although the node next door held the model.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import select
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from modelpack.api import transfer
from modelpack.oci.descriptor import Manifest
from modelpack.targets.fetch import fetch_manifest
from modelpack.targets.opener import open_readable
from tests.e2e.test_interop_containerd import Containerd, containerd  # noqa: F401 (the fixture)
from tests.fixtures.registry import RegistryServer, make_ca

pytestmark = pytest.mark.timeout(240)


def _cli(*argv: str) -> list[str]:
    return [sys.executable, "-m", "modelpack.cli", *argv]


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    return dict(os.environ, MODELPACK_HOSTS_DIR=str(tmp_path / "no-hosts"), **extra)


class Served:
    def __init__(self, proc: subprocess.Popen[str], url: str) -> None:
        self.proc = proc
        self.url = url
        self.host = url.split("://", 1)[1]
        self.port = int(self.host.rsplit(":", 1)[1])


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Any]:
    started: list[subprocess.Popen[str]] = []

    def start(cache: Path, *args: str, env: dict[str, str] | None = None) -> Served:
        proc = subprocess.Popen(
            _cli("cache", "serve", "--cache", str(cache), "--listen", "127.0.0.1:0", *args),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env or _env(tmp_path),
        )
        started.append(proc)
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 30)
        assert ready, "cache serve printed no URL within 30 s"
        url = proc.stdout.readline().strip()
        assert url.startswith("http"), (url, proc.poll())
        return Served(proc, url)

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def _pull_cache(tmp_path: Path, cache: Path, ref: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        _cli("pull", "--cache", str(cache), "--retry-for", "2s", *args, ref),
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )


def _node_a(
    origin: RegistryServer, checkpoint: Path, tmp_path: Path, repo: str
) -> tuple[str, Manifest, Path]:
    """Push to the origin and pull it into node A's cache; (digest, manifest, cache A)."""
    res = transfer.push(str(checkpoint), origin.ref(repo, "v1"), progress="off")
    manifest, _ = fetch_manifest(open_readable(origin.ref(repo, None)), res.digest)
    cache_a = tmp_path / "node-a"
    done = _pull_cache(tmp_path, cache_a, f"{origin.host}/{repo}@{res.digest}")
    assert done.returncode == 0, done.stderr
    return str(res.digest), manifest, cache_a


def _same(snapshot_line: str, checkpoint: Path) -> None:
    snapshot = Path(snapshot_line.strip().splitlines()[-1])
    names = [f.name for f in checkpoint.glob("*.safetensors")]
    assert names
    for name in names:
        assert (snapshot / name).read_bytes() == (checkpoint / name).read_bytes(), name


def test_node_b_pulls_a_pinned_model_from_node_a_with_the_origin_down(
    registry_factory: Any, checkpoint: Path, tmp_path: Path, serve: Any
) -> None:
    origin = registry_factory.start()
    digest, _manifest, cache_a = _node_a(origin, checkpoint, tmp_path, "peers/model")
    peer = serve(cache_a)
    origin.kill()
    pinned = f"{origin.host}/peers/model@{digest}"

    by_flag = _pull_cache(tmp_path, tmp_path / "node-b", pinned, "--mirror", peer.url)
    assert by_flag.returncode == 0, by_flag.stderr
    _same(by_flag.stdout, checkpoint)

    # the same peer through containerd's hosts.toml, pull capability only
    hosts = tmp_path / "certs.d" / origin.host
    hosts.mkdir(parents=True)
    (hosts / "hosts.toml").write_text(
        f'server = "http://{origin.host}"\n\n[host."{peer.url}"]\n  capabilities = ["pull"]\n'
    )
    by_hosts = _pull_cache(tmp_path, tmp_path / "node-c", pinned, "--hosts-dir", str(tmp_path / "certs.d"))
    assert by_hosts.returncode == 0, by_hosts.stderr
    _same(by_hosts.stdout, checkpoint)

    # a tag cannot be resolved by a peer: with the origin down, a tag pull fails naming the origin
    tagged = _pull_cache(tmp_path, tmp_path / "node-d", f"{origin.host}/peers/model:v1", "--mirror", peer.url)
    assert tagged.returncode != 0 and origin.host in tagged.stderr and "Traceback" not in tagged.stderr


def _request(
    peer: Served, method: str, path: str, headers: dict[str, str] | None = None, body: bytes | None = None
) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", peer.port, timeout=10)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def _files(root: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mode) for p in root.rglob("*") if p.is_file()
    }


def test_a_hostile_peer_reaches_only_committed_blobs_by_digest_and_writes_nothing(
    registry: RegistryServer, checkpoint: Path, tmp_path: Path, serve: Any
) -> None:
    digest, manifest, cache_a = _node_a(registry, checkpoint, tmp_path, "peers/hostile")
    blobs = cache_a / "blobs" / "sha256"
    # a file planted in the store that the cache did not commit (writable), and a link out of it
    planted_hex = hashlib.sha256(b"planted").hexdigest()
    (blobs / planted_hex).write_bytes(b"planted")
    os.chmod(blobs / planted_hex, 0o644)
    linked_hex = hashlib.sha256(b"link").hexdigest()
    os.symlink("/etc/passwd", blobs / linked_hex)
    before = _files(cache_a)
    peer = serve(cache_a)
    layer = max(manifest.layers, key=lambda d: d.size)
    data = (blobs / layer.digest.hex).read_bytes()
    blob_path = f"/v2/peers/hostile/blobs/{layer.digest}"

    assert _request(peer, "GET", "/v2/")[0] == 200
    status, headers, body = _request(peer, "GET", blob_path)
    assert status == 200 and body == data and headers["docker-content-digest"] == str(layer.digest)
    status, headers, body = _request(peer, "HEAD", blob_path)
    assert status == 200 and body == b"" and int(headers["content-length"]) == len(data)
    status, headers, body = _request(peer, "GET", blob_path, {"Range": "bytes=10-19"})
    assert status == 206 and body == data[10:20] and headers["content-range"] == f"bytes 10-19/{len(data)}"
    assert _request(peer, "GET", blob_path, {"Range": "bytes=-5"})[2] == data[-5:]
    assert _request(peer, "GET", blob_path, {"Range": f"bytes={len(data)}-"})[0] == 416
    status, headers, body = _request(peer, "GET", f"/v2/peers/hostile/manifests/{digest}")
    assert status == 200 and hashlib.sha256(body).hexdigest() == digest.split(":")[1]
    assert headers["content-type"] == "application/vnd.oci.image.manifest.v1+json"

    # never a tag, a listing, a write, or anything but a committed blob
    for path in (
        "/v2/peers/hostile/manifests/v1",
        "/v2/peers/hostile/tags/list",
        "/v2/_catalog",
        f"/v2/peers/hostile/blobs/sha256:{planted_hex}",
        f"/v2/peers/hostile/blobs/sha256:{linked_hex}",
        "/v2/peers/hostile/blobs/sha256:../../oci-layout",
        "/v2/peers/hostile/blobs/..%2F..%2Findex.json",
        f"/v2/peers/hostile/blobs/sha256:{layer.digest.hex.upper()}",
        "/v2/../../etc/passwd",
        "/oci-layout",
        "/index.json",
    ):
        status, _h, body = _request(peer, "GET", path)
        assert status == 404, (path, status, body[:200])
        assert b"planted" not in body and b"root:" not in body
    for method in ("PUT", "POST", "PATCH", "DELETE"):
        status, headers, _b = _request(peer, method, blob_path, body=b"x" * 10)
        assert status == 405 and headers["allow"] == "GET, HEAD", (method, status)
        assert _request(peer, method, "/v2/peers/hostile/blobs/uploads/")[0] == 405
    assert _request(peer, "GET", blob_path, {"Content-Length": "3"}, body=b"abc")[0] == 400
    assert _request(peer, "GET", "/v2/" + "a/" * 2000 + "blobs/x")[0] == 414
    assert _files(cache_a) == before  # nothing written, nothing changed


def test_tls_and_a_bearer_token_and_bounded_connections(
    registry: RegistryServer, checkpoint: Path, tmp_path: Path, serve: Any
) -> None:
    digest, _manifest, cache_a = _node_a(registry, checkpoint, tmp_path, "peers/tls")
    ca = make_ca(tmp_path / "ca")
    token = tmp_path / "token"
    token.write_text("s3cret-peer-token\n")
    peer = serve(
        cache_a,
        "--tls-cert",
        str(ca.server_cert),
        "--tls-key",
        str(ca.server_key),
        "--token-file",
        str(token),
        "--max-connections",
        "2",
    )
    assert peer.url.startswith("https://")
    ctx = ssl.create_default_context(cafile=str(ca.ca_cert))

    def get(headers: dict[str, str]) -> int:
        conn = http.client.HTTPSConnection("127.0.0.1", peer.port, context=ctx, timeout=10)
        try:
            conn.request("GET", f"/v2/peers/tls/manifests/{digest}", headers=headers)
            resp = conn.getresponse()
            resp.read()
            return resp.status
        finally:
            conn.close()

    assert get({}) == 401
    assert get({"Authorization": "Bearer wrong"}) == 401
    assert get({"Authorization": "Bearer s3cret-peer-token"}) == 200

    # modelpack pulls through it with the hosts.toml's CA and header (the origin still up here)
    hosts = tmp_path / "certs.d" / registry.host
    hosts.mkdir(parents=True)
    (hosts / "hosts.toml").write_text(
        f'[host."{peer.url}"]\n  capabilities = ["pull"]\n  ca = "{ca.ca_cert}"\n'
        f'  [host."{peer.url}".header]\n    Authorization = ["Bearer s3cret-peer-token"]\n'
    )
    done = _pull_cache(
        tmp_path,
        tmp_path / "node-b",
        f"{registry.host}/peers/tls@{digest}",
        "--hosts-dir",
        str(tmp_path / "certs.d"),
    )
    assert done.returncode == 0, done.stderr
    _same(done.stdout, checkpoint)

    # two idle connections hold both slots: the third is refused at once, not queued forever
    idle = [socket.create_connection(("127.0.0.1", peer.port), timeout=10) for _ in range(2)]
    try:
        time.sleep(0.5)
        third = socket.create_connection(("127.0.0.1", peer.port), timeout=10)
        try:
            got = third.recv(200)  # plain 503 bytes before the server closes (no TLS spoken)
        except OSError:
            got = b""
        third.close()
        assert got == b"" or got.startswith(b"HTTP/1.1 503"), got
        with pytest.raises((ssl.SSLError, OSError, http.client.HTTPException)):
            get({"Authorization": "Bearer s3cret-peer-token"})
    finally:
        for s in idle:
            s.close()
    deadline = time.monotonic() + 20
    status = 0
    while time.monotonic() < deadline and status != 200:
        try:
            status = get({"Authorization": "Bearer s3cret-peer-token"})
        except (ssl.SSLError, OSError, http.client.HTTPException):
            time.sleep(0.2)
    assert status == 200  # the slots came back once the idle peers went away


@pytest.mark.parametrize("origin_up", [True, False])
def test_containerd_pulls_the_image_variant_from_a_peer_through_hosts_toml(
    containerd: Containerd,  # noqa: F811 (the fixture imported above)
    registry_factory: Any,
    checkpoint: Path,
    tmp_path: Path,
    serve: Any,
    origin_up: bool,
) -> None:
    """containerd (its own daemon, ``ctr images pull --hosts-dir``) as the peer's client. With the
    origin up, ``capabilities = ["pull"]``: the origin resolves, every blob comes from the peer.
    With the origin down, a pinned pull needs ``resolve`` too (containerd fetches even a manifest
    by digest only from resolve hosts); the peer answers by digest only, never a tag."""
    daemon = containerd
    origin = registry_factory.start()
    pushed = transfer.push(str(checkpoint), origin.ref("peers/image", "v1"), format="image", progress="off")
    cache_a = tmp_path / "node-a"
    done = _pull_cache(tmp_path, cache_a, f"{origin.host}/peers/image@{pushed.digest}")
    assert done.returncode == 0, done.stderr
    peer = serve(cache_a)
    caps = '["pull"]' if origin_up else '["pull", "resolve"]'
    hosts = tmp_path / "certs.d" / origin.host
    hosts.mkdir(parents=True)
    (hosts / "hosts.toml").write_text(
        f'server = "http://{origin.host}"\n\n[host."{peer.url}"]\n  capabilities = {caps}\n'
    )
    mark = origin.log_mark()
    if not origin_up:
        origin.kill()
    out = daemon.ctr(
        "images",
        "pull",
        "--plain-http",
        "--hosts-dir",
        str(tmp_path / "certs.d"),
        "--snapshotter",
        "native",
        "--platform",
        "linux/amd64",
        f"{origin.host}/peers/image@{pushed.digest}",
        timeout=300,
    )
    assert "done" in out or "unpacking" in out
    assert str(pushed.digest) in daemon.ctr("images", "ls")
    if origin_up:
        assert not [p for m, p, _ in origin.requests_since(mark) if "/blobs/" in p]


def test_peers_from_a_dns_name_in_each_nodes_rendezvous_order(
    registry_factory: Any, checkpoint: Path, tmp_path: Path, serve: Any
) -> None:
    """``--mirror dns+http://NAME:PORT`` is every address NAME resolves to (a
    headless Service), ordered per node by rendezvous hashing. Before, ``dns+http`` was refused."""
    from modelpack.targets.registry.peers import expand_peer_urls, rendezvous

    peers = [f"10.0.0.{i}" for i in range(1, 5)]
    firsts = [rendezvous(peers, f"node-{n}")[0] for n in range(400)]
    assert all(40 <= firsts.count(p) <= 160 for p in peers), [firsts.count(p) for p in peers]  # spread
    for n in range(50):  # a peer leaving does not reorder the others for any node
        order = rendezvous(peers, f"node-{n}")
        assert rendezvous(peers[1:], f"node-{n}") == [p for p in order if p != peers[0]]
    assert rendezvous(peers, "node-1") == rendezvous(list(reversed(peers)), "node-1")  # deterministic
    assert expand_peer_urls(["dns+http://localhost:5050"], node="n")[0] in (
        "http://127.0.0.1:5050",
        "http://[::1]:5050",
    )

    origin = registry_factory.start()
    digest, _manifest, cache_a = _node_a(origin, checkpoint, tmp_path, "peers/dns")
    peer = serve(cache_a)
    origin.kill()
    done = _pull_cache(
        tmp_path,
        tmp_path / "node-b",
        f"{origin.host}/peers/dns@{digest}",
        "--mirror",
        f"dns+http://localhost:{peer.port}",
    )
    assert done.returncode == 0, done.stderr
    _same(done.stdout, checkpoint)


def test_a_requester_that_hangs_up_mid_blob_costs_no_traceback_and_no_slot(
    registry: RegistryServer, tmp_path: Path, serve: Any
) -> None:
    """Peers disconnect mid-blob all the time (a node abandons a slow peer, a pod is killed): the
    server logs nothing alarming and keeps serving. Before, socketserver printed a traceback to
    stderr per reset connection (``BrokenPipeError`` / ``ConnectionResetError``)."""
    from modelpack.testdata.synthetic import SyntheticSpec, write_checkpoint

    big = tmp_path / "big"
    write_checkpoint(str(big), SyntheticSpec(hidden=512, intermediate=1376, layers=2, vocab=8192))
    _digest, manifest, cache_a = _node_a(registry, big, tmp_path, "peers/hangup")
    largest = max(manifest.layers, key=lambda d: d.size)
    assert largest.size > 16 * 1024 * 1024
    peer = serve(cache_a, "--max-connections", "2")
    for _ in range(4):  # more hang-ups than slots: a leaked slot would refuse the last GET
        sock = socket.create_connection(("127.0.0.1", peer.port), timeout=10)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.sendall(f"GET /v2/peers/hangup/blobs/{largest.digest} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        time.sleep(0.2)  # the server is now blocked writing into a full socket
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        sock.close()  # RST
    time.sleep(0.5)
    status, _, body = _request(peer, "GET", f"/v2/peers/hangup/blobs/{largest.digest}")
    assert status == 200 and hashlib.sha256(body).hexdigest() == largest.digest.hex
    peer.proc.terminate()
    _, err = peer.proc.communicate(timeout=10)
    assert "Traceback" not in err and "Error" not in err, err
    assert peer.proc.returncode == 143 and "cache serve: stopped (interrupted by SIGTERM)" in err, err
