"""A thin HTTP client for the OCI distribution API, on one ``requests.Session``.

Why not the PyPI ``oras`` client: see DESIGN §3. What this adds over bare ``requests``:
scheme choice (HTTPS, plain HTTP only for loopback or an explicit ``--plain-http``), the auth
dance (``modelpack.targets.registry.auth``), bounded retries for idempotent requests only, OCI error
bodies turned into typed errors, and request logging that never includes credentials (only the
method, the path without its query, and the status are logged).

``trust_env`` is off so ``~/.netrc`` can never inject an Authorization header; proxies from the
environment are still honoured, explicitly, for non-loopback registries.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
from collections.abc import Mapping
from typing import Any
from urllib.parse import urljoin, urlsplit

import requests
from requests.adapters import HTTPAdapter

from modelpack.errors import (
    AuthenticationError,
    InsecureRegistryError,
    PermissionDeniedError,
    RegistryConnectionError,
    RegistryError,
    RegistryNotFoundError,
    RegistryTLSError,
)
from modelpack.targets.registry.auth import Authenticator, Credentials
from modelpack.targets.registry.hosts import is_loopback_host

log = logging.getLogger("modelpack.targets.registry")

MAX_ERROR_BODY = 64 * 1024
DEFAULT_RETRIES = 4
MAX_BACKOFF_S = 8.0
RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
SOCKET_BLOCKSIZE = 1024 * 1024
DOCKER_HUB_API = "registry-1.docker.io"  # urllib3 sends streamed bodies in blocks of this size

# bytes, a stream with read() and __len__, or a factory returning a fresh one per attempt
Body = Any


def redact_url(url: str) -> str:
    """Scheme, host and path only: upload URLs carry opaque state; never log query strings."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return f"{parts.scheme}://{host}{parts.path}"


class _BigBlockAdapter(HTTPAdapter):
    """Streams request bodies in 1 MiB blocks (urllib3 defaults to 16 KiB: slow for GiB blobs)."""

    def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
        kwargs["blocksize"] = SOCKET_BLOCKSIZE
        super().init_poolmanager(*args, **kwargs)


