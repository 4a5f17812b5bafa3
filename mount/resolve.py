"""The one trusted-resolve step: a reference → a digest every entry point may fetch.

Every way in — ``modelpack pull`` into a directory, ``modelpack.pull()``, the KServe storage
initializer, the vLLM load format's checks — asks this step what to fetch, in one order::

    resolve the reference → an index of variants? verify the INDEX signature (policy),
    check its tag against the node's history (rollback), select the entry that fits →
    verify the ENTRY signature (policy) → check a plain manifest's tag against the node's
    history → pinned digest

so options that only shape what is written (a file filter, ``--force``, a destination) can
never skip a check. It is built from the node cache's own pieces: ``mount.variants``'
``resolve_variant`` (index trust and selection), ``modelpack.signing``'s ``verify_artifact``
and ``mount.rollback``'s ``RollbackGuard``/``TagHistory``. The rollback check needs a node
cache (the tag history lives there): with ``cache`` it is made exactly as the cache's own pull
makes it, and ``Pinned.accept`` records the version once the caller has the model, so the bar
only moves when something was actually delivered.

The cache's own pull (``NodeCache.pull``, ``mount.pull.Puller``) makes the same checks from the
same pieces but in its own order, because a hit must stay offline: it reads the trust record of
an earlier verification instead of the registry, and keeps the signature referrers it verified
with for peers (``mount.kept_referrers``). Callers that fill the cache go through it; callers
that write elsewhere go through ``resolve_trusted``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from modelpack.mount.rollback import PendingAcceptance, RollbackGuard
from modelpack.mount.trust import load_policy
from modelpack.mount.variants import ResolvedVariant, resolve_variant

from modelpack.events import EventLog, NullEventLog
from modelpack.oci.reference import Reference, parse_reference
from modelpack.oci.variant_selection import VariantSelector
from modelpack.targets.base import ReadableTarget
from modelpack.targets.opener import TargetOptions, open_readable

if TYPE_CHECKING:
    from modelpack.mount.cache import NodeCache
    from modelpack.signing.keys import PublicKey
    from modelpack.signing.verify import PolicyOrKeys, VerificationResult


@dataclass(frozen=True)
class Pinned:
    """What ``resolve_trusted`` decided: the digest to fetch and why it may be fetched."""

    #: the reference as asked for (a tag stays a tag here: for messages and the policy's globs)
    requested: Reference
    #: the manifest to fetch, pinned by digest in the requested repository (the chosen entry
    #: of an index)
    reference: Reference
    #: the target the checks read from; fetch from it so nothing is resolved twice
    target: ReadableTarget
    #: the index entry taken, when the reference named an index of variants
    variant: ResolvedVariant | None = None
    #: the entry's verification under the policy (None: no policy was given)
    verification: VerificationResult | None = None
    #: the keys the policy trusts for this reference (for a model_signing signature file)
    keys: tuple[PublicKey, ...] = ()
    _pending: tuple[PendingAcceptance, ...] = field(default=(), repr=False, compare=False)

    @property
    def digest(self) -> str:
        assert self.reference.digest is not None
        return str(self.reference.digest)

    @property
    def signed_at(self) -> float | None:
        """The newest signing time among the entry's verified signatures (None: none verified)."""
        return self.verification.signed_at if self.verification is not None else None

    def accept(self) -> None:
        """Record this version as the newest accepted for the tag in the node cache's history
        (only with a cache and a policy, for a tag); call once the model was delivered."""
        for pending in self._pending:
            pending.accept()

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"reference": str(self.requested), "digest": self.digest}
        if self.variant is not None:
            doc["variant"] = self.variant.to_json()
        if self.verification is not None:
            doc["verification"] = self.verification.to_json()
        return doc


def resolve_trusted(
    reference: str | Reference,
    *,
    policy: PolicyOrKeys | str | None,
    selector: VariantSelector | None = None,
    target_options: TargetOptions | None = None,
    target: ReadableTarget | None = None,
    events: EventLog | None = None,
    cache: NodeCache | None = None,
    allow_rollback: bool = False,
) -> Pinned:
    """Verify, select and pin ``reference`` (module docstring); refusals raise the typed errors
    (``SignatureRefused``, ``RollbackRefused``, ``TagHistoryError``, ``VariantSelectionError``)
    after their event was written.

    ``policy`` is a ``TrustPolicy``, keys, or a policy file path; None checks no signature (and so
    no rollback: an unsigned version has no signing time to compare). ``target`` overrides the
    one ``reference`` names (a counting or mirrored target); else it is opened with
    ``target_options`` bound to the reference's registry.
    """
    ref = parse_reference(reference) if isinstance(reference, str) else reference
    log: EventLog = events if events is not None else NullEventLog()
    if target is None:
        target = open_readable(ref, (target_options or TargetOptions()).bound_to(ref))
    pol = load_policy(policy) if policy is not None else None
    guard = RollbackGuard(cache.tags, allow_rollback) if cache is not None and pol is not None else None

    def ev(name: str, **fields: Any) -> None:
        fields.setdefault("reference", str(ref))
        log.emit(name, **fields)

    pending: list[PendingAcceptance] = []
    if pol is not None:
        from modelpack.signing.verify import resolve_to_verify

        desc = resolve_to_verify(target, ref, log)
    else:
        desc = target.resolve(ref.identifier)
    chosen = resolve_variant(ref, selector, policy=pol, events=log, target=target, descriptor=desc)
    if chosen is not None:
        if guard is not None:  # a tag of an index: no index signed before the newest accepted
            pending.append(guard.check(ref, chosen.index_digest, chosen.index_signed_at, ev))
        desc = target.resolve(chosen.selection.digest)
    verification = None
    keys: Sequence[Any] = ()
    if pol is not None:
        from modelpack.signing.verify import resolve_policy, verify_artifact

        verification = verify_artifact(target, ref, desc, pol, events=log)
        keys = resolve_policy(pol, ref).keys
        if guard is not None and chosen is None:
            pending.append(guard.check(ref, str(desc.digest), verification.signed_at, ev))
    pinned = dataclasses.replace(ref, tag=None, digest=desc.digest)
    return Pinned(ref, pinned, target, chosen, verification, tuple(keys), tuple(pending))
