"""A hostile registry answering "success" with an endless body must not make the client read it.

Responses whose body the client does not use (``GET /v2/``, an upload's 202, a manifest PUT's
201, a DELETE) are still read by ``requests`` to reuse the connection. A registry (or anything
on the path) that answers them with gigabytes — or a body that never ends — would have the
client buffer all of it. The server below counts what it managed to send before the client
hung up: the client must stop after a small bound, and the request must still succeed (the
status and headers are the answer; the body is ignored).
"""

from __future__ import annotations

import http.server
import json
import threading
import time
from collections.abc import Iterator

import pytest

from modelpack.errors import RegistryConnectionError, RegistryNotFoundError
from modelpack.targets.registry.bodies import MAX_IGNORED_BODY
from modelpack.targets.registry.client import RegistryClient

ENDLESS = 1 << 30  # 1 GiB declared: far more than any ignored body may cost


class _Endless(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.sent: dict[str, int] = {}
        self.lock = threading.Lock()


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Endless

    def log_message(self, format: str, *args: object) -> None:
        pass

    def _answer(self, status: int) -> None:
        length = int(self.headers.get("Content-Length", "0") or 0)
        if length:
            self.rfile.read(length)
        self.send_response(status)
        self.send_header("Content-Length", str(ENDLESS))
        self.send_header("Location", "/v2/x/blobs/uploads/1")
        self.send_header("Docker-Distribution-API-Version", "registry/2.0")
        self.end_headers()
        chunk = b"\0" * (1 << 20)
        sent = 0
        try:
            while sent < ENDLESS:
                self.wfile.write(chunk)
                sent += len(chunk)
                with self.server.lock:
                    self.server.sent[self.command] = sent
        except OSError:  # the client hung up (broken pipe, reset, timeout)
            pass
        self.close_connection = True

    def do_GET(self) -> None:
        self._answer(200)

    def do_POST(self) -> None:
        self._answer(202)

    def do_PUT(self) -> None:
        self._answer(201)

    def do_DELETE(self) -> None:
        self._answer(202)


@pytest.fixture
def endless() -> Iterator[_Endless]:
    server = _Endless()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("method", "path", "ok"),
    [
        ("GET", "/v2/", (200,)),  # the registry check (login, every first contact)
        ("POST", "/v2/x/blobs/uploads/", (202,)),  # an upload session
        ("PUT", "/v2/x/manifests/v1", (201,)),  # a manifest push
        ("DELETE", "/v2/x/blobs/uploads/1", (202,)),  # a cancelled upload
    ],
)
def test_an_endless_success_body_is_not_read(
    endless: _Endless, method: str, path: str, ok: tuple[int, ...]
) -> None:
    client = RegistryClient(f"127.0.0.1:{endless.server_address[1]}", plain_http=True, retry_for=0)
    try:
        resp = client.request(method, path, scopes=(), ok=ok, body=b"{}" if method == "PUT" else None)
        assert resp.status_code == ok[0]
    finally:
        client.close()
    # the server keeps writing into socket buffers for a moment after the client hangs up;
    # what matters is that the client did not take the GiB (nor hundreds of MiB)
    with endless.lock:
        sent = endless.sent.get(method, 0)
    assert sent < MAX_IGNORED_BODY + (32 << 20), (
        f"{method} {path}: the client read {sent} bytes of an ignored body"
    )


class _Drip(http.server.ThreadingHTTPServer):
    """A registry that trickles: one byte at a time, each well inside any read timeout.

    ``/v2/`` asks for a bearer token from ``/token`` (served trickling) when ``token`` is set;
    ``/v2/x/tags/list`` trickles a document; ``/v2/x/manifests/gone`` a 404 error body."""

    daemon_threads = True

    def __init__(self, token: bool) -> None:
        super().__init__(("127.0.0.1", 0), _DripHandler)
        self.token = token


class _DripHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Drip

    def log_message(self, format: str, *args: object) -> None:
        pass

    def _trickle(self, status: int, body: bytes, extra: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()
        try:
            for i in range(len(body)):
                self.wfile.write(body[i : i + 1])
                self.wfile.flush()
                time.sleep(0.05)
        except OSError:
            pass
        self.close_connection = True

    def do_GET(self) -> None:
        port = self.server.server_address[1]
        path = self.path.split("?", 1)[0]
        if self.server.token and path != "/token" and "Authorization" not in self.headers:
            challenge = f'Bearer realm="http://127.0.0.1:{port}/token",service="drip"'
            self._trickle(401, b"{}", {"WWW-Authenticate": challenge})
        elif path == "/token":
            self._trickle(200, b'{"token": "' + b"t" * 4000 + b'"}')
        elif path == "/v2/x/manifests/gone":
            error = {"errors": [{"code": "MANIFEST_UNKNOWN", "message": "m" * 4000}]}
            self._trickle(404, json.dumps(error).encode())
        else:
            self._trickle(200, b'{"name": "x", "tags": [' + b'"t",' * 1000 + b'"t"]}')


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("case", "path", "error", "words"),
    [
        ("document", "/v2/x/tags/list", RegistryConnectionError, "too slowly"),
        ("token", "/v2/x/tags/list", RegistryConnectionError, "trickled"),
        ("error body", "/v2/x/manifests/gone", RegistryNotFoundError, "list tags of x"),
    ],
)
def test_a_body_dripped_byte_by_byte_is_abandoned_at_the_deadline(
    case: str, path: str, error: type[Exception], words: str
) -> None:
    """A per-read timeout never fires on a body that trickles in. A document (manifest, index,
    tag list) and a token must arrive whole within the client's timeout, or the request fails;
    an error body is abandoned at the deadline and the error raised with what has arrived."""
    server = _Drip(token=case == "token")
    threading.Thread(target=server.serve_forever, daemon=True).start()
    client = RegistryClient(
        f"127.0.0.1:{server.server_address[1]}", plain_http=True, timeout=2.0, retry_for=0
    )
    started = time.monotonic()
    try:
        with pytest.raises(error) as exc:
            client.fetch_document(
                path, scopes=("repository:x:pull",), max_bytes=1 << 20, what="list tags of x"
            )
    finally:
        client.close()
        server.shutdown()
        server.server_close()
    assert words in str(exc.value)
    assert time.monotonic() - started < 30  # the whole drip would take minutes
