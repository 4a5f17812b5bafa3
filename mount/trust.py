"""Signature policy in the node cache: verify on a miss, reuse an earlier verification on a hit.

``snapshots/<hex>.trust.json`` remembers which trusted keys verified a digest (and whether the
directory signature and chunk table were verified), so a hit under the same trust needs no
network. A miss records it only after its snapshot is published, so no trust file exists for a
snapshot that never became ready. A record the cache owner did not write is ignored.
``modelpack.signing`` is imported only when a policy is given.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeAlias

from modelpack.mount.kept_referrers import RecordingTarget, keep
from modelpack.mount.modes import FILE_MODE, read_trusted
from modelpack.mount.reports import to_ms
from modelpack.mount.snapshots import SnapshotInfo, Snapshots
from modelpack.mount.store import Store

from modelpack.boundedjson import loads_object
from modelpack.errors import DocumentError, ModelpackError, SignatureRefused
from modelpack.events import EventLog
from modelpack.files import atomic_write_bytes
from modelpack.oci.descriptor import Descriptor, Manifest
from modelpack.oci.digest import verify_bytes
from modelpack.oci.reference import Reference
from modelpack.targets.base import ReadableTarget
from modelpack.targets.opener import TargetOptions, open_readable

if TYPE_CHECKING:
    from modelpack.signing.verify import PolicyOrKeys, VerificationResult

MAX_TRUST_BYTES = 64 * 1024

#: a cache pull's signature policy: a loaded policy or trusted keys, or the path of a policy file
PolicySource: TypeAlias = "PolicyOrKeys | str | os.PathLike[str]"


def load_policy(policy: PolicySource) -> PolicyOrKeys:
    """A ``TrustPolicy`` from a path; anything else (policy, keys) is passed through."""
    if isinstance(policy, (str, os.PathLike)):
        from modelpack.signing import TrustPolicy

        return TrustPolicy.load(policy)
    return policy


class TrustRecords:
    """Signature checks for the cache, and the per-digest record of what they verified."""

    def __init__(self, store: Store, snapshots: Snapshots) -> None:
        self.store = store
        self.snapshots = snapshots
        #: per digest: what its verification read (``mount.kept_referrers``), kept by ``record``
        self._read_with: dict[str, tuple[RecordingTarget, tuple[list[Any], Any], Callable[..., None]]] = {}

    def read(self, digest: str) -> dict[str, Any]:
        """What verified ``digest``; empty when unknown, malformed, or not written by the cache
        owner (a record another uid planted claims nothing)."""
        path = self.snapshots.trust_path(digest)
        try:
            raw = read_trusted(path, self.store.owner, MAX_TRUST_BYTES)
            if raw is None or len(raw) > MAX_TRUST_BYTES:
                return {}
            doc = loads_object(raw, what=path, max_bytes=MAX_TRUST_BYTES)
        except (OSError, DocumentError):
            return {}
        return doc if doc.get("digest") == digest else {}

    def record(self, digest: str, result: VerificationResult) -> None:
        """Remember which keys verified this digest, so a hit under the same trust needs no network."""
        doc = self.read(digest) or {"digest": digest, "key_ids": []}
        doc["key_ids"] = sorted(set(doc.get("key_ids", [])) | set(result.key_ids))
        doc["signed_at"] = _merge_signed_times(doc.get("signed_at"), result.signed_times)
        for field_name, status in (
            ("directory_signature", result.directory_signature),
            ("chunk_table", result.chunk_table),
        ):
            if status == "verified":
                doc[field_name] = "verified"
        atomic_write_bytes(
            self.snapshots.trust_path(digest), json.dumps(doc, sort_keys=True).encode(), mode=FILE_MODE
        )
        self._keep_referrers(digest)

    def _keep_referrers(self, digest: str) -> None:
        """Keep the signature referrers this digest was verified with, so ``cache serve`` can
        hand them to a peer whose origin is down. Best effort: a failure is an event, and the
        pull (already verified and ready) stands."""
        pending = self._read_with.pop(digest, None)
        if pending is None:
            return
        recorder, (keys, keyless), ev = pending
        try:
            kept = keep(self.store, digest, recorder, keys, keyless)
        except (OSError, ModelpackError) as exc:
            ev("cache.referrers_not_kept", digest=digest, reason=str(exc)[:300])
            return
        ev("cache.referrers_kept", digest=digest, referrers=kept)

    def trusted_locally(self, digest: str, ref: Reference, policy: PolicyOrKeys) -> bool:
        """Whether an earlier verification of ``digest`` satisfies ``policy`` for ``ref``."""
        from modelpack.signing.verify import resolve_policy

        rp = resolve_policy(policy, ref)
        rec = self.read(digest)
        signed_by_trusted = bool(set(rp.key_ids) & set(rec.get("key_ids", [])))
        if rp.require_signature and not signed_by_trusted:
            return False
        if signed_by_trusted and ref.tag and not ref.digest and self.signed_time(digest, ref, policy) is None:
            return False  # recorded before signing times were: a tag pull learns it online once
        if rp.require_directory_signature and rec.get("directory_signature") != "verified":
            return False
        return not (rp.require_chunk_table and rec.get("chunk_table") != "verified")

    def signed_time(self, digest: str, ref: Reference, policy: PolicySource) -> float | None:
        """The newest signing time recorded for ``digest`` by a key ``policy`` trusts for ``ref``
        (0: untimed or unsigned); None when the record predates signing times."""
        from modelpack.signing.signing_time import parse_signing_time
        from modelpack.signing.verify import resolve_policy

        rec = self.read(digest)
        times = rec.get("signed_at")
        trusted = set(resolve_policy(load_policy(policy), ref).key_ids) & set(rec.get("key_ids", []))
        if not trusted:
            return 0.0
        if not isinstance(times, dict):
            return None
        known = [times[k] for k in trusted if isinstance(times.get(k), str)]
        if not known:
            return None
        try:
            return max(parse_signing_time(t) if t else 0.0 for t in known)
        except ModelpackError:
            return None

    def on_hit(
        self,
        info: SnapshotInfo,
        ref: Reference,
        target: ReadableTarget | None,
        target_options: TargetOptions | None,
        policy: PolicySource,
        log: EventLog,
        ev: Callable[..., None],
        timings: dict[str, float],
    ) -> tuple[ReadableTarget | None, str]:
        """A hit under a policy: trusted if an earlier pull verified the same digest with a key
        this policy trusts (no network); otherwise verify now, before the hit is returned."""
        loaded = load_policy(policy)
        if self.trusted_locally(info.digest, ref, loaded):
            ev("cache.signature_verified", digest=str(info.digest), status="verified", cached=True)
            return target, "verified"
        t = time.monotonic()
        target = target or open_readable(ref, target_options)
        raw = self.store.read_small(info.digest)
        verify_bytes(raw, info.digest, None, what="manifest", source=self.store.root)
        result = self.check(target, ref, Manifest.parse(raw), loaded, log, ev)
        timings["signature"] = to_ms(time.monotonic() - t)
        return target, str(result.status)

    def check(
        self,
        target: ReadableTarget,
        ref: Reference,
        manifest: Manifest,
        policy: PolicySource,
        log: EventLog,
        ev: Callable[..., None],
        *,
        record: bool = True,
    ) -> VerificationResult:
        """Adapter to ``modelpack.signing.verify_artifact``; refusal → event + typed error.

        Returns the ``VerificationResult``. ``record`` stores which keys verified the digest; a
        miss records only after publishing, so no trust file exists for a snapshot that never
        became ready."""
        from modelpack.signing import verify_artifact
        from modelpack.signing.verify import resolve_policy

        loaded = load_policy(policy)
        desc = Descriptor(manifest.media_type, manifest.digest, manifest.size)
        recorder = RecordingTarget(target)
        try:
            result = verify_artifact(recorder, ref, desc, loaded, events=log)
        except SignatureRefused as exc:
            ev("cache.signature_refused", digest=str(manifest.digest), reason=exc.reason)
            raise
        ev(
            "cache.signature_verified",
            digest=str(manifest.digest),
            status=result.status,
            key_ids=result.key_ids,
        )
        rp = resolve_policy(loaded, ref)
        self._read_with[str(manifest.digest)] = (recorder, (list(rp.keys), rp.keyless), ev)
        if record:
            self.record(str(manifest.digest), result)
        return result


def _merge_signed_times(recorded: Any, verified: dict[str, float]) -> dict[str, str]:
    """Per key id, the newest signing time seen (RFC 3339; '' for untimed signatures)."""
    from modelpack.signing.signing_time import format_signing_time, parse_signing_time

    out: dict[str, float] = {}
    if isinstance(recorded, dict):
        for key_id, text in recorded.items():
            try:
                out[str(key_id)] = parse_signing_time(text) if text else 0.0
            except ModelpackError:
                continue
    for key_id, seconds in verified.items():
        out[key_id] = max(out.get(key_id, 0.0), seconds)
    return {k: format_signing_time(v) if v else "" for k, v in sorted(out.items())}
