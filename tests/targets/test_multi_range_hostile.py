"""A hostile (or merely unusual) registry answering a multi-range blob read.

The server below answers single-range requests honestly and multi-range ones in the way each
test names: parts reordered, off by one, short, a missing close delimiter, an absurd boundary,
endless part headers, junk between parts, a part missing or extra — each must fail closed with a
``RegistryError`` naming the blob (no retry: the registry's whole answer was wrong); a ``200`` of
the whole blob, a single-part ``206`` over the union and a connection cut mid-part must still give
the right bytes (bands, a covering read, a resume). The caller checks the bytes against signed
digests either way; what is tested here is that the parser never reads past its bounds, never
splices a wrong part into a range's place silently, and never takes a short answer for a whole one.
"""

from __future__ import annotations

import http.server
import os
import threading
from collections.abc import Callable, Iterator

import pytest
from modelpack.mediatypes import MEDIA_TYPE_IMAGE_LAYER_TAR

from modelpack.errors import RegistryConnectionError, RegistryError
from modelpack.oci.descriptor import Descriptor
from modelpack.oci.digest import Digest
from modelpack.targets.registry.byteranges import MAX_PART_HEADER_BYTES
from modelpack.targets.registry.client import RegistryClient
from modelpack.targets.registry.target import RegistryTarget

pytestmark = pytest.mark.timeout(60)

BLOB = os.urandom(256 * 1024)
DESC = Descriptor(MEDIA_TYPE_IMAGE_LAYER_TAR, Digest.from_bytes(BLOB), len(BLOB))
#: 200 ranges of 64 bytes, one per 1 KiB "row"
RANGES = [(row * 1024 + 100, 64) for row in range(200)]
BOUNDARY = b"3d6b6a416f9b5"
#: what a server may push into socket buffers after the client stopped reading
SLACK = 32 << 20

Part = tuple[bytes, bytes]  # (header block, data)


def _part(first: int, last: int, *, data: bytes | None = None, extra: bytes = b"") -> Part:
    head = (
        b"Content-Range: bytes %d-%d/%d\r\nContent-Type: application/octet-stream\r\n"
        % (first, last, len(BLOB))
        + extra
    )
    return head, BLOB[first : last + 1] if data is None else data


def _multipart(
    parts: list[Part], *, boundary: bytes = BOUNDARY, close: bool = True, lead: bytes = b""
) -> bytes:
    """Go's ``mime/multipart`` framing (``lead``: nginx starts with a line end)."""
    out = [lead]
    for i, (head, data) in enumerate(parts):
        out.append((b"\r\n" if i else b"") + b"--" + boundary + b"\r\n" + head + b"\r\n" + data)
    if close:
        out.append(b"\r\n--" + boundary + b"--\r\n")
    return b"".join(out)


def _spans(header: str) -> list[tuple[int, int]]:
    assert header.startswith("bytes=")
    return [(int(a), int(b)) for a, b in (s.split("-") for s in header[6:].split(","))]


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, answer: Callable[[_Handler, list[tuple[int, int]]], None]) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.answer = answer
        self.ranges: list[list[tuple[int, int]]] = []
        self.sent = 0
        self.lock = threading.Lock()

    def handle_error(self, request: object, client_address: object) -> None:
        pass  # a client that hung up on a hostile answer: expected

    @property
    def multi(self) -> list[list[tuple[int, int]]]:
        with self.lock:
            return [r for r in self.ranges if len(r) > 1]


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        spans = _spans(self.headers["Range"])
        with self.server.lock:
            self.server.ranges.append(spans)
            first_multi = len(spans) > 1 and sum(len(r) > 1 for r in self.server.ranges) == 1
        if len(spans) == 1:  # single ranges (the band fallback) are answered honestly
            a, b = spans[0]
            self.reply(206, BLOB[a : b + 1], {"Content-Range": f"bytes {a}-{b}/{len(BLOB)}"})
            return
        self.first_multi = first_multi
        self.server.answer(self, spans)

    def reply(self, status: int, body: bytes, headers: dict[str, str], *, length: int | None = None) -> None:
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body) if length is None else length))
        self.end_headers()
        self.send(body)

    def send(self, body: bytes) -> None:
        try:
            self.wfile.write(body)
            self.wfile.flush()
        except OSError:
            self.close_connection = True
            return
        with self.server.lock:
            self.server.sent += len(body)

    def multipart(self, body: bytes, boundary: bytes = BOUNDARY) -> None:
        self.reply(206, body, {"Content-Type": "multipart/byteranges; boundary=" + boundary.decode()})

    def stream(self, status: int, headers: dict[str, str], head: bytes, filler: bytes) -> None:
        """``head``, then ``filler`` over and over (1 GiB declared) until the client hangs up."""
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(1 << 30))
        self.end_headers()
        self.send(head)
        while not self.close_connection and self.server.sent < (1 << 30):
            self.send(filler)
        self.close_connection = True


