"""Storing and finding signed bundles as OCI referrers of a model manifest.

Layout (cosign's ``specs/BUNDLE_SPEC.md``): an image manifest with ``artifactType`` naming what the
bundle is, the OCI empty config, exactly one layer (the bundle JSON, titled
``sha256-<hex>.sigstore.json``), ``subject`` = the model manifest, and the manifest annotations
``dev.sigstore.bundle.content`` / ``dev.sigstore.bundle.predicateType`` /
``org.opencontainers.image.created``. Every read is bounded and digest-checked.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

from modelpack.mediatypes import MEDIA_TYPE_OCI_MANIFEST
from modelpack.signing.bundle import ACCEPTED_BUNDLE_MEDIA_TYPES, BUNDLE_MEDIA_TYPE, MAX_BUNDLE_BYTES, Bundle

from modelpack.errors import BundleError, ManifestError, ModelpackError, NotFoundError
from modelpack.oci.descriptor import EMPTY_JSON, Descriptor, Manifest, empty_config_descriptor
from modelpack.oci.digest import Digest, verify_bytes
from modelpack.targets.base import ReadableTarget, Target, bytes_blob_source

ANNOTATION_BUNDLE_CONTENT = "dev.sigstore.bundle.content"
ANNOTATION_BUNDLE_PREDICATE = "dev.sigstore.bundle.predicateType"
ANNOTATION_CREATED = "org.opencontainers.image.created"
ANNOTATION_TITLE = "org.opencontainers.image.title"

# artifact types of the referrers we write
ARTIFACT_TYPE_SIGNATURE = BUNDLE_MEDIA_TYPE  # what cosign looks for
ARTIFACT_TYPE_MODEL_SIGNATURE = "application/vnd.modelpack.model-signing.v1+json"
ARTIFACT_TYPE_CHUNK_DIGESTS = "application/vnd.modelpack.chunk-digests.v1+json"
MAX_REFERRERS = 1000  # of one type per manifest; each costs two fetches


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
    created = created or datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
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
    target: ReadableTarget, manifest_desc: Descriptor, artifact_type: str
) -> list[StoredBundle]:
    """Every referrer of ``artifact_type``; unreadable ones come back with ``error`` set, never dropped
    (a broken signature must be reported, not mistaken for "unsigned")."""
    try:
        descs = target.referrers(subject_descriptor(manifest_desc), artifact_type)
    except NotFoundError:
        return []
    out: list[StoredBundle] = []
    seen: set[str] = set()
    if len(descs) > MAX_REFERRERS:
        raise BundleError(
            f"{target.name}: {manifest_desc.digest} has {len(descs)} referrers of type {artifact_type}; "
            f"refusing to examine more than {MAX_REFERRERS}"
        )
    for desc in descs:
        if desc.artifact_type not in (None, artifact_type) or desc.digest in seen:
            continue
        seen.add(desc.digest)
        out.append(read_bundle_referrer(target, desc, manifest_desc))
    return out


def read_bundle_referrer(target: ReadableTarget, desc: Descriptor, manifest_desc: Descriptor) -> StoredBundle:
    where = f"{target.name} referrer {desc.digest}"
    placeholder = Manifest.build(empty_config_descriptor(), [])
    try:
        raw, media_type = target.fetch_manifest(str(desc.digest))
        verify_bytes(raw, desc.digest, None, what="referrer manifest", source=target.name)
        manifest = Manifest.parse(raw, media_type=media_type)
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
