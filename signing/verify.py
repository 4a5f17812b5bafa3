"""Verification: signatures, exact subject binding, directory contents, and the policy decision.

Every refusal raises ``SignatureRefused`` (or ``DirectorySignatureError``) and first writes a
``signing.refused`` event with the reference, digest and reason; a success writes
``signing.verified``. The node cache and pull call ``verify_artifact`` before anything is marked
ready.

A referrer that cannot be used (unreadable, too deep, not an in-toto DSSE envelope, a statement
of the wrong type or subject) is reported as a ``signing.referrer_skipped`` event and never hides
a valid signature next to it; when no valid one remains, the refusal lists why each was skipped.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from modelpack.signing.bundle import MAX_BUNDLE_BYTES, Bundle
from modelpack.signing.keys import PublicKey
from modelpack.signing.manifest_signature import (
    SignatureCheck,
    check_manifest_signatures,
    format_signed_at,
)
from modelpack.signing.model_signing import (
    GIT_PATHS,
    compare_files,
    files_from_manifest,
    hash_directory,
    statement_files,
    statement_ignore_paths,
)
from modelpack.signing.policy import RepositoryPolicy, TrustPolicy
from modelpack.signing.referrers import (
    ARTIFACT_TYPE_MODEL_SIGNATURE,
    find_bundle_referrers,
    skipped,
)
from modelpack.signing.signature_state import overall

from modelpack.errors import BundleError, DirectorySignatureError, ModelpackError, SignatureRefused
from modelpack.events import EventLog, NullEventLog
from modelpack.oci.descriptor import Descriptor, Manifest, parse_manifest_or_index
from modelpack.oci.digest import verify_bytes
from modelpack.oci.reference import Reference, parse_reference
from modelpack.targets.base import ChunkCheckedSpools, ReadableTarget
from modelpack.targets.options import TargetOptions

PolicyOrKeys = TrustPolicy | RepositoryPolicy | PublicKey | Sequence[PublicKey]


@dataclass
class VerificationResult:
    reference: str
    digest: str
    allowed: bool
    status: str  # a SignatureState: verified | untrusted | invalid | unsigned
    reason: str
    key_ids: list[str] = field(default_factory=list)
    signatures: list[SignatureCheck] = field(default_factory=list)
    directory_signature: str = "absent"  # verified | absent | invalid
    chunk_table: str = "absent"  # verified | absent | invalid
    rule: str = ""

    @property
    def verified(self) -> bool:
        return self.status == "verified"

    @property
    def signed_times(self) -> dict[str, float]:
        """Per trusted key id, the newest signing time of its verified signatures (0: untimed)."""
        out: dict[str, float] = {}
        for c in self.signatures:
            if c.status == "verified":
                out[c.key_id] = max(out.get(c.key_id, 0.0), c.signed_at or 0.0)
        return out

    @property
    def signed_at(self) -> float | None:
        """The newest signing time among the verified signatures (0: none carries one); None
        when no signature was verified."""
        times = self.signed_times
        return max(times.values()) if times else None

    def to_json(self) -> dict[str, Any]:
        return {
            "reference": self.reference,
            "digest": self.digest,
            "allowed": self.allowed,
            "status": self.status,
            "reason": self.reason,
            "keyIds": list(self.key_ids),
            "signatures": [s.to_json() for s in self.signatures],
            "directorySignature": self.directory_signature,
            "chunkTable": self.chunk_table,
            "rule": self.rule,
            "signedAt": format_signed_at(self.signed_at),
        }


def resolve_policy(policy_or_keys: PolicyOrKeys, reference: Reference | str | None) -> RepositoryPolicy:
    if isinstance(policy_or_keys, RepositoryPolicy):
        return policy_or_keys
    if isinstance(policy_or_keys, TrustPolicy):
        if reference is None:
            return policy_or_keys.default
        return policy_or_keys.for_reference(reference)
    if isinstance(policy_or_keys, PublicKey):
        return RepositoryPolicy((policy_or_keys,), True, rule="--key")
    return RepositoryPolicy(tuple(policy_or_keys), True, rule="--key")


def _refuse(
    events: EventLog, reference: str, digest: str, reason: str, *, cls: type = SignatureRefused, **extra: Any
) -> SignatureRefused:
    events.emit("signing.refused", reference=reference, digest=digest, reason=reason, **extra)
    err: SignatureRefused = cls(reference, digest, reason)
    return err


def verify_artifact(
    target: ReadableTarget,
    reference: Reference | str | None,
    manifest_desc: Descriptor,
    policy_or_keys: PolicyOrKeys,
    *,
    events: EventLog | None = None,
) -> VerificationResult:
    """Verify the artifact at ``manifest_desc`` against a policy (or a set of trusted keys).

    The manifest bytes are re-fetched by digest and hashed: the digest checked is the one in use.
    Raises ``SignatureRefused`` when the policy says no.
    """
    events = events or NullEventLog()
    ref_text = str(reference) if reference is not None else f"{target.name}@{manifest_desc.digest}"
    ref_obj = parse_reference(reference) if isinstance(reference, str) else reference
    policy = resolve_policy(policy_or_keys, ref_obj)
    digest = str(manifest_desc.digest)
    try:
        raw, media_type = target.fetch_manifest(digest)
        verify_bytes(
            raw, manifest_desc.digest, manifest_desc.size or None, what="manifest", source=target.name
        )
        parsed = parse_manifest_or_index(raw, media_type)
    except ModelpackError as exc:
        raise _refuse(
            events, ref_text, digest, f"manifest cannot be verified: {exc}", rule=policy.rule
        ) from exc
    keys = list(policy.keys)
    manifest = parsed if isinstance(parsed, Manifest) else None
    # the three referrer lookups (signatures, directory signature, chunk table) are independent
    # round trips: asked at once, a start waits for the slowest, not for their sum; the extras are
    # only looked at once the signatures allowed the artifact
    extras = (
        ThreadPoolExecutor(max_workers=2, thread_name_prefix="modelpack-verify")
        if keys and manifest
        else None
    )
    try:
        if extras is not None and manifest is not None:
            directory = extras.submit(
                _check_directory_signature, target, manifest_desc, manifest, keys, events
            )
            table = extras.submit(_check_chunk_table, target, manifest_desc, manifest, keys, events)
        try:
            checks = check_manifest_signatures(
                target, manifest_desc, keys, events=events, keyless=policy.keyless
            )
        except ModelpackError as exc:
            raise _refuse(
                events, ref_text, digest, f"signatures cannot be read: {exc}", rule=policy.rule
            ) from exc
        result = _decide(events, ref_text, digest, policy, checks)
        if extras is not None:
            result.directory_signature = directory.result()
            result.chunk_table = table.result()
    finally:
        if extras is not None:
            extras.shutdown(wait=True, cancel_futures=True)
    if manifest is None:
        result.directory_signature = result.chunk_table = "not-applicable (index)"
    elif policy.require_directory_signature and result.directory_signature != "verified":
        reason = f"directory signature {result.directory_signature}; rule {policy.rule} requires one"
        raise _refuse(events, ref_text, digest, reason, rule=policy.rule)
    if manifest is not None and policy.require_chunk_table and result.chunk_table != "verified":
        reason = f"chunk table {result.chunk_table}; rule {policy.rule} requires one"
        raise _refuse(events, ref_text, digest, reason, rule=policy.rule)
    events.emit(
        "signing.verified",
        reference=ref_text,
        digest=digest,
        status=result.status,
        key_ids=result.key_ids,
        rule=policy.rule,
        reason=None if result.key_ids else result.reason,
    )
    return result


def _decide(
    events: EventLog, ref_text: str, digest: str, policy: RepositoryPolicy, checks: list[SignatureCheck]
) -> VerificationResult:
    """The policy's verdict on the signature checks; a refusal is raised."""
    verified = [c.key_id for c in checks if c.status == "verified"]
    problems = [c.reason for c in checks if c.status != "verified"]
    decision = policy.decide(verified, problems)
    status = overall(c.status for c in checks)
    if not decision.allowed:
        raise _refuse(events, ref_text, digest, decision.reason, rule=policy.rule, key_ids=policy.key_ids)
    return VerificationResult(
        ref_text, digest, decision.allowed, status, decision.reason, verified, checks, rule=policy.rule
    )


