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
    RegistryConnectionError,
    RegistryNotFoundError,
    SizeMismatchError,
)
from modelpack.events import EventLog

if TYPE_CHECKING:
    from modelpack.targets.registry.client import RegistryClient


def failure_kind(exc: BaseException) -> str:
    """The short name of why a source was abandoned (see the module docstring), from the typed
    error alone: its message holds hosts, ports and digests, whose digits ("…:40447…") are no
    evidence of an HTTP 404."""
    if isinstance(exc, DigestMismatchError):
        return "digest_mismatch"
    if isinstance(exc, SizeMismatchError):
        return "short"
    if isinstance(exc, RegistryConnectionError):
        return exc.failure
    if isinstance(exc, RegistryNotFoundError) or getattr(exc, "status", None) == 404:
        return "not_found"
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
    """One source event, when an event log was given (``TargetOptions.events``)."""
    if events is not None:
        events.emit(name, source=source, source_kind=kind, **fields)


__all__ = ["emit", "failure_kind", "origin_url", "source_url"]
