"""Who may read from ``cache serve``, and how long a requester may hold a connection slot.

Real parts: a real origin registry, real ``cache serve`` subprocesses on loopback, raw sockets
playing the hostile requester. What is attacked: a peer listening beyond loopback with no token
(anyone who knows a digest reads a private model, fetched for them with the node's pull secret),
a fill triggered by a requester without the token, and connections that trickle a request head
one byte at a time to hold every slot.
"""

from __future__ import annotations

import http.client
import select
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.registry import RegistryServer
from tests.mount.test_cache_serve import (
    _cli,
    _env,
    _node_a,
    _request,
    serve,  # noqa: F401 (the fixture)
)
from tests.mount.test_cache_serve_fill import _blob_gets, _empty_cache, _push

pytestmark = pytest.mark.timeout(180)

TOKEN = "peer-token-3f1c"


def _serve_once(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``cache serve`` expected to refuse at once (it must never get as far as serving)."""
    return subprocess.run(
        _cli("cache", "serve", "--cache", str(_empty_cache(tmp_path, "refused")), *args),
        env=_env(tmp_path, **env),
        capture_output=True,
        text=True,
        timeout=30,
    )


@pytest.mark.parametrize(
    ("host", "beyond"),
    [
        ("127.0.0.1", False),
        ("127.9.9.9", False),
        ("::1", False),
        ("localhost", False),
        ("0.0.0.0", True),
        ("::", True),
        ("10.0.0.7", True),
        ("::ffff:127.0.0.1", True),  # not taken for loopback: a token is asked (fails closed)
        ("node-a.example", True),
    ],
)
def test_which_listen_addresses_count_as_beyond_loopback(host: str, beyond: bool) -> None:
    """Every address but a loopback one (or the name localhost) is beyond loopback; a name is
    never resolved to decide it."""
    from modelpack.mount.serve import beyond_loopback

    assert beyond_loopback(host) is beyond


def test_cache_serve_refuses_to_listen_beyond_loopback_without_a_token(tmp_path: Path) -> None:
    """Listening on 0.0.0.0 (the generated peer DaemonSet's address) without a token is a usage
    error naming MODELPACK_SERVE_TOKEN; nothing is served. A token present but empty is no token."""
    for env in ({}, {"MODELPACK_SERVE_TOKEN": ""}, {"MODELPACK_SERVE_TOKEN": "  "}):
        res = _serve_once(tmp_path, "--listen", "0.0.0.0:0", **env)
        assert res.returncode == 2, (env, res.stdout, res.stderr)
        assert "MODELPACK_SERVE_TOKEN" in res.stderr and "Traceback" not in res.stderr, res.stderr
        assert res.stdout == ""  # no URL: never listened
    # an empty token file is refused as well (a usage error, not "no token")
    empty = tmp_path / "empty-token"
    empty.write_text("\n")
    res = _serve_once(tmp_path, "--listen", "0.0.0.0:0", "--token-file", str(empty))
    assert res.returncode == 2 and "empty" in res.stderr, res.stderr


def test_the_opt_out_is_loud(tmp_path: Path) -> None:
    """``--insecure-no-auth`` lets it listen beyond loopback without a token, with a warning that
    says anyone reaching the port reads every model in the cache. (192.0.2.1 is TEST-NET-1: the
    bind fails after the check, so nothing listens beyond loopback during the test.)"""
    res = _serve_once(tmp_path, "--listen", "192.0.2.1:0", "--insecure-no-auth")
    assert "WARNING" in res.stderr and "anyone" in res.stderr, res.stderr
    assert "cannot listen on 192.0.2.1" in res.stderr and "MODELPACK_SERVE_TOKEN" not in res.stdout


def test_a_requester_without_the_token_gets_401_and_triggers_no_fill(
    registry: RegistryServer,
    checkpoint: Path,
    tmp_path: Path,
    serve: Any,  # noqa: F811
) -> None:
    """With the token required, a requester who knows a pinned digest but not the token is 401
    before any fill starts: the origin is never asked for the blob on its behalf."""
    digest, manifest = _push(registry, checkpoint, "auth/fill")
    cache = _empty_cache(tmp_path, "owner")
    owner = serve(
        cache,
        "--fill",
        f"{registry.host}/auth/fill@{digest}",
        env=_env(tmp_path, MODELPACK_SERVE_TOKEN=TOKEN),
    )
    mark = registry.log_mark()
    layer = max(manifest.layers, key=lambda d: d.size)
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"}):
        for method in ("GET", "HEAD"):
            status, got, _ = _request(owner, method, f"/v2/auth/fill/blobs/{layer.digest}", headers)
            assert status == 401 and "bearer" in got.get("www-authenticate", "").lower(), (headers, status)
        assert _request(owner, "GET", f"/v2/auth/fill/manifests/{digest}", headers)[0] == 401
    time.sleep(0.5)
    assert _blob_gets(registry, mark) == {}
    assert not (cache / "blobs" / "sha256" / layer.digest.hex).exists()
    # the token holder is served (and that one request is what fills it)
    status, _, body = _request(
        owner, "GET", f"/v2/auth/fill/blobs/{layer.digest}", {"Authorization": f"Bearer {TOKEN}"}
    )
    assert status == 200 and len(body) == layer.size
    assert _blob_gets(registry, mark) == {str(layer.digest): 1}


def _trickle(port: int, source: str, stop: threading.Event, closed: list[float], started: float) -> None:
    """A request head sent one byte every 0.5 s from ``source`` (never finished); records when the
    server closed the connection."""
    try:
        sock = socket.create_connection(("127.0.0.1", port), timeout=30, source_address=(source, 0))
    except OSError:
        closed.append(0.0)
        return
    head = b"GET /v2/ HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 4096
    try:
        for byte in head:
            if stop.is_set():
                return
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                closed.append(time.monotonic() - started)
                return
            ready, _, _ = select.select([sock], [], [], 0.5)
            if ready:  # the server answered (a 503) or closed: either way the slot is gone
                closed.append(time.monotonic() - started)
                return
    finally:
        sock.close()


def test_trickled_request_heads_cannot_hold_every_slot(
    registry: RegistryServer,
    checkpoint: Path,
    tmp_path: Path,
    serve: Any,  # noqa: F811
) -> None:
    """64 connections from one address trickling a request head one byte at a time: the address
    holds at most its share of the slots (an authorised request from elsewhere is served at once),
    and each trickling connection is closed when its head deadline passes, whatever it sends."""
    digest, _manifest, cache_a = _node_a(registry, checkpoint, tmp_path, "auth/slow")
    peer = serve(cache_a, "--head-timeout", "3", env=_env(tmp_path, MODELPACK_SERVE_TOKEN=TOKEN))
    stop = threading.Event()
    closed: list[float] = []
    started = time.monotonic()
    threads = [
        threading.Thread(target=_trickle, args=(peer.port, "127.0.0.2", stop, closed, started), daemon=True)
        for _ in range(64)
    ]
    for t in threads:
        t.start()
    try:
        time.sleep(1.0)  # every trickler connected and sending
        t0 = time.monotonic()
        status, _, _ = _request(
            peer, "GET", f"/v2/auth/slow/manifests/{digest}", {"Authorization": f"Bearer {TOKEN}"}
        )
        assert status == 200 and time.monotonic() - t0 < 2.0, status
        for t in threads:
            t.join(timeout=15)
        # every one was cut: refused at once (over the address's share) or at its head deadline
        assert len(closed) == 64 and max(closed) < 3.0 + 3.0, sorted(closed)
    finally:
        stop.set()
    conn = http.client.HTTPConnection("127.0.0.1", peer.port, timeout=10)
    try:
        conn.request("GET", "/v2/", headers={"Authorization": f"Bearer {TOKEN}"})
        assert conn.getresponse().status == 200
    finally:
        conn.close()
