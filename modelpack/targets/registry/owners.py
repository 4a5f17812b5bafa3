"""Blob owners with bounded load: which peer fills and serves each blob of a manifest first.

With ``MODELPACK_PEER_ORDER=blob`` every node asks each blob first of its *owner*, which fills it
once from the origin (``cache serve --fill``) and serves it to the others through its one link.
Plain rendezvous hashing (the highest ``sha256(digest NUL peer)``) spreads blobs only as evenly as
hashing does: for a model of 16 equal shards on 16 nodes it gave one node four shards (a quarter of
the model, sent 15 times through one link: the storm's p95) and six nodes none.

The assignment here keeps rendezvous as each blob's preference and bounds every owner's load:
blobs by size, largest first (ties by digest), each to the first peer in its rendezvous order
whose assigned bytes stay within ``ceil(total / N)``; when none has room, to the least-loaded peer
(ties in rendezvous order). So no owner carries more than ``ceil(total / N)`` plus the largest
blob, and the assignment is a function of the blob set and the peer set alone — every node
computes the same owners from the same manifest and the same DNS answer, whatever order it lists
them in. A peer that is down is skipped by the reader like any other (the next in the blob's
rendezvous order is asked), so owners do not move while a peer is briefly unreachable.
"""

from __future__ import annotations

from collections.abc import Iterable

from modelpack.oci.descriptor import Descriptor
from modelpack.targets.registry.peers import rendezvous


def balanced_owners(peers: Iterable[str], blobs: Iterable[Descriptor]) -> dict[str, str]:
    """``{blob digest: owner peer}`` for ``blobs`` over ``peers`` (names such as ``host:port``)."""
    names = sorted(set(peers))
    unique = {str(b.digest): b.size for b in blobs}
    if not names or not unique:
        return {}
    share = -(-sum(unique.values()) // len(names))
    load = dict.fromkeys(names, 0)
    owners: dict[str, str] = {}
    for digest, size in sorted(unique.items(), key=lambda item: (-item[1], item[0])):
        ranked = rendezvous(names, digest)
        owner = next((p for p in ranked if load[p] + size <= share), None)
        if owner is None:
            owner = min(ranked, key=lambda p: load[p])  # min keeps the first of equals: rendezvous order
        owners[digest] = owner
        load[owner] += size
    return owners


__all__ = ["balanced_owners"]
