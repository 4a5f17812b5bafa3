"""Where the mirrors are and how strict to be with them: ``--mirror``, ``MODELPACK_MIRRORS``,
containerd's ``hosts.toml`` and the stall / throughput-floor limits (split from ``mirrors``,
which reads blobs through them; behaviour unchanged).

``<hosts dir>/<host[:port]>/hosts.toml`` (``--hosts-dir`` / ``MODELPACK_HOSTS_DIR``, default
``/etc/containerd/certs.d``): ``[host."URL"]`` tables with the ``pull`` capability, in file
order, after the ``--mirror URL`` entries; a ``dns+`` URL is one mirror per address
(``peers``). Every file is bounded (1 MiB) and every error names the file or variable.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from modelpack.errors import MirrorConfigError
from modelpack.targets.options import MirrorThresholds
from modelpack.targets.registry.blob_reads import Floor
from modelpack.targets.registry.hosts import canonical_host
from modelpack.targets.registry.peers import PREFIX, expand_peer_urls

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

DEFAULT_HOSTS_DIR = "/etc/containerd/certs.d"
#: no byte from a mirror for this long is a stall (its client's read timeout)
MIRROR_STALL_S = 10.0
#: a mirror must deliver at least this many bytes per second (``MODELPACK_MIRROR_MIN_RATE``)…
MIRROR_MIN_RATE = 256 * 1024
#: …over each window of this many seconds (``MODELPACK_MIRROR_RATE_WINDOW``)
MIRROR_RATE_WINDOW_S = 10.0
MAX_HOSTS_TOML = 1024 * 1024


@dataclass(frozen=True)
class MirrorEndpoint:
    """One mirror: where it is and how to talk to it (from ``--mirror`` or a ``hosts.toml``)."""

    host: str
    plain_http: bool = False
    ca_file: str | None = None
    skip_verify: bool = False
    #: sent with every request to this mirror (hosts.toml ``header``; the peer token): never shown
    headers: Mapping[str, str] = field(default_factory=dict, repr=False)
    origin: str = ""  # where it was configured: "--mirror", or the hosts.toml path
    peer: bool = False  # one of the addresses of a ``dns+`` peers name

    @property
    def url(self) -> str:
        return ("http://" if self.plain_http else "https://") + self.host


def parse_mirror_url(url: str, *, origin: str = "--mirror", **settings: Any) -> MirrorEndpoint:
    """``http://host:port``, ``https://host[/v2]`` or a bare ``host[:port]`` (HTTPS, or either for a
    loopback host). A path prefix other than ``/v2`` cannot be addressed and is refused."""
    text = url.strip()
    parts = urlsplit(text if "://" in text else "https://" + text)
    if parts.scheme not in ("http", "https") or not parts.netloc or "@" in parts.netloc:
        raise MirrorConfigError(f"mirror {url!r} is not an http(s)://host[:port] URL", target=origin)
    if parts.path.rstrip("/") not in ("", "/v2") or parts.query:
        raise MirrorConfigError(
            f"mirror {url!r} has a path prefix; only http(s)://host[:port] mirrors are supported",
            target=origin,
        )
    return MirrorEndpoint(host=parts.netloc, plain_http=parts.scheme == "http", origin=origin, **settings)


def hosts_toml_mirrors(hosts_dir: str, registry: str) -> list[MirrorEndpoint]:
    """The pull mirrors ``<hosts_dir>/<registry>/hosts.toml`` lists, in order (else ``_default``'s).

    Hosts without the ``pull`` capability (containerd's default is pull, resolve and push) are
    skipped; ``server`` is ignored: the origin is the registry the reference names."""
    names = [registry, canonical_host(registry), "_default"]
    for name in dict.fromkeys(names):
        path = os.path.join(hosts_dir, name, "hosts.toml")
        try:
            with open(path, "rb") as f:
                raw = f.read(MAX_HOSTS_TOML + 1)
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise MirrorConfigError(f"cannot read: {exc.strerror}", target=path) from None
        if len(raw) > MAX_HOSTS_TOML:
            raise MirrorConfigError("larger than 1 MiB", target=path)
        return _parse_hosts_toml(raw, path)
    return []


def _parse_hosts_toml(raw: bytes, path: str) -> list[MirrorEndpoint]:
    try:
        doc = tomllib.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise MirrorConfigError(f"not valid TOML: {exc}", target=path) from None
    hosts = doc.get("host", {})
    if not isinstance(hosts, dict):
        raise MirrorConfigError("[host] must be a table of URL → settings", target=path)
    out = []
    for url, cfg in hosts.items():
        if not isinstance(cfg, dict):
            raise MirrorConfigError(f"host {url!r} must be a table", target=path)
        caps = cfg.get("capabilities", ["pull", "resolve", "push"])
        if not isinstance(caps, list) or "pull" not in caps:
            continue
        if cfg.get("override_path"):
            raise MirrorConfigError(f"host {url!r}: override_path is not supported", target=path)
        ca = cfg.get("ca")
        if isinstance(ca, list):
            ca = ca[0] if ca else None
        headers: dict[str, str] = {}
        for key, value in (cfg.get("header") or {}).items():
            values = value if isinstance(value, list) else [value]
            headers[str(key)] = ", ".join(str(v) for v in values)
        out.append(
            parse_mirror_url(
                url,
                origin=path,
                ca_file=str(ca) if ca else None,
                skip_verify=bool(cfg.get("skip_verify", False)),
                headers=headers,
            )
        )
    return out


def mirror_limits(thresholds: MirrorThresholds | None = None) -> tuple[float, Floor | None]:
    """(stall seconds, throughput floor) from ``TargetOptions.mirror_thresholds`` (filled from
    ``MODELPACK_MIRROR_STALL``, ``MODELPACK_MIRROR_MIN_RATE`` (bytes/s; 0 turns the floor off) and
    ``MODELPACK_MIRROR_RATE_WINDOW`` by ``TargetOptions.from_environ``); None fields: the defaults."""
    t = thresholds or MirrorThresholds()
    for name, value in (("stall_s", t.stall_s), ("min_rate", t.min_rate), ("rate_window_s", t.rate_window_s)):
        if value is not None and not value >= 0:  # NaN too
            raise MirrorConfigError(
                f"mirror threshold {name} must not be negative, got {value!r}", target=name
            )
    stall = t.stall_s or MIRROR_STALL_S
    rate = MIRROR_MIN_RATE if t.min_rate is None else t.min_rate
    window = MIRROR_RATE_WINDOW_S if t.rate_window_s is None else t.rate_window_s
    return stall, (Floor(rate, window) if rate > 0 and window > 0 else None)


def configured_mirrors(
    registry: str, mirrors: list[str] | None, hosts_dir: str | None, *, peer_token: str | None = None
) -> list[MirrorEndpoint]:
    """``mirrors`` (``--mirror``, else ``MODELPACK_MIRRORS`` through ``TargetOptions.from_environ``)
    first, then the hosts.toml of ``registry`` in ``hosts_dir`` (default ``/etc/containerd/certs.d``);
    a mirror that is the registry itself is dropped (it would be asked twice).

    ``peer_token`` (``MODELPACK_PEER_TOKEN``) is presented as ``Authorization: Bearer`` to the
    ``mirrors`` entries (each address of a ``dns+`` name too), the peers' ``cache serve``; never to
    a hosts.toml mirror (its ``header`` table says what it gets), never to the origin registry
    (its client never has this header) and never to a host a mirror redirects to (``requests``
    drops the header when a redirect leaves the mirror's host and port)."""
    urls = list(mirrors or [])
    if peer_token is not None and not peer_token.strip():
        raise MirrorConfigError("the peer token is empty; an empty token is never 'no token'", target="peers")
    auth = {"Authorization": f"Bearer {peer_token.strip()}"} if peer_token else {}
    found = [
        parse_mirror_url(u, origin="--mirror", peer=url.startswith(PREFIX), headers=auth)
        for url in urls
        for u in expand_peer_urls([url])
    ]
    directory = hosts_dir or DEFAULT_HOSTS_DIR
    found += hosts_toml_mirrors(directory, registry)
    own = canonical_host(registry)
    seen: set[str] = set()
    out = []
    for m in found:
        key = canonical_host(m.host)
        if key != own and key not in seen:
            seen.add(key)
            out.append(m)
    return out


__all__ = [
    "DEFAULT_HOSTS_DIR",
    "MIRROR_MIN_RATE",
    "MIRROR_RATE_WINDOW_S",
    "MIRROR_STALL_S",
    "MirrorEndpoint",
    "configured_mirrors",
    "hosts_toml_mirrors",
    "mirror_limits",
    "parse_mirror_url",
]