@pytest.fixture
def serve() -> Iterator[Callable[[Callable[[_Handler, list[tuple[int, int]]], None]], _Server]]:
    servers: list[_Server] = []

    def start(answer: Callable[[_Handler, list[tuple[int, int]]], None]) -> _Server:
        server = _Server(answer)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def _target(server: _Server) -> RegistryTarget:
    client = RegistryClient(f"127.0.0.1:{server.server_address[1]}", plain_http=True, retry_for=2)
    return RegistryTarget(client, "hostile/blob")


def _read(server: _Server) -> tuple[bytes, int, RegistryTarget]:
    dest = bytearray(sum(n for _, n in RANGES))
    mv = memoryview(dest)
    views = [mv[i * 64 : (i + 1) * 64] for i in range(len(RANGES))]
    target = _target(server)
    fetched = target.fetch_ranges_into(DESC, RANGES, views)
    return bytes(dest), fetched, target


EXPECTED = b"".join(BLOB[o : o + n] for o, n in RANGES)
SPAN = RANGES[-1][0] + RANGES[-1][1] - RANGES[0][0]


def _honest(parts: list[Part]) -> list[Part]:
    return parts


def test_the_test_servers_honest_answers_are_read_go_and_nginx_framing(serve) -> None:  # type: ignore[no-untyped-def]
    """The framing the hostile cases distort, as Go sends it and as nginx does (a line end before
    the first delimiter, a quoted boundary, transport padding after a delimiter)."""
    go = serve(lambda h, spans: h.multipart(_multipart([_part(a, b) for a, b in spans])))
    got, fetched, _ = _read(go)
    assert got == EXPECTED and fetched == sum(n for _, n in RANGES)
    assert len(go.multi) == 1

    def nginx(h: _Handler, spans: list[tuple[int, int]]) -> None:
        body = _multipart([_part(a, b) for a, b in spans], lead=b"\r\n").replace(
            b"--" + BOUNDARY + b"\r\n", b"--" + BOUNDARY + b"  \r\n"
        )
        h.reply(206, body, {"Content-Type": f'multipart/byteranges; boundary="{BOUNDARY.decode()}"'})

    got, _, _ = _read(serve(nginx))
    assert got == EXPECTED


def _swap(parts: list[Part]) -> list[Part]:
    return [parts[1], parts[0], *parts[2:]]


def _off_by_one(parts: list[Part]) -> list[Part]:
    (a, b) = RANGES[2][0], RANGES[2][0] + 63
    return [*parts[:2], _part(a + 1, b + 1), *parts[3:]]


def _short(parts: list[Part]) -> list[Part]:
    head, data = parts[1]
    return [parts[0], (head, data[:-1]), *parts[2:]]


def _long(parts: list[Part]) -> list[Part]:
    head, data = parts[1]
    return [parts[0], (head, data + b"X"), *parts[2:]]


def _missing(parts: list[Part]) -> list[Part]:
    return parts[:-1]


