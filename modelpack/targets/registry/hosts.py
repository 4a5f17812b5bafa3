"""Registry host names: which are this machine, and when two names are the same registry.

Loopback hosts may speak plain HTTP and skip proxies. Credentials are bound to one registry
host, so "is this the same registry?" must be answered on canonical names: lower case, the
Docker Hub aliases unified, the HTTPS default port dropped (``REG.example:443`` is
``reg.example``).

Its own module because the HTTP client, the authenticator and the credential binding all ask,
and the client already imports the authenticator.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

DOCKER_HUB = "docker.io"
DOCKER_HUB_ALIASES = frozenset({"docker.io", "index.docker.io", "registry-1.docker.io"})
#: Token services that belong to a registry on another host name, as the registry's operator
#: documents them (Docker Hub answers from registry-1.docker.io and issues tokens from here).
KNOWN_TOKEN_HOSTS = {
    DOCKER_HUB: frozenset({"auth.docker.io"}),
    "registry.gitlab.com": frozenset({"gitlab.com"}),  # GitLab.com's realm is gitlab.com/jwt/auth
}


def _split(host: str) -> tuple[str, str]:
    """``(name, port)`` of ``host`` (``[v6]:port`` understood); port is "" when absent."""
    if host.startswith("["):
        end = host.find("]")
        if end < 0:
            return host[1:], ""
        rest = host[end + 1 :]
        return host[1:end], rest[1:] if rest.startswith(":") else ""
    if host.count(":") == 1:
        name, port = host.split(":", 1)
        return name, port
    return host, ""


def is_loopback_host(host: str) -> bool:
    """``127.0.0.0/8``, ``::1`` and ``localhost``, with or without a port."""
    name, _ = _split(host)
    if name.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def is_loopback_url(url: str) -> bool:
    """Whether ``url`` points at a loopback host (see ``is_loopback_host``)."""
    return is_loopback_host(urlsplit(url).netloc)


def canonical_host(host: str) -> str:
    """The name credentials are keyed and compared by (``Docker.IO`` → ``docker.io``)."""
    raw = host.strip()
    if "://" in raw:
        raw = urlsplit(raw).netloc
    raw = raw.split("/", 1)[0].rsplit("@", 1)[-1]
    name, port = _split(raw)
    name = name.lower().rstrip(".")
    if name in DOCKER_HUB_ALIASES:
        return DOCKER_HUB
    if ":" in name:
        name = f"[{name}]"
    return f"{name}:{port}" if port and port != "443" else name


def host_name(host_or_url: str) -> str:
    """The host name alone (no port, lower case) of a host or a URL."""
    netloc = urlsplit(host_or_url).netloc if "://" in host_or_url else host_or_url
    return _split(netloc.rsplit("@", 1)[-1])[0].lower().rstrip(".")


def same_registry(a: str, b: str) -> bool:
    return canonical_host(a) == canonical_host(b)


def token_host_allowed(registry: str, realm_url: str, trusted: str = "") -> bool:
    """Whether credentials bound to ``registry`` may go to the token service at ``realm_url``:
    the same host name (another port of the same machine is the same operator), a token host
    the registry's operator documents (Docker Hub, GitLab.com), or one the person running the
    command named in ``trusted`` (``MODELPACK_TOKEN_HOSTS``: ``REGISTRY=TOKEN_HOST`` pairs,
    comma or space separated, e.g. a self-hosted GitLab's ``registry.example.com=gitlab.example.com``)."""
    realm_name = host_name(realm_url)
    reg = canonical_host(registry)
    if realm_name == host_name(reg) or realm_name in KNOWN_TOKEN_HOSTS.get(reg, frozenset()):
        return True
    for pair in trusted.replace(",", " ").split():
        named_registry, sep, token_host = pair.partition("=")
        if sep and canonical_host(named_registry) == reg and host_name(token_host) == realm_name:
            return True
    return False
