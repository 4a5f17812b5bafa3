"""``cache serve``: a node cache as a read-only OCI distribution endpoint for its peers.

Spegel's design: every node's content store is a registry mirror for the others, plugged in
through ``--mirror`` (modelpack) or containerd's ``hosts.toml`` (``capabilities = ["pull"]``).
What it answers, and nothing else:

- ``GET /v2/`` (the API check);
- ``GET``/``HEAD /v2/<name>/blobs/sha256:<hex>``, with one ``Range`` (``bytes=a-b``, ``a-``,
  ``-n``);
- ``GET``/``HEAD /v2/<name>/manifests/sha256:<hex>``, its media type read from the manifest;
- ``GET /v2/<name>/referrers/sha256:<hex>[?artifactType=…]``: the signature referrers this cache
  kept for the digest (``mount.kept_referrers``), an OCI image index (empty when none). The
  ``sha256-<hex>`` tag fallback is never served: a client finds referrers at a peer by the API.

Never a tag (a peer never chooses a version: 404), never a listing (``_catalog``, ``tags/list``:
404), never a write (any method but ``GET``/``HEAD``: 405, and a request with a body: 400). The
only path from a request to the filesystem is a validated 64-digit sha256 hex under the store's
``blobs/sha256/``, opened with ``O_NOFOLLOW`` and served only when ``fstat`` says it is a
committed blob (a regular, read-only file of the cache owner that nobody else can write): a
planted, writable, linked or quarantined file, a partial download or anything outside the store
is 404. Whatever a peer serves, its client verifies against the digest.

Who may read, and how much (``mount/serve_access.py``): beyond loopback a bearer token is
required (``MODELPACK_SERVE_TOKEN`` or ``--token-file``; ``--insecure-no-auth`` opts out loudly),
checked in constant time before anything else is done for a request (``401`` otherwise: no file
opened, no fill started); at most ``max_connections`` connections and ``max_per_address`` from
one address (the next: ``503`` and closed); each request head within ``head_timeout`` as a whole;
every socket read and write times out after ``io_timeout``. Request lines and headers are bounded
by ``http.server`` (64 KiB, 100 headers), paths of more than 2 KiB refused. TLS is optional.

With ``fill`` (``cache serve --fill REF@DIGEST``, ``mount/serve_fill.py``) a miss for a blob of a
pinned manifest is fetched once from that manifest's registry, verified and committed: the one
write, bounded by what the operator pinned, never by the request. While that fill runs, a
``GET`` (or ``Range`` ``GET``) of the blob is answered from the fill's growing temp file as the
bytes land (``Content-Length``: the pinned size; each wait bounded by ``wait_s``), and a
``HEAD`` with the pinned size. These are bytes the peer has not verified yet: the last byte of
the blob is sent only once the fill verified and committed it, and a fill that fails cuts every
response still streaming from it short (the connection closes before ``Content-Length``), so the
client, which hashes every byte before using any, abandons this peer for its next source.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import ssl
import stat
import threading
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs

from modelpack.mediatypes import MEDIA_TYPE_OCI_MANIFEST
from modelpack.mount.fill_stream import DONE, FAILED, RUNNING, Fill
from modelpack.mount.kept_referrers import referrers_index
from modelpack.mount.serve_access import (  # beyond_loopback: re-exported
    DeadlineHandler,
    GuardedServer,
    bearer_authorized,
    beyond_loopback,
    require_token,
)
from modelpack.mount.serve_fill import BUSY, MISS, READY, Filler, FillSettings
from modelpack.mount.store import Store

from modelpack.boundedjson import loads_object
from modelpack.errors import CacheServeError, DocumentError

log = logging.getLogger("modelpack.mount.serve")

_NAME = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*"
_ROUTE = re.compile(rf"^/v2/({_NAME})/(blobs|manifests|referrers)/([^/]+)$")
_DIGEST = re.compile(r"^sha256:([0-9a-f]{64})$")
_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")
MAX_PATH = 2048
MAX_MANIFEST_BYTES = 4 * 1024 * 1024
_CHUNK = 1024 * 1024
_MANIFEST_TYPES = frozenset(
    {
        "application/vnd.oci.image.manifest.v1+json",
        "application/vnd.oci.image.index.v1+json",
        "application/vnd.docker.distribution.manifest.v2+json",
        "application/vnd.docker.distribution.manifest.list.v2+json",
    }
)


@dataclass(frozen=True)
class ServeSettings:
    host: str = "127.0.0.1"
    port: int = 5050
    tls_cert: str | None = None
    tls_key: str | None = None
    token: str | None = None
    max_connections: int = 64
    io_timeout: float = 30.0
    #: seconds for a whole request head (and the first one's TLS handshake), however it trickles
    head_timeout: float = 10.0
    #: connections at once from one client address
    max_per_address: int = 16
    #: listen beyond loopback without a token (``--insecure-no-auth``): anyone reaching the port reads
    allow_no_token: bool = False


class _Server(GuardedServer):
    def __init__(
        self, settings: ServeSettings, store: Store, tls: ssl.SSLContext | None, filler: Filler | None = None
    ) -> None:
        self.settings = settings
        self.store = store
        self.filler = filler  # fill-on-miss for pinned manifests' blobs (``serve_fill``), or None
        self.served = 0
        self.count_lock = threading.Lock()
        super().__init__(
            (settings.host, settings.port),
            _Handler,
            tls=tls,
            max_connections=settings.max_connections,
            max_per_address=settings.max_per_address,
            io_timeout=settings.io_timeout,
            head_timeout=settings.head_timeout,
        )


class _Handler(DeadlineHandler):
    protocol_version = "HTTP/1.1"
    server: _Server
    server_version = "modelpack-cache"
    sys_version = ""

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.address_string(), *args)

    # ------------------------------------------------------------------ answers
    def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Docker-Distribution-API-Version", "registry/2.0")
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD" and body:
            self.wfile.write(body)

    def _error(self, status: int, code: str, message: str, headers: dict[str, str] | None = None) -> None:
        body = json.dumps({"errors": [{"code": code, "message": message}]}).encode()
        self._send(status, body, {"Content-Type": "application/json", **(headers or {})})

    def _refuse_method(self) -> None:
        self.close_connection = True
        self._error(405, "UNSUPPORTED", "read-only: only GET and HEAD are served", {"Allow": "GET, HEAD"})

    do_POST = do_PUT = do_PATCH = do_DELETE = do_OPTIONS = do_TRACE = do_CONNECT = _refuse_method

    def do_HEAD(self) -> None:
        self._get()

    def do_GET(self) -> None:
        self._get()

    # ------------------------------------------------------------------ routing
    def _authorized(self) -> bool:
        if bearer_authorized(self.headers.get("Authorization", ""), self.server.settings.token):
            return True
        self._error(
            401,
            "UNAUTHORIZED",
            "a bearer token is required",
            {"WWW-Authenticate": 'Bearer realm="modelpack-cache"'},
        )
        return False

    def _get(self) -> None:
        length = self.headers.get("Content-Length")
        if (length not in (None, "0")) or self.headers.get("Transfer-Encoding"):
            self.close_connection = True
            self._error(400, "UNSUPPORTED", "requests with a body are not accepted")
            return
        if len(self.path) > MAX_PATH:
            self.close_connection = True
            self._error(414, "NAME_INVALID", "path too long")
            return
        if not self._authorized():
            return
        path = self.path.split("?", 1)[0]
        if path in ("/v2", "/v2/"):
            self._send(200, b"{}", {"Content-Type": "application/json"})
            return
        m = _ROUTE.match(path)
        if not m:
            self._error(404, "NOT_FOUND", "only blobs and manifests by digest are served")
            return
        kind, reference = m.group(2), m.group(3)
        d = _DIGEST.match(reference)
        if kind == "referrers":
            self._referrers(d, reference)
            return
        if d is None:
            what = "tags are resolved at the origin only" if kind == "manifests" else "not a sha256 digest"
            self._error(404, "MANIFEST_UNKNOWN" if kind == "manifests" else "BLOB_UNKNOWN", what)
            return
        fd = self._open_committed(d.group(1))
        if fd is None and self.server.filler is not None:
            filler = self.server.filler
            got: Fill | str = filler.stream(d.group(1)) if kind == "blobs" else filler.fill(d.group(1))
            if isinstance(got, Fill):
                if self._blob_from_fill(got, reference):
                    return
                got = READY if got.state == DONE else MISS if got.state == FAILED else BUSY
            if got == BUSY:
                self._busy()
                return
            fd = self._open_committed(d.group(1)) if got == READY else None
        if fd is None:
            self._error(
                404, "MANIFEST_UNKNOWN" if kind == "manifests" else "BLOB_UNKNOWN", "not in this cache"
            )
            return
        with contextlib.closing(os.fdopen(fd, "rb", buffering=0)) as f:
            if kind == "manifests":
                self._manifest(f, reference)
            else:
                self._blob(f, reference)

    def _open_committed(self, hex_digest: str) -> int | None:
        """An fd on ``blobs/sha256/<hex>`` when it is a committed blob (checked on the open fd)."""
        path = os.path.join(self.server.store.blobs_dir, hex_digest)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            if stat.S_ISREG(st.st_mode) and self.server.store.trusted(st, read_only=True):
                os.set_blocking(fd, True)
                return fd
        except OSError:
            pass
        os.close(fd)
        return None

    def _manifest(self, f: Any, digest: str) -> None:
        size = os.fstat(f.fileno()).st_size
        if size > MAX_MANIFEST_BYTES:
            self._error(404, "MANIFEST_UNKNOWN", "not a manifest")
            return
        raw = f.read(MAX_MANIFEST_BYTES + 1)
        try:
            doc = loads_object(raw, what=f"manifest {digest}", max_bytes=MAX_MANIFEST_BYTES)
        except DocumentError:
            self._error(404, "MANIFEST_UNKNOWN", "not a manifest")
            return
        media_type = doc.get("mediaType") if isinstance(doc.get("mediaType"), str) else None
        if media_type is None and "layers" in doc and "config" in doc:
            media_type = MEDIA_TYPE_OCI_MANIFEST
        if media_type not in _MANIFEST_TYPES:
            self._error(404, "MANIFEST_UNKNOWN", "not a manifest")
            return
        self._count()
        self._send(200, raw, {"Content-Type": str(media_type), "Docker-Content-Digest": digest})

    def _busy(self) -> None:
        self._error(503, "UNAVAILABLE", "being filled; ask another source", {"Retry-After": "1"})

    def _span(self, size: int, digest: str) -> tuple[int, int, int, dict[str, str]] | None:
        """(status, first, last byte, headers) of the answer for a blob of ``size`` bytes and this
        request's ``Range``; None when a ``416`` was sent."""
        start, end = 0, size - 1
        status = 200
        headers = {
            "Content-Type": "application/octet-stream",
            "Docker-Content-Digest": digest,
            "Accept-Ranges": "bytes",
        }
        rng = self.headers.get("Range")
        if rng is not None:
            m = _RANGE.match(rng.strip())
            first, last = (m.group(1), m.group(2)) if m else ("", "")
            if m is None or (not first and not last):
                self._error(416, "RANGE_INVALID", "one bytes=a-b range", {"Content-Range": f"bytes */{size}"})
                return None
            if first:
                start = int(first)
                end = min(int(last), size - 1) if last else size - 1
            else:
                start, end = max(0, size - int(last)), size - 1
            if start >= size or start > end:
                self._error(416, "RANGE_INVALID", "not satisfiable", {"Content-Range": f"bytes */{size}"})
                return None
            status = 206
            headers["Content-Range"] = f"bytes {start}-{end}/{size}"
        return status, start, end, headers

    def _head(self, status: int, headers: dict[str, str], length: int) -> None:
        self.send_response(status)
        self.send_header("Docker-Distribution-API-Version", "registry/2.0")
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(length))
        self.end_headers()

    def _blob_from_fill(self, fill: Fill, digest: str) -> bool:
        """Answer from ``fill`` while it runs (its temp file, followed as it grows); False when
        there is nothing to follow (the fill is over: the caller reads the committed blob, or
        misses). Each wait is bounded by ``wait_s`` and ends on shutdown; the response never
        goes beyond what the fill wrote, nor to the blob's last byte before it is verified."""
        wait_s = self.server.filler.settings.wait_s if self.server.filler is not None else 0.0
        stop = self.server.closing
        if fill.size == 0:
            fill.wait(0, wait_s, stop)  # nothing to stream: answered from the commit
            return False
        span = self._span(fill.size, digest)
        if span is None:
            return True  # a 416 was sent
        status, start, end, headers = span
        if self.command == "HEAD":
            self._head(status, headers, end - start + 1)
            return True
        sendable, state = fill.wait(start, wait_s, stop)
        if state != RUNNING:
            return False
        if sendable <= start:
            self._busy()  # no byte within wait_s: ask another source (the fill goes on)
            return True
        fd = fill.reader()
        if fd is None:
            return False
        with contextlib.closing(os.fdopen(fd, "rb", buffering=0)):
            self._head(status, headers, end - start + 1)
            self._count()
            pos = start
            while pos <= end:
                sendable, state = fill.wait(pos, wait_s, stop)
                if state == FAILED or sendable <= pos:  # failed, stalled or shutting down: cut short
                    self.close_connection = True
                    return True
                data = os.pread(fd, min(_CHUNK, end + 1 - pos, sendable - pos), pos)
                if not data:
                    self.close_connection = True
                    return True
                self.wfile.write(data)
                pos += len(data)
        return True

    def _blob(self, f: Any, digest: str) -> None:
        size = os.fstat(f.fileno()).st_size
        span = self._span(size, digest)
        if span is None:
            return
        status, start, end, headers = span
        length = end - start + 1
        self._head(status, headers, length)
        if self.command == "HEAD":
            return
        self._count()
        f.seek(start)
        left = length
        while left > 0:
            data = f.read(min(_CHUNK, left))
            if not data:  # the file shrank under us: cut the connection, the client resumes
                self.close_connection = True
                return
            self.wfile.write(data)
            left -= len(data)

    def _referrers(self, d: re.Match[str] | None, digest: str) -> None:
        """The referrers API over the signatures this cache kept (``mount.kept_referrers``):
        an OCI image index, empty for a digest it holds none for; never the tag fallback."""
        if d is None:
            self._error(400, "DIGEST_INVALID", "referrers are listed by sha256 digest only")
            return
        query = parse_qs(self.path.partition("?")[2], max_num_fields=4)
        values = query.get("artifactType")
        wanted = values[0] if values else None
        body = referrers_index(self.server.store, digest, wanted)
        headers = {"Content-Type": "application/vnd.oci.image.index.v1+json"}
        if wanted:
            headers["OCI-Filters-Applied"] = "artifactType"
        self._count()
        self._send(200, body, headers)

    def _count(self) -> None:
        with self.server.count_lock:
            self.server.served += 1


