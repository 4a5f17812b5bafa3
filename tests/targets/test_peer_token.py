"""``MODELPACK_PEER_TOKEN``: the bearer token a node presents to its peers, and to no one else.

Real parts: a real registry behind two recording fault proxies (the origin a pull names, and the
host the origin redirects blob GETs to, as a registry on a CDN does), a peer on loopback that
redirects its blob GETs to a third recording host, and ``modelpack pull`` as a subprocess.
What is attacked: the token leaking to the origin registry, to a host the origin redirects to,
or to a host a peer redirects to; and a token that rendered empty silently meaning "no token".
"""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from modelpack.api import transfer
from modelpack.targets.fetch import fetch_manifest
from modelpack.targets.opener import open_readable
from tests.fixtures.faultproxy import Fault, FaultProxy, blob_get
from tests.fixtures.loopback import LoopbackServer
from tests.fixtures.registry import RegistryServer

pytestmark = pytest.mark.timeout(180)

TOKEN = "peer-token-9d2e71"


class _Recorder:
    """Every request's headers, by the host that received it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seen: list[tuple[str, str, dict[str, str]]] = []

    def add(self, host: str, path: str, headers: dict[str, str]) -> None:
        with self.lock:
            self.seen.append((host, path, dict(headers)))

    def at(self, host: str) -> list[tuple[str, dict[str, str]]]:
        with self.lock:
            return [(p, h) for who, p, h in self.seen if who == host]

    def proxy_match(self, name: str) -> Any:
        def match(method: str, path: str, headers: dict[str, str]) -> bool:
            self.add(name, path, headers)
            return False  # never fires: it only records

        return match


def _peer_handler(
    rec: _Recorder, name: str, redirect_to: str | None
) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            rec.add(name, self.path, {k: v for k, v in self.headers.items()})
            if self.path in ("/v2", "/v2/"):
                self._reply(200, b"{}")
            elif "/blobs/" in self.path and redirect_to is not None:
                self.send_response(307)
                self.send_header("Location", f"http://{redirect_to}{self.path}")
                self.send_header("Content-Length", "0")
                self.end_headers()
            else:
                self._reply(404, b'{"errors":[{"code":"BLOB_UNKNOWN","message":"no"}]}')

        do_HEAD = do_GET

        def _reply(self, status: int, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

    return Handler


def _carries_token(headers: dict[str, str]) -> bool:
    return any(TOKEN in v for v in headers.values())


def _pull(tmp_path: Path, ref: str, dest: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    full = dict(os.environ, MODELPACK_HOSTS_DIR=str(tmp_path / "no-hosts"))
    full.pop("MODELPACK_MIRRORS", None)
    full.update(env)
    return subprocess.run(
        [sys.executable, "-m", "modelpack.cli", "pull", "--retry-for", "3s", "--json", *args, ref, dest],
        env=full,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_peer_token_goes_to_peers_only_never_to_the_origin_or_any_redirect_target(
    registry: RegistryServer, checkpoint: Path, tmp_path: Path
) -> None:
    """A pull through a peer presents ``Authorization: Bearer <MODELPACK_PEER_TOKEN>`` to the peer
    (a ``--mirror``, a ``MODELPACK_MIRRORS`` entry, each address of a ``dns+http`` name) and to
    nothing else: not the origin registry, not the host the origin redirects blob GETs to, not
    the host the peer redirects its blob GETs to."""
    digest = str(transfer.push(str(checkpoint), registry.ref("token/model", "v1"), progress="off").digest)
    manifest, _ = fetch_manifest(open_readable(registry.ref("token/model", None)), digest)
    rec = _Recorder()
    cdn = FaultProxy(registry.host)
    cdn.add(Fault(match=rec.proxy_match("cdn"), times=None))
    origin = FaultProxy(registry.host)
    origin.add(Fault(match=rec.proxy_match("origin"), times=None))
    for d in (manifest.config, *manifest.layers):  # every blob GET at the origin: 307 to the CDN
        where = f"http://{cdn.host}/v2/token/model/blobs/{d.digest}"
        origin.add(Fault(match=blob_get(str(d.digest)), times=None, status=307, headers={"Location": where}))
    elsewhere = LoopbackServer(_peer_handler(rec, "elsewhere", None))
    peer = LoopbackServer(_peer_handler(rec, "peer", elsewhere.host))
    try:
        pinned = f"{origin.host}/token/model@{digest}"
        port = peer.host.rsplit(":", 1)[1]
        for i, (args, env) in enumerate(
            [
                (("--mirror", f"http://{peer.host}"), {}),
                ((), {"MODELPACK_MIRRORS": f"http://{peer.host}"}),
                (("--mirror", f"dns+http://localhost:{port}"), {}),
            ]
        ):
            before = len(rec.at("peer"))
            done = _pull(
                tmp_path, pinned, str(tmp_path / f"out{i}"), *args, MODELPACK_PEER_TOKEN=TOKEN, **env
            )
            assert done.returncode == 0, done.stderr
            assert json.loads(done.stdout)["digest"] == digest
            asked = rec.at("peer")[before:]
            assert any("/blobs/" in p for p, _ in asked), asked
            assert all(h.get("Authorization") == f"Bearer {TOKEN}" for _, h in asked), asked
        for host in ("origin", "cdn", "elsewhere"):
            seen = rec.at(host)
            assert seen, f"{host} was never asked: the test proves nothing"
            leaked = [p for p, h in seen if _carries_token(h)]
            assert not leaked, (host, leaked)
        assert TOKEN not in "".join(p for _, p, _ in rec.seen)
    finally:
        peer.close()
        elsewhere.close()
        origin.close()
        cdn.close()


def test_a_peer_token_set_but_empty_is_refused_not_read_as_no_token(tmp_path: Path) -> None:
    """``MODELPACK_PEER_TOKEN=`` (a Secret key that rendered empty) stops the pull with a usage
    error naming the variable, before any peer is asked."""
    rec = _Recorder()
    peer = LoopbackServer(_peer_handler(rec, "peer", None))
    try:
        for value in ("", "   "):
            done = _pull(
                tmp_path,
                f"127.0.0.1:9/none/model@sha256:{'a' * 64}",
                str(tmp_path / "out"),
                "--mirror",
                f"http://{peer.host}",
                MODELPACK_PEER_TOKEN=value,
            )
            assert done.returncode == 2, done.stderr
            assert "MODELPACK_PEER_TOKEN" in done.stderr and "Traceback" not in done.stderr, done.stderr
        assert rec.at("peer") == []
    finally:
        peer.close()
