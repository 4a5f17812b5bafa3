"""Storing and finding signed bundles as OCI referrers of a model manifest.

Layout (cosign's ``specs/BUNDLE_SPEC.md``): an image manifest with ``artifactType`` naming what the
bundle is, the OCI empty config, exactly one layer (the bundle JSON, titled
``sha256-<hex>.sigstore.json``), ``subject`` = the model manifest, and the manifest annotations
``dev.sigstore.bundle.content`` / ``dev.sigstore.bundle.predicateType`` /
``org.opencontainers.image.created``. Every read is bounded and digest-checked.

Anyone who can push to a repository can add referrers to a model, so a referrer that cannot be
read (too large, too deep, not a bundle, wrong subject) is skipped with a
``signing.referrer_skipped`` event and never stops the examination of the others: a junk
referrer next to a valid signature must not block verification.

Writes are confirmed by reading back (``confirm_referrers``): on a registry without the
referrers API the ``sha256-<hex>`` fallback index is a read-modify-write that a concurrent signer
can overwrite, so a signer waits, reads the index again, re-adds what went missing, and fails
when its referrers stay undiscoverable.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

from modelpack.mediatypes import MEDIA_TYPE_OCI_MANIFEST
from modelpack.signing.bundle import ACCEPTED_BUNDLE_MEDIA_TYPES, BUNDLE_MEDIA_TYPE, MAX_BUNDLE_BYTES, Bundle

from modelpack.errors import BundleError, ManifestError, ModelpackError, NotFoundError, SigningError
from modelpack.events import EventLog, NullEventLog
from modelpack.oci.descriptor import EMPTY_JSON, Descriptor, Manifest, empty_config_descriptor
from modelpack.oci.digest import Digest, verify_bytes
from modelpack.targets.base import ReadableTarget, Target, bytes_blob_source
from modelpack.timestamps import now_rfc3339_utc

ANNOTATION_BUNDLE_CONTENT = "dev.sigstore.bundle.content"
ANNOTATION_BUNDLE_PREDICATE = "dev.sigstore.bundle.predicateType"
ANNOTATION_CREATED = "org.opencontainers.image.created"
ANNOTATION_TITLE = "org.opencontainers.image.title"

# artifact types of the referrers we write
ARTIFACT_TYPE_SIGNATURE = BUNDLE_MEDIA_TYPE  # what cosign looks for
ARTIFACT_TYPE_MODEL_SIGNATURE = "application/vnd.modelpack.model-signing.v1+json"
ARTIFACT_TYPE_CHUNK_DIGESTS = "application/vnd.modelpack.chunk-digests.v1+json"
MAX_REFERRERS = 1000  # of one type per manifest; each costs two fetches
#: Read-back rounds after writing referrers, and the longest wait between two of them.
CONFIRM_ATTEMPTS = 5
CONFIRM_MAX_WAIT = 2.0


def subject_descriptor(manifest_desc: Descriptor) -> Descriptor:
    """The plain (mediaType, digest, size) descriptor a referrer's ``subject`` carries."""
    return Descriptor(manifest_desc.media_type, manifest_desc.digest, manifest_desc.size)


def push_bundle_referrer(
    target: Target,
    manifest_desc: Descriptor,
    bundle: Bundle,
    *,
    artifact_type: str,
    predicate_type: str,
    created: str | None = None,
) -> Descriptor:
    """Push the bundle blob, the empty config and the referrer manifest (untagged)."""
    data = bundle.to_bytes()
    layer = Descriptor(
        BUNDLE_MEDIA_TYPE,
        Digest.from_bytes(data),
        len(data),
        annotations={ANNOTATION_TITLE: f"sha256-{Digest.from_bytes(data).hex}.sigstore.json"},
    )
    config = empty_config_descriptor()
    # the empty config travels inline (``data``) but registries still need the blob
    config_blob = Descriptor(config.media_type, config.digest, config.size)
    target.push_blob(bytes_blob_source(config_blob, EMPTY_JSON))
    target.push_blob(bytes_blob_source(layer, data))
    created = created or now_rfc3339_utc()
    manifest = Manifest.build(
        config,
        [layer],
        artifact_type=artifact_type,
        subject=subject_descriptor(manifest_desc),
        annotations={
            ANNOTATION_BUNDLE_CONTENT: "dsse-envelope",
            ANNOTATION_BUNDLE_PREDICATE: predicate_type,
            ANNOTATION_CREATED: created,
        },
    )
    return target.push_manifest(manifest.raw, MEDIA_TYPE_OCI_MANIFEST, None)


@dataclass(frozen=True)
class StoredBundle:
    """One bundle referrer as read back: its manifest descriptor, parsed manifest and bundle."""

    descriptor: Descriptor
    manifest: Manifest
    bundle: Bundle | None
    error: str = ""


