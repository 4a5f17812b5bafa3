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
import threading
from collections.abc import Iterator

import pytest

from modelpack.targets.registry.client import MAX_IGNORED_BODY, RegistryClient

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
