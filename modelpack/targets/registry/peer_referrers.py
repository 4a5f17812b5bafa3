"""Referrer listings from mirrors and peers, when the origin cannot be reached.

Why: a pinned start under a signature policy needs the model's signature referrers; with the
origin down, the peers (``modelpack cache serve``, which answers the referrers API from the
signatures its cache verified) are the only ones left who have them.

A listing cannot be verified (it is not content addressed), so it is only a list of digests to
try: every referrer manifest is then fetched by digest and verified, its bundle blob too, and the
signature checked with the caller's own keys. So a peer can withhold a signature (list nothing,
or junk) but never forge one. To make withholding by one peer harmless when another has the
signatures, every usable mirror is asked and their listings are merged fairly, so that one peer
listing junk hides nobody else's entries and costs a bounded time:

- only entries that can match what the caller looks for are kept: of the ``artifact_type`` asked
  for (none untyped), or, when the caller asks for every type, those that name a type;
- each peer contributes at most ``PER_PEER`` of them (its first, duplicates dropped), and the
  merge takes them in turn, one from each peer, deduplicated by digest across peers, at most
  ``MAX_MERGED`` in all: every fetch a junk entry costs is bounded by ``PER_PEER`` per peer;
- the peers are asked within ``LISTING_BUDGET_S`` for all listings of one target: a peer that
  answers slowly spends everyone's time only once, and the peers not asked by then are skipped
  (each listing is still bounded to 4 MiB and parsed as a strict OCI index by
  ``ManifestStore.referrers``).

When no mirror answers at all, the origin's connection error is raised; when mirrors answer with
nothing, the listing is empty and the policy decides (an unsigned model under a policy that
requires a signature is refused, naming the digest).
"""

from __future__ import annotations

import time
from typing import Any

from modelpack.errors import ModelpackError, RegistryConnectionError, TransferInterrupted
from modelpack.events import EventLog
from modelpack.oci.descriptor import Descriptor
from modelpack.targets.registry.manifests import ManifestStore
from modelpack.targets.registry.source_events import emit

#: entries of the merged listing at most (each costs a manifest and a blob fetch)
MAX_MERGED = 64
#: entries one peer's listing contributes at most (signatures by several keys, re-signings)
PER_PEER = 8
#: seconds spent asking peers for listings, over every listing of one target
LISTING_BUDGET_S = 15.0


class ListingClock:
    """The time left for peer listings of one target (``LISTING_BUDGET_S`` from the first)."""

    def __init__(self, budget_s: float = LISTING_BUDGET_S) -> None:
        self.budget_s = budget_s
        self._deadline: float | None = None

    def start(self) -> None:
        if self._deadline is None:
            self._deadline = time.monotonic() + self.budget_s

    def spent(self) -> bool:
        return self._deadline is not None and time.monotonic() >= self._deadline


def _usable_entries(listed: list[Descriptor], artifact_type: str | None) -> list[Descriptor]:
    """A peer's entries that can match (see the module docstring), deduplicated, its first
    ``PER_PEER``."""
    out: dict[str, Descriptor] = {}
    for desc in listed:
        kind = desc.artifact_type
        if kind is None or (artifact_type is not None and kind != artifact_type):
            continue
        out.setdefault(str(desc.digest), desc)
        if len(out) >= PER_PEER:
            break
    return list(out.values())


def fair_merge(listings: list[list[Descriptor]], limit: int = MAX_MERGED) -> list[Descriptor]:
    """One entry from each listing in turn, deduplicated by digest, at most ``limit``."""
    merged: dict[str, Descriptor] = {}
    depth = max((len(x) for x in listings), default=0)
    for i in range(depth):
        for listing in listings:
            if i < len(listing) and len(merged) < limit:
                merged.setdefault(str(listing[i].digest), listing[i])
    return list(merged.values())


def mirror_referrers(
    mirrors: Any,
    stores: list[tuple[str, ManifestStore]],
    subject: Descriptor,
    artifact_type: str | None,
    origin_error: RegistryConnectionError | None,
    events: EventLog | None,
    clock: ListingClock | None = None,
) -> list[Descriptor]:
    """The fairly merged referrer listings of every usable mirror (see the module docstring)."""
    clock = clock or ListingClock()
    clock.start()
    listings: list[list[Descriptor]] = []
    answered = 0
    for name, store in stores:
        if not mirrors.usable(name):
            continue
        if clock.spent():
            mirrors.manifest_abandoned(
                name,
                f"referrers of {subject.digest}",
                TimeoutError(f"peer listings took their {clock.budget_s:g} s; not asked"),
            )
            continue
        try:
            listed = store.referrers(subject, artifact_type)
        except TransferInterrupted:
            raise
        except ModelpackError as exc:
            mirrors.manifest_abandoned(name, f"referrers of {subject.digest}", exc)
            continue
        answered += 1
        kept = _usable_entries(listed, artifact_type)
        emit(
            events,
            "registry.referrers_listed",
            source=mirrors.url_of(name),
            kind="mirror",
            subject=str(subject.digest),
            artifact_type=artifact_type,
            referrers=len(listed),
            kept=len(kept),
        )
        listings.append(kept)
    if not answered and origin_error is not None:
        raise origin_error
    return fair_merge(listings)


__all__ = ["LISTING_BUDGET_S", "MAX_MERGED", "PER_PEER", "ListingClock", "fair_merge", "mirror_referrers"]