def find_bundle_referrers(
    target: ReadableTarget,
    manifest_desc: Descriptor,
    artifact_type: str,
    *,
    events: EventLog | None = None,
) -> list[StoredBundle]:
    """Every referrer of ``artifact_type`` (the first ``MAX_REFERRERS``); unreadable ones come back
    with ``error`` set, never dropped (a broken signature must be reported, not mistaken for
    "unsigned"), and each is reported as a ``signing.referrer_skipped`` event."""
    events = events or NullEventLog()
    try:
        descs = target.referrers(subject_descriptor(manifest_desc), artifact_type)
    except NotFoundError:
        return []
    out: list[StoredBundle] = []
    seen: set[str] = set()
    for desc in descs:
        if desc.artifact_type not in (None, artifact_type) or desc.digest in seen:
            continue
        if len(seen) >= MAX_REFERRERS:
            events.emit(
                "signing.referrer_skipped",
                subject=str(manifest_desc.digest),
                referrer=None,
                artifact_type=artifact_type,
                reason=f"{target.name}: more than {MAX_REFERRERS} referrers of this type; examined the first {MAX_REFERRERS}",
            )
            break
        seen.add(desc.digest)
        item = read_bundle_referrer(target, desc, manifest_desc)
        if item.error:
            skipped(events, manifest_desc, item, item.error)
        out.append(item)
    return out


def skipped(events: EventLog, manifest_desc: Descriptor, item: StoredBundle, reason: str) -> None:
    """Report a referrer that is not used (unreadable, malformed, or of the wrong kind)."""
    events.emit(
        "signing.referrer_skipped",
        subject=str(manifest_desc.digest),
        referrer=str(item.descriptor.digest),
        artifact_type=item.descriptor.artifact_type or item.manifest.artifact_type,
        reason=reason,
    )


def read_bundle_referrer(target: ReadableTarget, desc: Descriptor, manifest_desc: Descriptor) -> StoredBundle:
    where = f"{target.name} referrer {desc.digest}"
    placeholder = Manifest.build(empty_config_descriptor(), [])
    try:
        raw, media_type = target.fetch_manifest(str(desc.digest))
        verify_bytes(raw, desc.digest, None, what="referrer manifest", source=target.name)
        manifest = Manifest.parse(raw, media_type=media_type)  # bounded: size, depth, duplicate keys
    except (ModelpackError, ValueError) as exc:
        return StoredBundle(desc, placeholder, None, f"{where}: unreadable: {exc}")
    if manifest.subject is None or manifest.subject.digest != manifest_desc.digest:
        got = manifest.subject.digest if manifest.subject else "none"
        return StoredBundle(desc, manifest, None, f"{where}: subject is {got}, not {manifest_desc.digest}")
    if len(manifest.layers) != 1:
        return StoredBundle(desc, manifest, None, f"{where}: has {len(manifest.layers)} layers, expected 1")
    layer = manifest.layers[0]
    if layer.media_type not in ACCEPTED_BUNDLE_MEDIA_TYPES:
        return StoredBundle(desc, manifest, None, f"{where}: layer media type {layer.media_type!r}")
    if layer.size > MAX_BUNDLE_BYTES:
        return StoredBundle(desc, manifest, None, f"{where}: bundle of {layer.size} bytes is too large")
    try:
        with target.fetch_blob(layer) as f:
            data = f.read(layer.size + 1)
        verify_bytes(data, layer.digest, layer.size, what="bundle", source=target.name)
        bundle = Bundle.from_bytes(data, source=f"{where} bundle {layer.digest}")
    except (ModelpackError, BundleError, ManifestError, OSError) as exc:
        return StoredBundle(desc, manifest, None, f"{where}: {exc}")
    return StoredBundle(desc, manifest, bundle)


def confirm_referrers(
    target: Target,
    manifest_desc: Descriptor,
    pushed: Sequence[Descriptor],
    *,
    write_seconds: float = 0.0,
    events: EventLog | None = None,
    what: str = "signature referrers",
    lost_event: str = "signing.referrer_lost",
    consequence: str = "the signature is not published — sign again",
    error: type[ModelpackError] = SigningError,
) -> None:
    """Make sure every pushed referrer is listed for ``manifest_desc``; re-push the missing ones
    (which merges them into the current fallback index) and read back again, waiting a little
    longer each round.

    The first read waits one to two times ``write_seconds`` (how long one referrer write took,
    at least 50 ms), so a concurrent signer whose read-modify-write of the fallback index started
    before ours has finished by then. Raises ``error`` (``SigningError``) naming the target and
    digest when a referrer is still not discoverable. Shared by every writer of referrers (the
    signers here, runtime-asset pushes): ``what``, ``lost_event`` and ``consequence`` word the
    event and the message for the caller's kind of referrer.
    """
    events = events or NullEventLog()
    missing = list(pushed)
    wait = min(max(write_seconds, 0.05), CONFIRM_MAX_WAIT)
    for attempt in range(CONFIRM_ATTEMPTS):
        time.sleep(wait * (1 + random.random()))
        listed = {str(d.digest) for d in target.referrers(subject_descriptor(manifest_desc))}
        missing = [d for d in missing if str(d.digest) not in listed]
        if not missing:
            return
        events.emit(
            lost_event,
            subject=str(manifest_desc.digest),
            referrers=[str(d.digest) for d in missing],
            attempt=attempt + 1,
        )
        if attempt + 1 < CONFIRM_ATTEMPTS:
            for desc in missing:
                raw, media_type = target.fetch_manifest(str(desc.digest))
                verify_bytes(raw, desc.digest, None, what="referrer manifest", source=target.name)
                target.push_manifest(raw, media_type, None)
        wait = min(wait * 2, CONFIRM_MAX_WAIT)
    raise error(
        f"{target.name}: {what} {', '.join(str(d.digest) for d in missing)} of "
        f"{manifest_desc.digest} are not discoverable after {CONFIRM_ATTEMPTS} read-backs (another "
        f"writer keeps replacing the referrers index); {consequence}"
    )