def _extra(parts: list[Part]) -> list[Part]:
    return [*parts, _part(len(BLOB) - 10, len(BLOB) - 1)]


def _no_range(parts: list[Part]) -> list[Part]:
    return [(b"Content-Type: application/octet-stream\r\n", parts[0][1]), *parts[1:]]


def _star(parts: list[Part]) -> list[Part]:
    head, data = parts[0]
    return [(head.replace(b"/%d" % len(BLOB), b"/*"), data), *parts[1:]]


def _other_size(parts: list[Part]) -> list[Part]:
    head, data = parts[0]
    return [(head.replace(b"/%d" % len(BLOB), b"/%d" % (len(BLOB) + 1)), data), *parts[1:]]


@pytest.mark.parametrize(
    ("distort", "close", "why"),
    [
        (_swap, True, "bytes 1124-1187/"),  # parts reordered: the first part is the second range
        (_off_by_one, True, "bytes 2149-2212/"),  # a part's Content-Range off by one
        (_short, True, "longer or shorter than its Content-Range"),  # a part shorter than declared
        (_long, True, "longer or shorter than its Content-Range"),  # a part longer than declared
        (_missing, True, "a part asked for is missing"),
        (_extra, True, "more parts than the 200 asked for"),
        (_no_range, True, "a part without a Content-Range"),
        (_star, True, "Content-Range"),
        (_other_size, True, f"/{len(BLOB) + 1}, where"),
        (_honest, False, "ends without its close delimiter"),  # the final boundary missing
    ],
)
def test_a_multipart_answer_that_is_not_the_ranges_asked_for_fails_closed(
    serve,  # type: ignore[no-untyped-def]
    distort: Callable[[list[Part]], list[Part]],
    close: bool,
    why: str,
) -> None:
    server = serve(
        lambda h, spans: h.multipart(_multipart(distort([_part(a, b) for a, b in spans]), close=close))
    )
    with pytest.raises(RegistryError) as exc:
        _read(server)
    assert not isinstance(exc.value, RegistryConnectionError)
    assert str(DESC.digest) in str(exc.value) and why in str(exc.value)
    assert len(server.multi) == 1  # the registry's answer, not a cut: never asked again


def test_junk_where_a_delimiter_is_due_fails_closed(serve) -> None:  # type: ignore[no-untyped-def]
    def junk(h: _Handler, spans: list[tuple[int, int]]) -> None:
        body = _multipart([_part(a, b) for a, b in spans])
        second = body.index(b"\r\n--" + BOUNDARY, 10)
        h.multipart(body[:second] + b"\r\nHTTP/1.1 200 OK junk\r\n" + body[second:])

    server = serve(junk)
    with pytest.raises(RegistryError, match="where the multipart delimiter was due") as exc:
        _read(server)
    assert str(DESC.digest) in str(exc.value)


def test_a_boundary_of_absurd_length_is_refused_before_the_body_is_read(serve) -> None:  # type: ignore[no-untyped-def]
    boundary = b"b" * 5000
    server = serve(
        lambda h, spans: h.multipart(_multipart([_part(a, b) for a, b in spans], boundary=boundary), boundary)
    )
    with pytest.raises(RegistryError, match="a multipart boundary of 5000 characters") as exc:
        _read(server)
    assert str(DESC.digest) in str(exc.value)
    server2 = serve(lambda h, spans: h.reply(206, b"", {"Content-Type": "multipart/byteranges; charset=x"}))
    with pytest.raises(RegistryError, match="without a boundary"):
        _read(server2)


