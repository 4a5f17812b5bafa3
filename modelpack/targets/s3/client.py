"""A boto3 S3 client from the standard credential chain, and botocore failures as typed errors.

boto3 and botocore are imported only inside these functions: importing ``modelpack.targets`` (a
node-cache hit by digest) must not pay for them. Endpoint, region and credentials come from
boto3's chain (environment, shared profile, web identity / IRSA, instance metadata) plus
``TargetOptions.s3_endpoint`` / ``s3_region``. Errors name ``s3://bucket/key``, never credentials.

An endpoint URL may carry an access key and secret (``http://KEY:SECRET@minio:9000``, the form
S3 tools print for MinIO). They are taken off the URL before boto3 sees it, used as that
endpoint's credentials, and shown as ``***`` wherever the endpoint is named: botocore puts the
URL it was given into its connection errors, and those reach logs and terminals.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

from modelpack import settings
from modelpack.errors import ModelpackError, NotFoundError, S3Error

_USERINFO_RE = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/?#\s@\"'<>]*@")
_BARE_USERINFO_RE = re.compile(r"(?<![\w/.:-])[^\s/@:\"'<>]+:[^\s/@\"'<>]*@")
_CONFLICT_CODES = {"PreconditionFailed", "ConditionalRequestConflict", "NoSuchKey"}
_UNSUPPORTED_CODES = {"NotImplemented"}


def endpoint_from_env() -> str | None:
    """``MODELPACK_S3_ENDPOINT``, else the AWS SDK's own endpoint variables."""
    return (
        settings.S3_ENDPOINT.get()
        or os.environ.get("AWS_ENDPOINT_URL_S3")
        or os.environ.get("AWS_ENDPOINT_URL")
        or None
    )


def redact_credentials(text: str) -> str:
    """``text`` with the user and secret of every ``scheme://user:secret@host`` URL (and of a
    scheme-less ``user:secret@host``) as ``***``."""
    return _BARE_USERINFO_RE.sub("***@", _USERINFO_RE.sub(r"\1***@", text))


def split_endpoint(endpoint: str) -> tuple[str, tuple[str, str] | None]:
    """``(endpoint without user info, (access key, secret) or None)``; the URL given to boto3
    never holds a secret, so botocore cannot print one."""
    try:
        parts = urlsplit(endpoint)
        netloc = parts.netloc
    except ValueError:
        raise S3Error(f"invalid S3 endpoint {redact_credentials(endpoint)!r}") from None
    if "://" not in endpoint or not netloc:
        raise S3Error(f"invalid S3 endpoint {redact_credentials(endpoint)!r}: expected http[s]://HOST[:PORT]")
    if "@" not in netloc:
        return endpoint, None
    userinfo, host = netloc.rsplit("@", 1)
    user, _, secret = userinfo.partition(":")
    clean = urlunsplit((parts.scheme, host, parts.path, parts.query, parts.fragment))
    if not user or not secret:
        raise S3Error(
            f"S3 endpoint {redact_credentials(endpoint)}: user info must be ACCESS_KEY:SECRET (or none)"
        )
    return clean, (unquote(user), unquote(secret))


def _quiet_wire_loggers() -> None:
    """Keep botocore's DEBUG wire logs off, even under ``modelpack --debug``.

    They print signed request headers, including the access key id and ``x-amz-security-token``
    (measured: ``modelpack --debug push … s3://…`` printed the session token). modelpack's own
    ``modelpack.targets.s3`` logger still reports every decision, by key.
    """
    for name in ("botocore", "boto3", "s3transfer"):
        lg = logging.getLogger(name)
        if lg.getEffectiveLevel() < logging.INFO:  # only under --debug; other levels stay as set
            lg.setLevel(logging.INFO)


_LOADER: Any = None
_LOADER_LOCK = threading.Lock()


def _botocore_session() -> Any:
    """A fresh botocore session (credentials re-resolved from the chain each time) sharing one
    data loader, so the S3 service model JSON is parsed once per process, not per target."""
    import botocore.loaders
    import botocore.session

    global _LOADER
    with _LOADER_LOCK:
        if _LOADER is None:
            _LOADER = botocore.loaders.create_loader()
    bs = botocore.session.Session()
    bs.register_component("data_loader", _LOADER)
    return bs