def oci_error(response: requests.Response) -> tuple[str | None, str]:
    """First OCI error code and message from an error body (bounded read)."""
    try:
        raw = response.raw.read(MAX_ERROR_BODY, decode_content=True) if response.raw else b""
    except Exception:
        raw = b""
    if not raw:
        try:
            raw = response.content[:MAX_ERROR_BODY]
        except Exception:
            raw = b""
    try:
        doc = json.loads(raw)
        errs = doc.get("errors") if isinstance(doc, dict) else None
        if isinstance(errs, list) and errs and isinstance(errs[0], dict):
            code = errs[0].get("code")
            msg = errs[0].get("message") or ""
            return (str(code) if code else None), str(msg)[:300]
    except (ValueError, UnicodeDecodeError):
        pass
    return None, ""


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
        timeout: float = 300.0,
        retries: int = DEFAULT_RETRIES,
        pool_size: int = 16,
    ) -> None:
        self.host = host
        # Docker Hub's references say docker.io; its API lives elsewhere (as docker resolves it)
        self.api_host = DOCKER_HUB_API if host in ("docker.io", "index.docker.io") else host
        self.plain_http = plain_http
        self.retries = retries
        self.timeout = timeout
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
        self.auth = Authenticator(host, self.session, credentials, verify=self.verify, timeout=60.0)

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
        attempt = 0
        while True:
            try:
                self.session.get(
                    f"https://{self.api_host}/v2/", timeout=10, verify=self.verify, allow_redirects=False
                ).close()
                return "https"
            except requests.exceptions.SSLError as exc:
                text = str(exc)
                if "CERTIFICATE_VERIFY_FAILED" in text or "certificate verify failed" in text:
                    raise RegistryTLSError(
                        "TLS certificate not trusted (pass --ca-file with the registry's CA, or "
                        "--plain-http if it serves HTTP)",
                        target=self.host,
                    ) from None
                return "http"
            except requests.exceptions.ConnectionError as exc:
                if "SSL" in str(exc) or "EOF occurred" in str(exc):
                    return "http"
                if attempt < self.retries:  # a GET: retried like any idempotent request
                    attempt += 1
                    self._sleep(attempt)
                    continue
                raise RegistryConnectionError(
                    f"cannot connect: {type(exc).__name__}", target=self.host
                ) from None

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
    ) -> requests.Response:
        """Send with auth and retries; statuses in ``ok`` or ``allow`` are returned, others raise.

        ``body`` is bytes or a zero-argument factory returning a fresh body (stream) per attempt:
        a streamed upload can only be re-sent if its source can be reopened.
        """
        url = path_or_url if path_or_url.startswith(("http://", "https://")) else self.url(path_or_url)
        if idempotent is None:
            idempotent = method in ("GET", "HEAD")
        attempt = 0
        auth_retried = False
        while True:
            hdrs = dict(headers or {})
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
                    timeout=(30.0, self.timeout),
                    verify=self.verify,
                    proxies=self._proxies,
                    allow_redirects=method in ("GET", "HEAD"),
                )
            except requests.exceptions.SSLError:
                raise RegistryTLSError(
                    "TLS handshake failed (untrusted certificate? pass --ca-file)", target=self.host
                ) from None
            except (requests.exceptions.ConnectionError, requests.exceptions.Timeout) as exc:
                self._close_body(data)
                log.debug("%s %s failed: %s", method, redact_url(url), type(exc).__name__)
                if idempotent and attempt < self.retries:
                    attempt += 1
                    self._sleep(attempt)
                    continue
                raise RegistryConnectionError(
                    f"{what or method} failed: cannot reach the registry ({type(exc).__name__})",
                    target=self.host,
                ) from None
            self._close_body(data)
            log.debug(
                "%s %s -> %d (%.0f ms)",
                method,
                redact_url(url),
                resp.status_code,
                (time.monotonic() - start) * 1e3,
            )
            if resp.status_code == 401 and not auth_retried:
                auth_retried = True
                retry = self.auth.handle_401(resp, scopes)
                resp.close()
                if retry:
                    continue
                raise AuthenticationError(
                    f"{what or method} needs credentials (docker login, --username, or "
                    "MODELPACK_REGISTRY_USERNAME/PASSWORD)",
                    status=401,
                    target=self.host,
                )
            if resp.status_code in RETRY_STATUSES and idempotent and attempt < self.retries:
                attempt += 1
                delay = self._retry_after(resp)
                resp.close()
                self._sleep(attempt, delay)
                continue
            if resp.status_code in ok or resp.status_code in allow:
                if not stream:
                    _ = resp.content  # read the (small) body now so the connection is reused
                return resp
            raise self.error_for(resp, what or f"{method} {urlsplit(url).path}")

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
            return min(float(value), MAX_BACKOFF_S)
        return None

    @staticmethod
    def _sleep(attempt: int, delay: float | None = None) -> None:
        if delay is None:
            delay = min(MAX_BACKOFF_S, 0.2 * (2 ** (attempt - 1))) * (0.5 + random.random() / 2)
        time.sleep(delay)

    def error_for(self, resp: requests.Response, what: str) -> RegistryError:
        code, message = oci_error(resp)
        resp.close()
        status = resp.status_code
        cls: type[RegistryError] = RegistryError
        if status == 404 or (code or "").endswith("_UNKNOWN") or code == "NAME_UNKNOWN":
            cls = RegistryNotFoundError
        elif status == 401:
            cls = AuthenticationError
        elif status == 403 or code == "DENIED":
            cls = PermissionDeniedError
        return cls(what, status=status, code=code, target=self.host, detail=message)

    def ping(self) -> None:
        """GET /v2/: learns the auth scheme; raises if the registry is unreachable or refuses us."""
        self.request("GET", "/v2/", scopes=(), what="registry check")

    def close(self) -> None:
        self.session.close()


__all__ = ["RegistryClient", "is_loopback_host", "oci_error", "redact_url"]