class CacheServer:
    """A running ``cache serve`` endpoint over the store at ``root`` (opened read-only)."""

    def __init__(self, root: str, settings: ServeSettings, fill: FillSettings | None = None) -> None:
        if settings.max_connections < 1:
            raise CacheServeError("--max-connections must be at least 1")
        if (settings.tls_cert is None) != (settings.tls_key is None):
            raise CacheServeError("--tls-cert and --tls-key go together")
        if settings.max_per_address < 1 or not settings.head_timeout > 0:
            raise CacheServeError("--max-per-address and --head-timeout must be positive")
        require_token(
            settings.host, settings.token, allow_no_token=settings.allow_no_token, fill=fill is not None
        )
        # with --fill this server writes the cache: on a node with none yet (a DaemonSet's first
        # rollout) it is created as 'pull --cache' creates it (Store: owner, 0750, layout);
        # read-only serving never turns a mistyped --cache into a new cache
        self.store = Store(root, create=fill is not None)
        tls = None
        if settings.tls_cert and settings.tls_key:
            tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            tls.minimum_version = ssl.TLSVersion.TLSv1_2
            try:
                tls.load_cert_chain(settings.tls_cert, settings.tls_key)
            except (OSError, ssl.SSLError) as exc:
                raise CacheServeError(f"cannot load the TLS certificate or key: {exc}") from None
        self.filler = Filler(self.store, fill) if fill is not None else None
        try:
            self._server = _Server(settings, self.store, tls, self.filler)
        except OSError as exc:
            raise CacheServeError(
                f"cannot listen on {settings.host}:{settings.port}: {exc.strerror}"
            ) from None
        self.settings = settings

    @property
    def url(self) -> str:
        address = self._server.server_address
        host, port = str(address[0] if isinstance(address[0], str) else address[0].decode()), address[1]
        shown = f"[{host}]" if ":" in host else host
        return f"{'https' if self._server.tls else 'http'}://{shown}:{port}"

    @property
    def served(self) -> int:
        return self._server.served

    def serve_forever(self) -> None:
        try:
            self._server.serve_forever(poll_interval=0.2)
        finally:
            self._server.closing.set()
            self._server.server_close()
            if self.filler is not None:  # running fills stop and take their temp files with them
                self.filler.close()

    def shutdown(self) -> None:
        self._server.closing.set()
        self._server.shutdown()


__all__ = ["CacheServeError", "CacheServer", "ServeSettings", "beyond_loopback"]