def verify_reference(
    reference: Reference | str,
    policy_or_keys: PolicyOrKeys,
    target_options: TargetOptions | None = None,
    *,
    events: EventLog | None = None,
) -> tuple[ReadableTarget, Descriptor, VerificationResult]:
    """Open, resolve and verify ``reference``. A tag that resolves to bytes not matching their
    digest (tampered storage) is a refusal with an event too, not a bare transport error."""
    from modelpack.targets.opener import open_readable

    events = events or NullEventLog()
    ref = parse_reference(reference) if isinstance(reference, str) else reference
    target = open_readable(ref, target_options)
    desc = resolve_to_verify(target, ref, events)
    return target, desc, verify_artifact(target, ref, desc, policy_or_keys, events=events)


def resolve_to_verify(target: ReadableTarget, ref: Reference, events: EventLog | None = None) -> Descriptor:
    """``target.resolve(ref)`` for a verification: a tag that resolves to bytes not matching
    their digest (tampered storage) is a refusal with an event too, not a bare transport error."""
    from modelpack.errors import DigestMismatchError, ManifestError, SizeMismatchError

    try:
        return target.resolve(ref.identifier)
    except (DigestMismatchError, SizeMismatchError, ManifestError) as exc:
        raise _refuse(
            events or NullEventLog(), str(ref), ref.digest or "", f"manifest cannot be verified: {exc}"
        ) from exc


