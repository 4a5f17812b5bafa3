"""Who may read from ``cache serve``, and how much of it one client may hold.

- The token (``require_token`` at start, ``bearer_authorized`` for every request): beyond
  loopback (``beyond_loopback``) the server refuses to start without a bearer token unless the
  operator opts out loudly (``--insecure-no-auth``); an empty token is never "no token". The
  token is compared in constant time before anything else is done for a request.
- Connection slots (``ConnectionSlots``): at most ``max_connections`` at once and
  ``max_per_address`` from one client address; the next is answered ``NO_SLOT_RESPONSE`` and
  closed, never queued.
- The head deadline (``HeadDeadlines``): each request head (and the first one's TLS handshake)
  within ``head_timeout`` seconds as a whole, however slowly its bytes trickle.
"""

from __future__ import annotations

import contextlib
import hmac
import http.server
import ipaddress
import logging
import socket
import socketserver
import ssl
import sys
import threading
import time
from typing import Any

from modelpack.errors import CacheServeError

log = logging.getLogger("modelpack.mount.serve")

#: the answer to a connection over the limits (plain HTTP only: a TLS client would not read it)
NO_SLOT_RESPONSE = (
    b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
)


def beyond_loopback(host: str) -> bool:
    """Whether listening on ``host`` reaches beyond this machine: every address but a loopback
    one, and every name but ``localhost`` (a name is never resolved to decide it; an IPv4-mapped
    IPv6 address counts as beyond: the check fails closed)."""
    name = host.strip("[]")
    try:
        return not ipaddress.ip_address(name).is_loopback
    except ValueError:
        return name.lower() != "localhost"


def require_token(host: str, token: str | None, *, allow_no_token: bool, fill: bool) -> None:
    """Refuse (``CacheServeError``) to serve ``host`` with an empty token, or beyond loopback
    without one unless ``allow_no_token`` (then warn loudly; ``fill``: the server also fetches
    with this node's credentials)."""
    if token is not None and not token.strip():
        raise CacheServeError("the token is empty; an empty token is never 'no token'")
    if beyond_loopback(host) and token is None:
        if not allow_no_token:
            raise CacheServeError(
                f"{host} is beyond loopback: peers must present a token there; set "
                "MODELPACK_SERVE_TOKEN (or --token-file) here and the same value as "
                "MODELPACK_PEER_TOKEN on the pulling nodes (or --insecure-no-auth to serve "
                "every model in this cache to anyone who reaches the port)"
            )
        log.warning(
            "serving %s without a token (--insecure-no-auth): anyone who reaches "
            "the port reads every model in this cache%s",
            host,
            ", and has it fetched with this node's credentials (--fill)" if fill else "",
        )


def bearer_authorized(authorization: str, token: str | None) -> bool:
    """Whether a request's ``Authorization`` header carries ``token`` (compared in constant
    time); every request is authorized when no token is set."""
    if token is None:
        return True
    scheme, _, value = authorization.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(), token.encode())


class ConnectionSlots:
    """``max_connections`` slots, at most ``max_per_address`` of them for one client address."""

    def __init__(self, max_connections: int, max_per_address: int) -> None:
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(max_connections)
        self._max_per_address = max_per_address
        self._per_address: dict[str, int] = {}  # open connections by client address
        #: connections refused for want of a slot
        self.refused = 0

    def take(self, address: str) -> bool:
        """One of this address's slots and one of the server's; False (counted) when none is free."""
        with self._lock:
            if self._per_address.get(address, 0) >= self._max_per_address or not self._slots.acquire(
                blocking=False
            ):
                self.refused += 1
                return False
            self._per_address[address] = self._per_address.get(address, 0) + 1
            return True

    def give(self, address: str) -> None:
        """The slot ``take`` gave ``address`` is free again."""
        with self._lock:
            left = self._per_address.get(address, 1) - 1
            if left > 0:
                self._per_address[address] = left
            else:
                self._per_address.pop(address, None)
            self._slots.release()