@pytest.mark.parametrize("endless", [False, True])
def test_part_headers_over_the_bound_fail_closed_without_reading_on(serve, endless: bool) -> None:  # type: ignore[no-untyped-def]
    """9 KiB of headers in one part, or a header that never ends (1 GiB declared)."""

    def big(h: _Handler, spans: list[tuple[int, int]]) -> None:
        if endless:
            head = b"--" + BOUNDARY + b"\r\nContent-Range: bytes 100-163/%d\r\nX-Pad: " % len(BLOB)
            h.stream(
                206,
                {"Content-Type": "multipart/byteranges; boundary=" + BOUNDARY.decode()},
                head,
                b"x" * 65536,
            )
            return
        parts = [_part(a, b) for a, b in spans]
        parts[3] = _part(*spans[3], extra=b"X-Pad: " + b"x" * (MAX_PART_HEADER_BYTES + 1000) + b"\r\n")
        h.multipart(_multipart(parts))

    server = serve(big)
    with pytest.raises(RegistryError, match=f"part headers longer than {MAX_PART_HEADER_BYTES} bytes") as exc:
        _read(server)
    assert str(DESC.digest) in str(exc.value)
    assert server.sent < SLACK


def test_a_200_of_the_whole_blob_is_closed_unread_and_the_ranges_read_as_bands(serve) -> None:  # type: ignore[no-untyped-def]
    """The registry ignores the multi-range request and starts sending the whole blob (1 GiB
    declared): the client stops reading it and reads a covering band with one range."""
    server = serve(lambda h, spans: h.stream(200, {}, BLOB, b"\0" * 65536))
    got, fetched, _ = _read(server)
    assert got == EXPECTED
    assert fetched >= SPAN
    assert len(server.multi) == 1  # not asked again with many ranges
    assert [r for r in server.ranges if len(r) == 1] == [[(RANGES[0][0], RANGES[-1][0] + 63)]]
    assert server.sent < SLACK


def test_a_single_part_206_over_the_union_is_read_past_its_gaps(serve) -> None:  # type: ignore[no-untyped-def]
    """A registry may coalesce the ranges into one (RFC 9110 §14.2)."""

    def coalesce(h: _Handler, spans: list[tuple[int, int]]) -> None:
        a, b = spans[0][0], spans[-1][1]
        h.reply(206, BLOB[a : b + 1], {"Content-Range": f"bytes {a}-{b}/{len(BLOB)}"})

    server = serve(coalesce)
    got, fetched, _ = _read(server)
    assert got == EXPECTED and fetched == SPAN
    assert len(server.ranges) == 1

    # one part that does not cover what was asked is the registry's error
    narrow = serve(
        lambda h, spans: h.reply(206, BLOB[100:164], {"Content-Range": f"bytes 100-163/{len(BLOB)}"})
    )
    with pytest.raises(RegistryError, match="got Content-Range 'bytes 100-163/") as exc:
        _read(narrow)
    assert str(DESC.digest) in str(exc.value)


@pytest.mark.parametrize("at", ["part data", "part headers"])
def test_a_connection_cut_mid_part_resumes_what_was_missing(serve, at: str) -> None:  # type: ignore[no-untyped-def]
    """The first multi-range answer stops (its declared length not reached) inside a part; the
    ranges already filled are kept, the rest asked for again, from the byte reached."""

    def cut(h: _Handler, spans: list[tuple[int, int]]) -> None:
        body = _multipart([_part(a, b) for a, b in spans])
        if not h.first_multi:
            h.multipart(body)
            return
        mark = body.index(b"Content-Range: bytes %d-" % spans[120][0])
        stop = body.index(b"\r\n\r\n", mark) + 4 + 30 if at == "part data" else mark + 10
        h.send_response(206)
        h.send_header("Content-Type", "multipart/byteranges; boundary=" + BOUNDARY.decode())
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.send(body[:stop])
        h.close_connection = True

    server = serve(cut)
    got, fetched, target = _read(server)
    assert got == EXPECTED
    assert target.stats["read_resumes"] == 1
    first, second = server.multi
    assert len(first) == len(RANGES)
    if at == "part data":  # the cut range continues from the byte reached
        assert second[0] == (RANGES[120][0] + 30, RANGES[120][0] + 63)
        assert len(second) == len(RANGES) - 120
    else:
        assert second[0] == (RANGES[120][0], RANGES[120][0] + 63)
    assert fetched == sum(n for _, n in RANGES)