def _check_directory_signature(
    target: ReadableTarget,
    manifest_desc: Descriptor,
    manifest: Manifest,
    keys: list[PublicKey],
    events: EventLog,
) -> str:
    try:
        stored = find_bundle_referrers(target, manifest_desc, ARTIFACT_TYPE_MODEL_SIGNATURE, events=events)
    except ModelpackError:
        return "invalid"
    if not stored:
        return "absent"
    found = False
    for item in stored:
        if item.bundle is None:
            continue  # reported by find_bundle_referrers
        if select_directory_bundle([item.bundle], manifest, keys) is not None:
            found = True
        elif item.bundle.verify(keys) is not None:
            skipped(events, manifest_desc, item, "directory signature does not match the manifest's files")
    return "verified" if found else "invalid"


def _check_chunk_table(
    target: ReadableTarget,
    manifest_desc: Descriptor,
    manifest: Manifest,
    keys: list[PublicKey],
    events: EventLog,
) -> str:
    from modelpack.signing.chunks import load_chunk_table

    from modelpack.errors import ChunkTableError

    try:
        table = load_chunk_table(target, manifest_desc, keys, manifest=manifest, events=events)
    except (ChunkTableError, ModelpackError):
        return "invalid"
    if table is not None and isinstance(target, ChunkCheckedSpools):
        target.use_chunk_table(table)  # mirrors' spools of its layers checked chunk by chunk
    return "absent" if table is None else "verified"


def select_directory_bundle(
    bundles: Sequence[Bundle], manifest: Manifest | None, keys: Sequence[PublicKey] | None
) -> Bundle | None:
    """The first bundle signed by a trusted key (any, when ``keys`` is None) whose file list is
    exactly the manifest's files (when ``manifest`` is given)."""
    for b in bundles:
        if keys is not None and b.verify(list(keys)) is None:
            continue
        try:
            files = statement_files(b.statement)
            if manifest is not None and files != files_from_manifest(manifest):
                continue
        except (BundleError, ModelpackError):
            continue
        return b
    return None


def verify_directory(
    directory: str,
    keys: Sequence[PublicKey],
    *,
    signature_path: str | None = None,
    bundle: Bundle | None = None,
    reference: str = "",
    digest: str = "",
    events: EventLog | None = None,
) -> dict[str, str]:
    """Check a materialised directory against a model_signing signature (a file or a bundle):
    trusted signer, every file digest, and the exact file set (a signature file inside the
    directory is not part of the set). Returns path → sha256 hex."""
    events = events or NullEventLog()
    ref = reference or directory
    if bundle is None:
        if signature_path is None:
            raise ValueError("verify_directory needs signature_path or bundle")
        try:
            with open(signature_path, "rb") as f:
                bundle = Bundle.from_bytes(f.read(MAX_BUNDLE_BYTES + 1), source=signature_path)
        except (OSError, BundleError) as exc:
            raise _refuse(
                events, ref, digest, f"signature {signature_path}: {exc}", cls=DirectorySignatureError
            ) from exc
    signer = bundle.verify(list(keys))
    if signer is None:
        raise _refuse(
            events,
            ref,
            digest,
            f"directory signature is not by a trusted key (hint {bundle.key_hint[:16]})",
            cls=DirectorySignatureError,
        )
    try:
        signed = statement_files(bundle.statement)
    except (BundleError, ModelpackError) as exc:
        raise _refuse(
            events, ref, digest, f"directory signature: {exc}", cls=DirectorySignatureError
        ) from exc
    try:
        recorded = statement_ignore_paths(bundle.statement)
    except BundleError as exc:
        raise _refuse(
            events, ref, digest, f"directory signature: {exc}", cls=DirectorySignatureError
        ) from exc
    ignore = [signature_path] if signature_path and os.path.exists(signature_path) else []
    actual = hash_directory(directory, ignore=ignore, ignore_relative=(*recorded, *GIT_PATHS))
    problems = compare_files(signed, actual)
    if problems:
        raise _refuse(
            events, ref, digest, f"{directory}: " + "; ".join(problems[:20]), cls=DirectorySignatureError
        )
    events.emit(
        "signing.directory_verified", reference=ref, digest=digest, files=len(actual), key_ids=[signer.key_id]
    )
    return actual
