"""A thin HTTP client for the OCI distribution API, on one ``requests.Session``.

Why not the PyPI ``oras`` client: docs/architecture.md#why-modelpack-has-its-own-registry-client.
What this adds over bare ``requests``:
scheme choice (HTTPS, plain HTTP only for loopback or an explicit ``--plain-http``), the auth
dance (``modelpack.targets.registry.auth``), retries of idempotent requests within a time budget
(``modelpack.targets.retry``: backoff with jitter, long enough to ride out a registry restart),
small bodies read whole and re-fetched when a connection is cut, OCI error bodies turned into
typed errors, and request logging that never includes credentials (only the method, the path
without its query, and the status are logged). Whatever ``requests`` or ``urllib3`` raise leaves
this module as a ``RegistryConnectionError`` naming the registry and what was being done.

The Authorization header goes to the registry's own host only: an upload ``Location`` or a
redirect to another host gets none (``requests`` strips it from redirects; ``request`` does not
add it to URLs on other hosts). A challenge belongs to the host that sent it: a 401 is learnt from
only when the response came from the registry's own host (``resp.url``, after redirects), so a
host a blob GET was redirected to cannot name a token realm that collects the registry's
credentials; its 401 is an ``AuthenticationError`` naming it.

``trust_env`` is off so ``~/.netrc`` can never inject an Authorization header; proxies from the
environment are still honoured, explicitly, for non-loopback registries.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urljoin, urlsplit

import requests
from requests.adapters import HTTPAdapter

from modelpack.errors import (
    AuthenticationError,
    InsecureRegistryError,
    RegistryConnectionError,
    RegistryError,
    RegistryTLSError,
)
from modelpack.targets.registry.auth import Authenticator, Credentials, unbound_environment_hint
from modelpack.targets.registry.bodies import (
    SMALL_BODY_SECONDS,
    TRANSPORT_ERRORS,
    discard_body,
    is_transport_error,
    oci_error,
    read_by_deadline,
)
from modelpack.targets.registry.hosts import canonical_host, is_loopback_host
from modelpack.targets.registry.outages import RegistryOutages
from modelpack.targets.registry.request_errors import (  # redact_url: re-exported
    connection_error,
    foreign_challenge,
    redact_url,
    status_error,
    untrusted_certificate,
)
from modelpack.targets.retry import RetryBudget

log = logging.getLogger("modelpack.targets.registry")

#: answers that mean "not now": retried within the budget (a restarting registry behind a proxy)
RETRY_STATUSES = frozenset({408, 429, 502, 503, 504})
#: a 500 is more often a lasting fault than an outage: retried a few times only
MAX_500_RETRIES = 4
SOCKET_BLOCKSIZE = 1024 * 1024  # urllib3 sends streamed bodies in blocks of this size
#: seconds one request may wait for a read or a whole document (``--timeout``, ``MODELPACK_TIMEOUT``)
DEFAULT_TIMEOUT_S = 300.0
#: connecting never waits longer than this, whatever ``--timeout`` says
MAX_CONNECT_S = 30.0
#: the loopback scheme probe (HTTPS or HTTP?) never waits longer than this
MAX_PROBE_S = 10.0
DOCKER_HUB_API = "registry-1.docker.io"

# bytes, a stream with read() and __len__, or a factory returning a fresh one per attempt
Body = Any


class _BigBlockAdapter(HTTPAdapter):
    """Streams request bodies in 1 MiB blocks (urllib3 defaults to 16 KiB: slow for GiB blobs)."""

    def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
        kwargs["blocksize"] = SOCKET_BLOCKSIZE
        super().init_poolmanager(*args, **kwargs)


@dataclass
class Document:
    """A small response read whole: status, headers and body (at most the caller's bound + 1)."""

    status: int
    headers: Mapping[str, str]
    body: bytes


class BodyTooLarge(Exception):
    """A declared ``Content-Length`` above the caller's bound (raised before reading)."""

    def __init__(self, declared: int) -> None:
        super().__init__(declared)
        self.declared = declared


class RegistryClient:
    """One registry host. ``request`` does auth, retries and error mapping; callers say which
    token scopes a request needs (``repository:NAME:pull`` …) and which statuses are success."""

    def __init__(
        self,
        host: str,
        *,
        plain_http: bool = False,
        ca_file: str | None = None,
        insecure_skip_verify: bool = False,
        credentials: Credentials | None = None,
        timeout: float | None = None,
        retry_for: float | None = None,
        pool_size: int = 16,
    ) -> None:
        self.host = host
        # Docker Hub's references say docker.io; its API lives elsewhere (as docker resolves it)
        self.api_host = DOCKER_HUB_API if host in ("docker.io", "index.docker.io") else host
        self.plain_http = plain_http
        self.retry_for = retry_for
        self.timeout = DEFAULT_TIMEOUT_S if timeout is None else float(timeout)
        if not self.timeout > 0:
            raise ValueError(f"timeout must be positive, got {timeout!r}")
        self.verify: bool | str = False if insecure_skip_verify else (ca_file or True)
        self._scheme: str | None = "http" if plain_http else ("https" if not is_loopback_host(host) else None)
        self._scheme_lock = threading.Lock()
        self.session = requests.Session()
        self.session.trust_env = False
        adapter = _BigBlockAdapter(pool_connections=pool_size, pool_maxsize=pool_size, max_retries=0)
        self.session.mount("https://", adapter)
        self.session.mount("http://", adapter)
        self.session.headers["User-Agent"] = "modelpack/0.1"
        self._proxies: dict[str, str] = {}
        if not is_loopback_host(host):
            self._proxies = requests.utils.get_environ_proxies(f"https://{self.api_host}/") or {}
        self.auth = Authenticator(
            host,
            self.session,
            credentials,
            verify=self.verify,
            timeout=min(self.timeout, 60.0),
            retry_for=retry_for,
        )
        #: the retry budget, retry count and outage state (``outages``): one --retry-for for all
        self.outages = RegistryOutages(host, self.api_host, retry_for)

    def with_retry_for(self, retry_for: float | None) -> RegistryClient:
        """This client — its session and connection pool, credentials, tokens and scheme — under
        another ``--retry-for`` (its own outage clock): a short budget for a call that has
        somewhere else to go, without a second pool or a second token exchange."""
        other = copy.copy(self)
        other.retry_for = retry_for
        other.outages = self.outages.under(retry_for)
        return other

    @property
    def retries(self) -> int:
        """Requests retried after a transport failure or a "not now" status."""
        return self.outages.retries

    def budget(self) -> RetryBudget:
        """A fresh retry budget for one operation, drawing on the client's one ``--retry-for``."""
        return self.outages.budget()

    def count_retry(self) -> None:
        self.outages.count_retry()

    # ------------------------------------------------------------------ scheme
    @property
    def base_url(self) -> str:
        return f"{self.scheme}://{self.api_host}"

    @property
    def scheme(self) -> str:
        if self._scheme is None:
            with self._scheme_lock:
                if self._scheme is None:
                    self._scheme = self._probe_loopback_scheme()
        return self._scheme

    def _probe_loopback_scheme(self) -> str:
        """Loopback registries may speak either; try HTTPS first like docker does.

        A certificate the CA file (or system store) does not trust is an error, not a reason to
        fall back: only "this port does not speak TLS at all" selects plain HTTP.
        """
        budget = self.budget()
        while True:
            try:
                self.session.get(
                    f"https://{self.api_host}/v2/",
                    timeout=min(MAX_PROBE_S, self.timeout),
                    verify=self.verify,
                    allow_redirects=False,
                ).close()
                self.outages.mark_answered()
                return "https"
            except requests.exceptions.SSLError as exc:
                if untrusted_certificate(exc):
                    raise RegistryTLSError(
                        "TLS certificate not trusted (pass --ca-file with the registry's CA, or "
                        "--plain-http if it serves HTTP)",
                        target=self.host,
                    ) from None
                self.outages.mark_answered()  # a TLS handshake failed: something listens there
                return "http"
            except requests.exceptions.ConnectionError as exc:
                if "SSL" in str(exc) or "EOF occurred" in str(exc):
                    self.outages.mark_answered()  # something listens there, speaking plain HTTP
                    return "http"
                if not self.outages.cannot_heal(exc) and budget.wait():  # a GET: retried like any GET
                    self.count_retry()
                    continue
                raise self.connection_error("registry check", exc, budget) from None
            except requests.RequestException as exc:
                raise self.connection_error("registry check", exc) from None

    def url(self, path: str) -> str:
        return self.base_url + path

    def resolve_location(self, location: str) -> str:
        """An upload ``Location`` may be relative; refuse a redirect to plain HTTP from HTTPS."""
        url = urljoin(self.base_url + "/", location)
        if self.scheme == "https" and url.startswith("http://"):
            raise InsecureRegistryError(
                "registry sent an upload location downgraded to plain HTTP; refusing", target=self.host
            )
        return url

    def _own_host(self, url: str) -> bool:
        """Whether ``url`` is on this registry's API host (the only host credentials go to)."""
        return canonical_host(urlsplit(url).netloc) == canonical_host(self.api_host)

    # ------------------------------------------------------------------ requests
    def request(
        self,
        method: str,
        path_or_url: str,
        *,
        scopes: tuple[str, ...],
        params: Mapping[str, str] | list[tuple[str, str]] | None = None,
        headers: Mapping[str, str] | None = None,
        body: Body = None,
        stream: bool = False,
        idempotent: bool | None = None,
        ok: tuple[int, ...] = (200,),
        allow: tuple[int, ...] = (),
        what: str = "",
        budget: RetryBudget | None = None,
    ) -> requests.Response:
        """Send with auth and retries; statuses in ``ok`` or ``allow`` are returned, others raise.

        ``body`` is bytes or a zero-argument factory returning a fresh body (stream) per attempt:
        a streamed upload can only be re-sent if its source can be reopened. Idempotent requests
        are retried on transport failures and "not now" statuses until ``budget`` (a fresh one
        per call unless given: a resumed download shares one across its requests) is spent;
        others fail at once with ``RegistryConnectionError`` and the caller decides (an upload
        asks the registry where it stands).
        """
        url = path_or_url if path_or_url.startswith(("http://", "https://")) else self.url(path_or_url)
        if idempotent is None:
            idempotent = method in ("GET", "HEAD")
        budget = budget or self.budget()
        label = what or f"{method} {urlsplit(url).path}"
        auth_retried = False
        errors_500 = 0
        while True:
            hdrs = dict(headers or {})
            if self._own_host(url):
                auth_header = self.auth.header(scopes)
                if auth_header:
                    hdrs["Authorization"] = auth_header
            data = body() if callable(body) else body
            start = time.monotonic()
            try:
                resp = self.session.request(
                    method,
                    url,
                    params=params,
                    headers=hdrs,
                    data=data,
                    stream=True,
                    timeout=(min(MAX_CONNECT_S, self.timeout), self.timeout),
                    verify=self.verify,
                    proxies=self._proxies,
                    allow_redirects=method in ("GET", "HEAD"),
                )
                if not stream and resp.status_code in ok + allow:
                    discard_body(resp, min(self.timeout, SMALL_BODY_SECONDS))
            except requests.exceptions.SSLError as exc:
                self._close_body(data)
                if untrusted_certificate(exc) or not idempotent or not budget.wait():
                    raise RegistryTLSError(
                        f"{label}: TLS handshake failed (untrusted certificate? pass --ca-file)",
                        target=self.host,
                    ) from None
                self.count_retry()
                continue
            except TRANSPORT_ERRORS as exc:
                self._close_body(data)
                if not is_transport_error(exc):  # redirect loops, invalid URLs: not transient
                    raise RegistryError(f"{label} failed: {type(exc).__name__}", target=self.host) from None
                log.debug("%s %s failed: %s", method, redact_url(url), type(exc).__name__)
                if idempotent and not self.outages.cannot_heal(exc) and budget.wait():
                    self.count_retry()
                    continue
                raise self.connection_error(label, exc, budget) from None
            self.outages.mark_answered()
            self._close_body(data)
            log.debug(
                "%s %s -> %d (%.0f ms)",
                method,
                redact_url(url),
                resp.status_code,
                (time.monotonic() - start) * 1e3,
            )
            if resp.status_code == 401 and not self._own_host(resp.url or url):
                resp.close()
                raise self.foreign_challenge(label, resp.url)
            if resp.status_code == 401 and not auth_retried and self._own_host(url):
                auth_retried = True
                retry = self.auth.handle_401(resp, scopes)
                resp.close()
                if retry:
                    continue
                raise AuthenticationError(
                    f"{label} needs credentials (modelpack login, -u/--password-stdin, or "
                    "MODELPACK_REGISTRY_USERNAME/PASSWORD)" + unbound_environment_hint(self.host),
                    status=401,
                    target=self.host,
                )
            if idempotent and self._retryable_status(resp.status_code, errors_500):
                errors_500 += resp.status_code == 500
                hint = self._retry_after(resp)
                if budget.wait(hint):
                    resp.close()
                    self.count_retry()
                    continue
            if resp.status_code in ok or resp.status_code in allow:
                return resp
            raise self.error_for(resp, label)

    def foreign_challenge(self, what: str, url: str) -> AuthenticationError:
        """A 401 from a host the request was redirected to (``request_errors.foreign_challenge``)."""
        return foreign_challenge(self.host, what, url)

    @staticmethod
    def _retryable_status(status: int, errors_500: int) -> bool:
        return status in RETRY_STATUSES or (status == 500 and errors_500 < MAX_500_RETRIES)

    def connection_error(
        self, what: str, exc: BaseException | None, budget: RetryBudget | None = None
    ) -> RegistryConnectionError:
        """The typed error for a transport failure (``request_errors.connection_error``)."""
        return connection_error(
            self.host, what, exc, budget, timeout=self.timeout, ever_answered=self.outages.ever_answered()
        )

    def fetch_document(
        self,
        path_or_url: str,
        *,
        scopes: tuple[str, ...],
        max_bytes: int,
        what: str,
        params: Mapping[str, str] | list[tuple[str, str]] | None = None,
        headers: Mapping[str, str] | None = None,
        ok: tuple[int, ...] = (200,),
        allow: tuple[int, ...] = (),
    ) -> Document:
        """GET a small document (manifest, index, tag list) whole, at most ``max_bytes`` + 1 bytes
        read; a connection cut mid-body is re-fetched within the retry budget. A declared
        ``Content-Length`` above the bound raises ``BodyTooLarge`` before anything is read."""
        budget = self.budget()
        while True:
            resp = self.request(
                "GET",
                path_or_url,
                scopes=scopes,
                params=params,
                headers=headers,
                stream=True,
                ok=ok,
                allow=allow,
                what=what,
                budget=budget,
            )
            with resp:
                declared = resp.headers.get("Content-Length")
                if declared and declared.isdigit() and int(declared) > max_bytes:
                    raise BodyTooLarge(int(declared))
                try:
                    body, in_time = read_by_deadline(resp.raw, max_bytes + 1, self.timeout)
                except TRANSPORT_ERRORS as exc:
                    if not is_transport_error(exc):
                        raise RegistryError(
                            f"{what}: unreadable body ({type(exc).__name__})", target=self.host
                        ) from None
                    log.debug("%s: body cut (%s)", what, type(exc).__name__)
                    if budget.wait():
                        self.count_retry()
                        continue
                    raise self.connection_error(what, exc, budget) from None
                if not in_time:
                    raise RegistryConnectionError(
                        f"{what}: the registry sent the document too slowly ({len(body)} bytes in "
                        f"{self.timeout:.0f} s; --timeout sets the limit)",
                        target=self.host,
                        failure="stall",
                    )
                return Document(resp.status_code, resp.headers, body)

    @staticmethod
    def _close_body(data: Any) -> None:
        close = getattr(data, "close", None)
        if close is not None:
            try:
                close()
            except Exception:
                pass

    @staticmethod
    def _retry_after(resp: requests.Response) -> float | None:
        value = resp.headers.get("Retry-After")
        if value and value.isdigit():
            return float(value)
        return None

    def error_for(self, resp: requests.Response, what: str) -> RegistryError:
        """The typed error for an HTTP error answer (``request_errors.status_error``)."""
        return status_error(self.host, resp, what, timeout=self.timeout)

    def ping(self) -> None:
        """GET /v2/: learns the auth scheme; raises if the registry is unreachable or refuses us."""
        self.request("GET", "/v2/", scopes=(), what="registry check")

    def close(self) -> None:
        self.session.close()


__all__ = [
    "DEFAULT_TIMEOUT_S",
    "TRANSPORT_ERRORS",
    "BodyTooLarge",
    "Document",
    "RegistryClient",
    "is_loopback_host",
    "is_transport_error",
    "oci_error",
    "redact_url",
]