def make_client(endpoint: str | None = None, region: str | None = None, *, max_pool: int = 16) -> Any:
    """A boto3 S3 client from the standard credential chain (boto3 is imported only here).

    A custom endpoint (S3-compatible store, moto) gets path-style addressing, which works with IP
    addresses and bucket names containing dots.
    """
    try:
        import boto3
        from botocore.config import Config
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise S3Error("s3:// needs boto3: pip install 'modelpack-oci[s3]'") from exc
    _quiet_wire_loggers()
    endpoint = endpoint or endpoint_from_env()
    keys: tuple[str, str] | None = None
    if endpoint:
        endpoint, keys = split_endpoint(endpoint)
    session = boto3.session.Session(botocore_session=_botocore_session())
    region = region or session.region_name or "us-east-1"
    config = Config(
        retries={"mode": "standard", "max_attempts": 5},
        max_pool_connections=max_pool,
        s3={"addressing_style": "path"} if endpoint else {},
        user_agent_extra="modelpack",
    )
    extra: dict[str, Any] = {}
    if keys is not None:  # the endpoint's own credentials, for that endpoint only
        extra = {"aws_access_key_id": keys[0], "aws_secret_access_key": keys[1], "aws_session_token": None}
    try:
        return session.client("s3", endpoint_url=endpoint, region_name=region, config=config, **extra)
    except ValueError as exc:  # botocore: "Invalid endpoint: …"
        raise S3Error(
            f"invalid S3 endpoint {redact_credentials(endpoint or '')!r}: {type(exc).__name__}"
        ) from None


def client_errors() -> tuple[type[BaseException], ...]:
    """What a boto3 call raises when S3 (or the way to it) fails: the ``except`` clause for one."""
    from botocore.exceptions import BotoCoreError, ClientError

    return (ClientError, BotoCoreError)


def is_transient(exc: BaseException) -> bool:
    """A failure that can heal on its own: the endpoint refused, reset or timed out a connection
    (restarting, failing over), or answered 500/503. Not: denied, missing, or a changed object."""
    from botocore.exceptions import ConnectionError as BotoConnectionError
    from botocore.exceptions import HTTPClientError

    if isinstance(exc, (BotoConnectionError, HTTPClientError)):
        return True
    _, status = error_code(exc)
    return status in (500, 502, 503, 504)


def error_code(exc: BaseException) -> tuple[str, int]:
    """S3's error code and HTTP status from a ``ClientError`` (``("", 0)`` for anything else)."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return "", 0
    code = str((response.get("Error") or {}).get("Code") or "")
    status = int((response.get("ResponseMetadata") or {}).get("HTTPStatusCode") or 0)
    return code, status


def is_not_found(exc: BaseException) -> bool:
    code, status = error_code(exc)
    return code in ("NoSuchKey", "404", "NotFound") or (status == 404 and code != "NoSuchBucket")


def is_conflict(exc: BaseException) -> bool:
    """A conditional write lost to another writer (or the object it was conditioned on vanished)."""
    code, status = error_code(exc)
    return code in _CONFLICT_CODES or status in (409, 412)


def is_unsupported(exc: BaseException) -> bool:
    """The endpoint does not implement what was asked (conditional writes on older stores)."""
    code, status = error_code(exc)
    return code in _UNSUPPORTED_CODES or status == 501


def wrap_client_error(exc: BaseException, operation: str, where: str) -> ModelpackError:
    """A typed error naming the object; botocore's message carries no credentials, only codes."""
    if isinstance(exc, ModelpackError):
        return exc
    code, status = error_code(exc)
    if code == "NoSuchBucket":
        return NotFoundError(f"{where}: bucket does not exist")
    if is_not_found(exc):
        return NotFoundError(f"{where}: not found")
    name = type(exc).__name__
    if name in ("NoCredentialsError", "PartialCredentialsError"):
        return S3Error(
            f"{where}: no AWS credentials (environment, profile, web identity or instance metadata)",
            operation=operation,
            key=where,
        )
    detail = f"{code} (HTTP {status})" if code else f"{name}: {redact_credentials(str(exc))}"
    return S3Error(
        f"{where}: S3 {operation} failed: {detail}", operation=operation, key=where, code=code, status=status
    )
