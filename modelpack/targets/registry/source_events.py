"""Which source served what: the fetch and fallback events of a registry read through mirrors.

Why: with peers and mirrors in front of the origin, "the start was slow" or "the start failed"
is answered only by knowing which source each manifest, referrer listing and blob came from, how
many bytes each gave, and why a source was left. Every such event names the source as an URL
without credentials (``source``: ``http://10.0.0.7:5050``; a mirror URL never carries any, and
the origin is named by its scheme and host) and its kind (``source_kind``: ``origin`` or
``mirror``); an abandonment also names the failure (``failure``: ``stall``, ``floor``,
``digest_mismatch``, ``not_found``, ``connection_refused``, ``connection``, ``short``,
``error``) beside the full ``reason``.

Events: ``registry.manifest_fetched`` (``manifest``, ``bytes``), ``registry.referrers_listed``
(``subject``, ``artifact_type``, ``referrers``: how many), ``registry.blob_sources`` (``blob``,
``sources``: bytes per source host, and ``source_urls``), ``registry.mirror_abandoned``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from modelpack.errors import (
    DigestMismatchError,
    MirrorTooSlowError,
    RegistryConnectionError,
    RegistryNotFoundError,
    SizeMismatchError,
)
from modelpack.events import EventLog

if TYPE_CHECKING:
    from modelpack.targets.registry.client import RegistryClient


def failure_kind(exc: BaseException | str) -> str:
    """The short name of why a source was abandoned (see the module docstring)."""
    text = str(exc).lower()
    if isinstance(exc, MirrorTooSlowError) or "too slow" in text:
        return "floor"
    if isinstance(exc, DigestMismatchError) or "digest mismatch" in text or "hash to" in text:
        return "digest_mismatch"
    if isinstance(exc, RegistryNotFoundError) or "404" in text or "unknown" in text:
        return "not_found"
    if isinstance(exc, SizeMismatchError) or "short blob" in text:
        return "short"
    if "connection refused" in text:
        return "connection_refused"
    if "no answer within" in text or "timed out" in text:
        return "stall"
    if isinstance(exc, RegistryConnectionError) or "cannot reach" in text:
        return "connection"
    return "error"


def source_url(host: str, plain_http: bool) -> str:
    """A source as ``scheme://host[:port]`` (hosts here never carry credentials)."""
    return ("http://" if plain_http else "https://") + host


def origin_url(client: RegistryClient) -> str:
    """The origin as ``scheme://host`` without probing it (a loopback origin whose scheme was
    never learned is shown as ``https``)."""
    scheme = client._scheme or ("http" if client.plain_http else "https")
    return f"{scheme}://{client.api_host}"


def emit(events: EventLog | None, name: str, *, source: str, kind: str, **fields: Any) -> None:
    """One source event, when an event log was given (``TargetOptions.extra['events']``)."""
    if events is not None:
        events.emit(name, source=source, source_kind=kind, **fields)


__all__ = ["emit", "failure_kind", "origin_url", "source_url"]
