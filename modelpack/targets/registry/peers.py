"""Peers from DNS: ``--mirror dns+http://NAME:PORT`` is every address NAME resolves to.

A headless Kubernetes Service over the ``cache serve`` DaemonSet resolves to one address per
node; each becomes a mirror, ordered per node by rendezvous hashing (highest
``sha256(node id, address)`` first), so each node asks the peers in its own order and the load
of a rollout spreads over all of them, while the order stays stable for a node as peers come
and go (only the blobs of a peer that left move). At most ``MAX_PEERS`` are kept. The node id is
``MODELPACK_NODE_NAME`` (the downward API's ``spec.nodeName``), else the host name; the node's own
address (``MODELPACK_NODE_IP``) is left out — except with ``MODELPACK_PEER_ORDER=blob``, where
each blob is asked first of its owner (rendezvous on the blob digest over *all* peers, the same
on every node, so the owner may be this node's own ``cache serve``, which fills it once from the
origin: ``mount/serve_fill.py``). Resolution is bounded (``RESOLVE_TIMEOUT_S``); a
name that does not resolve in time is no peers (a warning), never a failed pull: the origin
serves. With ``dns+https`` each peer's certificate must name its address.
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import socket
import threading
from urllib.parse import urlsplit

from modelpack import settings
from modelpack.errors import MirrorConfigError

log = logging.getLogger("modelpack.targets.registry")

MAX_PEERS = 8
#: with blob order every node must see the same peer set, or owners differ between nodes
MAX_BLOB_ORDER_PEERS = 64
RESOLVE_TIMEOUT_S = 5.0
PREFIX = "dns+"


def blob_order() -> bool:
    """``MODELPACK_PEER_ORDER=blob``: peers ranked per blob (owner first), not per node."""
    return settings.PEER_ORDER.get() == "blob"


def node_id() -> str:
    return settings.NODE_NAME.get() or socket.gethostname()


def rendezvous(addresses: list[str], node: str) -> list[str]:
    """``addresses`` in this node's order: highest ``sha256(node NUL address)`` first."""
    return sorted(
        set(addresses), key=lambda a: hashlib.sha256(f"{node}\0{a}".encode()).digest(), reverse=True
    )


def resolve_all(name: str, port: int, timeout: float = RESOLVE_TIMEOUT_S) -> list[str]:
    """Every address ``name`` resolves to (TCP), or [] when it does not within ``timeout``."""
    found: list[str] = []
    failure: list[BaseException] = []

    def work() -> None:
        try:
            infos = socket.getaddrinfo(name, port, type=socket.SOCK_STREAM)
            found.extend(str(info[4][0]) for info in infos)
        except OSError as exc:
            failure.append(exc)

    t = threading.Thread(target=work, name="modelpack-peer-dns", daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive() or failure:
        why = f"no answer within {timeout:g} s" if t.is_alive() else str(failure[0])
        log.warning("peers %s: cannot resolve (%s); no peers this time", name, why)
        return []
    return list(dict.fromkeys(found))


def expand_peer_urls(urls: list[str], *, node: str | None = None) -> list[str]:
    """``dns+http(s)://NAME:PORT`` entries replaced by one URL per address, in this node's order."""
    out: list[str] = []
    for url in urls:
        if not url.startswith(PREFIX):
            out.append(url)
            continue
        parts = urlsplit(url[len(PREFIX) :])
        if (
            parts.scheme not in ("http", "https")
            or not parts.hostname
            or parts.path.rstrip("/") not in ("", "/v2")
        ):
            raise MirrorConfigError(f"peers {url!r} is not dns+http(s)://NAME[:PORT]", target="--mirror")
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError:
            raise MirrorConfigError(f"peers {url!r}: bad port", target="--mirror") from None
        own = "" if blob_order() else settings.NODE_IP.get()
        addresses = [a for a in resolve_all(parts.hostname, port) if a != own]
        limit = MAX_BLOB_ORDER_PEERS if blob_order() else MAX_PEERS
        for addr in rendezvous(addresses, node or node_id())[:limit]:
            shown = f"[{addr}]" if isinstance(ipaddress.ip_address(addr), ipaddress.IPv6Address) else addr
            out.append(f"{parts.scheme}://{shown}:{port}")
    return out


__all__ = ["MAX_PEERS", "blob_order", "expand_peer_urls", "node_id", "rendezvous", "resolve_all"]
