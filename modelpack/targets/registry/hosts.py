"""Whether a registry host is this machine: loopback hosts may speak plain HTTP and skip proxies.

Its own module because both the HTTP client (scheme and proxy choice) and the authenticator
(accepting a plain-HTTP token realm) ask, and the client already imports the authenticator.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit


def is_loopback_host(host: str) -> bool:
    """``127.0.0.0/8``, ``::1`` and ``localhost``, with or without a port."""
    name = host
    if name.startswith("["):
        name = name[1 : name.index("]")] if "]" in name else name[1:]
    elif name.count(":") == 1:
        name = name.split(":", 1)[0]
    if name.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def is_loopback_url(url: str) -> bool:
    """Whether ``url`` points at a loopback host (see ``is_loopback_host``)."""
    return is_loopback_host(urlsplit(url).netloc)
