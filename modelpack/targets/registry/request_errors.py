"""What a failed registry request becomes: a typed error naming the registry, what was being
done and why (``connection_error`` for a transport failure, ``status_error`` for an HTTP error
answer, ``foreign_challenge`` for a 401 from a host a request was redirected to), and URLs as
they may be logged (``redact_url``: never a query string)."""

from __future__ import annotations

from urllib.parse import urlsplit

import requests
import urllib3

from modelpack.errors import (
    AuthenticationError,
    PermissionDeniedError,
    RegistryConnectionError,
    RegistryError,
    RegistryNotFoundError,
)
from modelpack.targets.registry.bodies import SMALL_BODY_SECONDS, oci_error, unreachable_reason
from modelpack.targets.registry.hosts import canonical_host
from modelpack.targets.retry import RetryBudget


def redact_url(url: str) -> str:
    """Scheme, host and path only: upload URLs carry opaque state; never log query strings."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return f"{parts.scheme}://{host}{parts.path}"


def timed_out(exc: BaseException) -> bool:
    """A connect or read timeout, whichever layer (requests, urllib3, the socket) noticed it."""
    return isinstance(
        exc, (requests.exceptions.Timeout, urllib3.exceptions.TimeoutError, TimeoutError)
    ) or "timed out" in str(exc)


def untrusted_certificate(exc: BaseException) -> bool:
    """A certificate verification failure (fatal), as opposed to a handshake cut by a restart."""
    text = str(exc)
    return "CERTIFICATE_VERIFY_FAILED" in text or "certificate verify failed" in text or "hostname" in text


def connection_error(
    host: str,
    what: str,
    exc: BaseException | None,
    budget: RetryBudget | None,
    *,
    timeout: float,
    ever_answered: bool,
) -> RegistryConnectionError:
    """The typed error for a transport failure: the registry, what was being done, why, and
    how long it was retried (a traceback names none of these)."""
    reason = type(exc).__name__ if exc is not None else "connection lost"
    unreachable = unreachable_reason(exc) if exc is not None else None
    failure = "connection"
    if exc is not None and timed_out(exc):
        reason = f"no answer within {timeout:g} s; --timeout sets the limit"
        failure = "stall"
    elif unreachable is not None and not ever_answered:
        check = "host name" if "resolve" in unreachable else "host and port"
        reason = f"{unreachable}; it never answered, so nothing was retried: check the {check}"
    elif unreachable is not None:
        reason = unreachable  # "connection refused" named: the source-events say why a source was left
    elif exc is not None and "refused" in str(exc).lower():
        reason = "connection refused"
    if "connection refused" in reason:
        failure = "connection_refused"
    tried = ""
    if budget is not None and (budget.retries or budget.exhausted):
        tried = f" (retried for {budget.spent_s:.0f} s; --retry-for sets how long)"
    return RegistryConnectionError(
        f"{what} failed: cannot reach the registry ({reason}){tried}",
        target=host,
        failure=failure,
    )


def status_error(host: str, resp: requests.Response, what: str, *, timeout: float) -> RegistryError:
    """The typed error for an HTTP error answer, its OCI error body read within ``timeout``."""
    code, message = oci_error(resp, min(timeout, SMALL_BODY_SECONDS))
    resp.close()
    status = resp.status_code
    cls: type[RegistryError] = RegistryError
    if status == 404 or (code or "").endswith("_UNKNOWN") or code == "NAME_UNKNOWN":
        cls = RegistryNotFoundError
    elif status == 401:
        cls = AuthenticationError
    elif status == 403 or code == "DENIED":
        cls = PermissionDeniedError
    return cls(what, status=status, code=code, target=host, detail=message)


def foreign_challenge(host: str, what: str, url: str) -> AuthenticationError:
    """A 401 from a host the request was redirected to: never answered with ``host``'s
    credentials (the challenge, and any token realm it names, belong to that host)."""
    return AuthenticationError(
        f"{what}: the registry redirected to {canonical_host(urlsplit(url).netloc)}, which asks "
        f"for credentials; credentials for {canonical_host(host)} are never sent to another "
        "host (the registry's redirect target must serve the blob without them)",
        status=401,
        target=host,
    )
