"""Referrer listings from mirrors and peers, when the origin cannot be reached.

Why: a pinned start under a signature policy needs the model's signature referrers; with the
origin down, the peers (``modelpack cache serve``, which answers the referrers API from the
signatures its cache verified) are the only ones left who have them.

A listing cannot be verified (it is not content addressed), so it is only a list of digests to
try: every referrer manifest is then fetched by digest and verified, its bundle blob too, and the
signature checked with the caller's own keys. So a peer can withhold a signature (list nothing,
or junk) but never forge one. To make withholding by one peer harmless when another has the
signatures, every usable mirror is asked and their listings are merged (deduplicated by digest,
at most ``MAX_MERGED`` entries, each listing bounded to 4 MiB and parsed as a strict OCI index by
``ManifestStore.referrers``). When no mirror answers at all, the origin's connection error is
raised; when mirrors answer with nothing, the listing is empty and the policy decides (an
unsigned model under a policy that requires a signature is refused, naming the digest).
"""

from __future__ import annotations

from typing import Any

from modelpack.errors import ModelpackError, RegistryConnectionError, TransferInterrupted
from modelpack.events import EventLog
from modelpack.oci.descriptor import Descriptor
from modelpack.targets.registry.manifests import ManifestStore
from modelpack.targets.registry.source_events import emit

#: entries of the merged listing at most (each costs a manifest and a blob fetch)
MAX_MERGED = 1000


def mirror_referrers(
    mirrors: Any,
    stores: list[tuple[str, ManifestStore]],
    subject: Descriptor,
    artifact_type: str | None,
    origin_error: RegistryConnectionError | None,
    events: EventLog | None,
) -> list[Descriptor]:
    """The merged referrer listings of every usable mirror (see the module docstring)."""
    merged: dict[str, Descriptor] = {}
    answered = 0
    for name, store in stores:
        if not mirrors.usable(name):
            continue
        try:
            listed = store.referrers(subject, artifact_type)
        except TransferInterrupted:
            raise
        except ModelpackError as exc:
            mirrors.manifest_abandoned(name, f"referrers of {subject.digest}", exc)
            continue
        answered += 1
        emit(
            events,
            "registry.referrers_listed",
            source=mirrors.url_of(name),
            kind="mirror",
            subject=str(subject.digest),
            artifact_type=artifact_type,
            referrers=len(listed),
        )
        for desc in listed:
            if len(merged) >= MAX_MERGED:
                break
            merged.setdefault(str(desc.digest), desc)
    if not answered and origin_error is not None:
        raise origin_error
    return list(merged.values())


__all__ = ["MAX_MERGED", "mirror_referrers"]