class HeadDeadlines:
    """Cuts connections whose request head (or TLS handshake) is not complete by its deadline.

    A per-read timeout does not bound a head sent one byte every few seconds; this does, for the
    head as a whole: a watch (a duplicate of the connection's socket, so shutting it down ends a
    read blocked on the original, TLS or not) is armed when a head is awaited and disarmed once it
    is parsed. One thread checks every armed deadline four times a second."""

    def __init__(self, closing: threading.Event) -> None:
        self._lock = threading.Lock()
        self._armed: dict[int, tuple[float, socket.socket]] = {}
        self._closing = closing
        self._thread: threading.Thread | None = None

    def arm(self, key: int, watch: socket.socket, seconds: float) -> None:
        with self._lock:
            if key not in self._armed:
                self._armed[key] = (time.monotonic() + seconds, watch)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="modelpack-serve-heads", daemon=True)
                self._thread.start()

    def disarm(self, key: int) -> None:
        with self._lock:
            self._armed.pop(key, None)

    def _run(self) -> None:
        while not self._closing.wait(0.25):
            now = time.monotonic()
            with self._lock:
                late = [k for k, (deadline, _) in self._armed.items() if deadline <= now]
                cut = [self._armed.pop(k)[1] for k in late]
            for watch in cut:
                with contextlib.suppress(OSError):
                    watch.shutdown(socket.SHUT_RDWR)


class GuardedServer(http.server.ThreadingHTTPServer):
    """A threading HTTP server whose connections pass the limits before a handler sees them: a
    slot (``ConnectionSlots``), the head deadline (``HeadDeadlines``: the TLS handshake and the
    first head; ``DeadlineHandler`` arms it for each later head), ``io_timeout`` on every socket
    read and write, and TLS when ``tls`` is given. A requester hanging up is logged, never
    socketserver's traceback."""

    daemon_threads = True
    allow_reuse_address = True
    # socketserver's default backlog is 5: a burst of connects (a flood, or a storm of nodes) then
    # overflows it and the kernel drops SYNs, so an honest client's connect waits out SYN
    # retransmits (1 + 2 + 4 + 8 + 16 s) before the per-address limit and head deadline can act
    request_queue_size = 1024

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[DeadlineHandler],
        *,
        tls: ssl.SSLContext | None,
        max_connections: int,
        max_per_address: int,
        io_timeout: float,
        head_timeout: float,
    ) -> None:
        self.tls = tls
        self.handler = handler
        self.io_timeout = io_timeout
        self.head_timeout = head_timeout
        self.slots = ConnectionSlots(max_connections, max_per_address)
        self.closing = threading.Event()  # set on shutdown: ends the waits of streamed fills
        self.heads = HeadDeadlines(self.closing)
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        address = str(client_address[0])
        if not self.slots.take(address):
            with contextlib.suppress(OSError):
                request.settimeout(1.0)
                if self.tls is None:  # a TLS client would not read plain bytes: just close
                    request.sendall(NO_SLOT_RESPONSE)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.give(address)
            raise

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A requester hanging up mid-blob is routine (a node abandons a slow peer, a pod is
        killed): one debug line, never socketserver's traceback on stderr. Anything else is a
        warning naming the exception, still without a traceback (``--debug`` logs it)."""
        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionError, TimeoutError, ssl.SSLError)):
            log.debug("%s hung up: %s", client_address, exc)
        else:
            log.warning(
                "request from %s failed: %r", client_address, exc, exc_info=log.isEnabledFor(logging.DEBUG)
            )

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.give(str(client_address[0]))

    def finish_request(self, request: Any, client_address: Any) -> None:
        request.settimeout(self.io_timeout)
        try:
            watch = request.dup()  # shut down when a head is late: ends reads on ``request`` too
        except OSError:
            return
        key = id(watch)
        try:
            self.heads.arm(key, watch, self.head_timeout)  # the handshake and first head
            if self.tls is not None:
                try:
                    request = self.tls.wrap_socket(request, server_side=True)
                except (OSError, ssl.SSLError) as exc:
                    log.debug("TLS handshake with %s failed: %s", client_address, exc)
                    return
            self.handler(request, client_address, self, head_watch=(key, watch))
        finally:
            self.heads.disarm(key)
            watch.close()


class DeadlineHandler(http.server.BaseHTTPRequestHandler):
    """A request handler whose every request head (an idle keep-alive wait too) must be complete
    within the server's ``head_timeout`` as a whole."""

    server: GuardedServer

    def __init__(
        self,
        request: socket.socket,
        client_address: tuple[str, int],
        server: socketserver.BaseServer,
        head_watch: tuple[int, socket.socket] | None = None,
    ) -> None:
        self.head_watch = head_watch  # (key, socket) in ``server.heads``: see ``HeadDeadlines``
        super().__init__(request, client_address, server)

    def handle_one_request(self) -> None:
        if self.head_watch is not None:
            key, watch = self.head_watch
            self.server.heads.arm(key, watch, self.server.head_timeout)
        super().handle_one_request()

    def parse_request(self) -> bool:
        parsed = super().parse_request()  # reads the headers: the end of the head
        if self.head_watch is not None:
            self.server.heads.disarm(self.head_watch[0])
        return parsed
