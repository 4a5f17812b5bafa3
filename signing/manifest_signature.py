"""The manifest signature: a cosign-compatible DSSE bundle over the manifest digest, as a referrer.

``cosign verify --key pub.pem --insecure-ignore-tlog --new-bundle-format`` finds it through the
referrers API (or the ``sha256-<hex>`` tag-schema index) by ``artifactType
application/vnd.dev.sigstore.bundle.v0.3+json``, and checks that the in-toto subject is the image
digest. We check exactly the same, plus that the predicate type is cosign's signature predicate.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from modelpack.signing.bundle import sign_statement
from modelpack.signing.keyless_trust import KeylessTrust
from modelpack.signing.keys import PrivateKey, PublicKey
from modelpack.signing.referrers import (
    ARTIFACT_TYPE_SIGNATURE,
    StoredBundle,
    confirm_referrers,
    find_bundle_referrers,
    push_bundle_referrer,
    skipped,
)
from modelpack.signing.signature_state import SignatureState
from modelpack.signing.signing_time import format_signing_time, signing_time_now
from modelpack.signing.statements import PREDICATE_COSIGN_SIGN, Statement, manifest_statement

from modelpack.errors import BundleError
from modelpack.events import EventLog, NullEventLog
from modelpack.oci.descriptor import Descriptor
from modelpack.targets.base import ReadableTarget, Target


def sign_manifest(
    target: Target,
    manifest_desc: Descriptor,
    private_key: PrivateKey,
    *,
    confirm: bool = True,
    signed_at: str | None = None,
) -> Descriptor:
    """Push the signature referrer; with ``confirm`` (the default) return only once it is listed
    among the manifest's referrers (``SigningError`` otherwise). ``sign_artifact`` confirms all
    its referrers together instead. The statement carries ``signed_at`` (RFC 3339 UTC; default:
    now) as its signing time (``signing_time``)."""
    statement = manifest_statement(manifest_desc.digest.hex, signed_at=signed_at or signing_time_now())
    bundle = sign_statement(statement, private_key)
    started = time.monotonic()
    desc = push_bundle_referrer(
        target,
        manifest_desc,
        bundle,
        artifact_type=ARTIFACT_TYPE_SIGNATURE,
        predicate_type=PREDICATE_COSIGN_SIGN,
    )
    if confirm:
        confirm_referrers(target, manifest_desc, [desc], write_seconds=time.monotonic() - started)
    return desc


@dataclass(frozen=True)
class SignatureCheck:
    """The outcome for one signature referrer. ``status``: a ``SignatureState`` (verified |
    untrusted | invalid), the words every command uses.
    ``signed_at``: the signed statement's signing time (seconds; 0 when untimed), known only for
    a verified signature."""

    referrer: str
    kind: str
    status: SignatureState
    key_id: str = ""
    reason: str = ""
    signed_at: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "referrer": self.referrer,
            "kind": self.kind,
            "status": self.status,
            "keyId": self.key_id,
            "reason": self.reason,
            "signedAt": format_signed_at(self.signed_at),
        }


def format_signed_at(seconds: float | None) -> str | None:
    """RFC 3339 for JSON output; None when unknown or untimed."""
    return format_signing_time(seconds) if seconds else None


def check_stored_signature(
    item: StoredBundle,
    manifest_desc: Descriptor,
    keys: list[PublicKey],
    *,
    kind: str = "manifest",
    keyless: KeylessTrust | None = None,
) -> SignatureCheck:
    """A key-signed bundle is checked against ``keys``; a keyless one (a Sigstore certificate)
    against ``keyless``, the identities the policy trusts. Either way the statement must then be
    cosign's signature predicate over exactly this manifest digest."""
    ref = str(item.descriptor.digest)
    if item.bundle is None:
        return SignatureCheck(ref, kind, SignatureState.INVALID, reason=item.error)
    if item.bundle.keyless:
        if keyless is None:
            return SignatureCheck(
                ref,
                kind,
                SignatureState.UNTRUSTED,
                reason=f"signature {ref[:19]} is keyless and the policy trusts no identity",
            )
        outcome = keyless.check(item.bundle.raw, source=f"signature {ref[:19]}")
        if outcome.identity is None:
            return SignatureCheck(ref, kind, SignatureState.UNTRUSTED, reason=outcome.reason)
        signer_id = outcome.identity.id
        try:
            st = Statement.from_bytes(outcome.payload)  # the payload sigstore verified
        except BundleError as exc:
            return SignatureCheck(
                ref, kind, SignatureState.INVALID, signer_id, f"signature {ref[:19]}: {exc}"
            )
    else:
        signer = item.bundle.verify(keys)
        if signer is None:
            hint = item.bundle.key_hint
            return SignatureCheck(
                ref,
                kind,
                SignatureState.UNTRUSTED,
                key_id=hint,
                reason=f"signature {ref[:19]} is not by a trusted key (key hint {hint[:16] or 'none'})",
            )
        signer_id = signer.key_id
        try:
            st = item.bundle.statement
        except BundleError as exc:
            return SignatureCheck(
                ref, kind, SignatureState.INVALID, signer_id, f"signature {ref[:19]}: {exc}"
            )
    if st.predicate_type != PREDICATE_COSIGN_SIGN:
        return SignatureCheck(
            ref,
            kind,
            SignatureState.INVALID,
            signer_id,
            f"signature {ref[:19]}: predicateType {st.predicate_type!r}",
        )
    subjects = st.subject_sha256
    if subjects != [manifest_desc.digest.hex]:
        shown = ", ".join(f"sha256:{s}" for s in subjects)
        return SignatureCheck(
            ref,
            kind,
            SignatureState.INVALID,
            signer_id,
            f"signature {ref[:19]} is for {shown}, not for {manifest_desc.digest} (replayed signature)",
        )
    try:
        signed_at = st.signed_at
    except BundleError as exc:
        return SignatureCheck(ref, kind, SignatureState.INVALID, signer_id, f"signature {ref[:19]}: {exc}")
    return SignatureCheck(ref, kind, SignatureState.VERIFIED, signer_id, signed_at=signed_at)


def check_manifest_signatures(
    target: ReadableTarget,
    manifest_desc: Descriptor,
    keys: list[PublicKey],
    *,
    events: EventLog | None = None,
    keyless: KeylessTrust | None = None,
) -> list[SignatureCheck]:
    """One check per signature referrer; each invalid one is also a ``signing.referrer_skipped``
    event (the unreadable ones are reported while they are read)."""
    events = events or NullEventLog()
    checks = []
    for item in find_bundle_referrers(target, manifest_desc, ARTIFACT_TYPE_SIGNATURE, events=events):
        check = check_stored_signature(item, manifest_desc, keys, keyless=keyless)
        if check.status == SignatureState.INVALID and item.bundle is not None:
            skipped(events, manifest_desc, item, check.reason)
        checks.append(check)
    return checks
