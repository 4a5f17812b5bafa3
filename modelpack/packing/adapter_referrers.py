"""Finding a base model's adapters, and checking that an adapter is for the base at hand.

Adapters are referrers of their base (``subject``), so they are listed by the same machinery as
signatures: the registry's referrers API, or the ``sha256-<hex>`` tag-schema fallback index on
registries without one (distribution 2.8), or a scan of an OCI layout's index. A listing is a
hint from the registry: every entry is fetched again by digest, verified, and kept only if its
manifest really names this base as ``subject``, carries the adapter marker, agrees with itself
about the base, and has a safe name. Entries that fail are reported in ``skipped`` with the
reason (never fatal: anyone with push access can add junk referrers to a model).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from modelpack.errors import (
    AdapterBaseMismatchError,
    AdapterError,
    AdapterSubjectError,
    ModelpackError,
    NotFoundError,
)
from modelpack.mediatypes import ARTIFACT_TYPE_MODEL, is_model_config
from modelpack.oci.descriptor import Descriptor, Manifest, parse_manifest_or_index
from modelpack.oci.digest import verify_bytes
from modelpack.packing.adapter import (
    ADAPTER_KIND_LORA,
    ANNOTATION_ADAPTER,
    ANNOTATION_ADAPTER_BASE,
    ANNOTATION_ADAPTER_NAME,
    adapter_name_of,
    check_adapter_name,
)
from modelpack.targets.base import ReadableTarget

#: adapters examined per base (each costs a manifest fetch)
MAX_ADAPTERS = 256


@dataclass(frozen=True)
class FoundAdapter:
    """One verified adapter of a base: its name, manifest descriptor and manifest."""

    name: str
    descriptor: Descriptor
    manifest: Manifest

    @property
    def digest(self) -> str:
        return str(self.descriptor.digest)

    def to_json(self) -> dict[str, Any]:
        notes = self.manifest.annotations or {}
        return {
            "name": self.name,
            "digest": self.digest,
            "size": self.descriptor.size,
            "kind": notes.get(ANNOTATION_ADAPTER),
            "base": str(self.manifest.subject.digest) if self.manifest.subject else None,
            "totalSize": self.manifest.total_size,
        }


@dataclass
class AdapterListing:
    adapters: list[FoundAdapter] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


def is_model_manifest(manifest: Manifest) -> bool:
    return manifest.artifact_type == ARTIFACT_TYPE_MODEL or is_model_config(manifest.config.media_type)


def fetch_verified_manifest(target: ReadableTarget, desc: Descriptor, what: str) -> Manifest:
    raw, media_type = target.fetch_manifest(str(desc.digest))
    verify_bytes(raw, desc.digest, None, what=what, source=target.name)
    parsed = parse_manifest_or_index(raw, media_type)
    if not isinstance(parsed, Manifest):
        raise AdapterError(f"{target.name} {desc.digest}: {what} is an index, not a manifest")
    return parsed


def check_adapter_manifest(manifest: Manifest, where: str) -> str:
    """The adapter's name, once its manifest is an adapter whose marker and subject agree."""
    name = adapter_name_of(manifest)
    if name is None or not is_model_manifest(manifest):
        raise AdapterError(
            f"{where}: not a modelpack adapter (no {ANNOTATION_ADAPTER} annotation on a ModelPack manifest)"
        )
    kind = (manifest.annotations or {}).get(ANNOTATION_ADAPTER)
    if kind != ADAPTER_KIND_LORA:
        raise AdapterError(f"{where}: adapter kind {str(kind)[:40]!r} is not {ADAPTER_KIND_LORA!r}")
    if manifest.subject is None:
        raise AdapterSubjectError(f"{where}: adapter has no subject (the base model it is for)")
    declared = (manifest.annotations or {}).get(ANNOTATION_ADAPTER_BASE)
    if declared != str(manifest.subject.digest):
        raise AdapterError(
            f"{where}: annotation {ANNOTATION_ADAPTER_BASE} ({str(declared)[:80]}) is not its subject "
            f"{manifest.subject.digest}"
        )
    return check_adapter_name(name, where=f"{where}: {ANNOTATION_ADAPTER_NAME}")


def check_adapter_for_base(manifest: Manifest, adapter: str, adapter_digest: str, base_digest: str) -> str:
    """``check_adapter_manifest``, and the subject must be ``base_digest``
    (``AdapterBaseMismatchError`` naming both digests otherwise)."""
    name = check_adapter_manifest(manifest, f"{adapter} ({adapter_digest})")
    assert manifest.subject is not None
    if str(manifest.subject.digest) != str(base_digest):
        raise AdapterBaseMismatchError(
            adapter, adapter_digest, str(manifest.subject.digest), str(base_digest)
        )
    return name


def check_subject_resolves(target: ReadableTarget, manifest: Manifest, where: str) -> Manifest:
    """The adapter's base must exist where the adapter is, as a model manifest; else refused."""
    assert manifest.subject is not None
    try:
        base = fetch_verified_manifest(target, manifest.subject, "base manifest")
    except NotFoundError:
        raise AdapterSubjectError(
            f"{where}: its base {manifest.subject.digest} does not resolve in {target.name}"
        ) from None
    if not is_model_manifest(base) or adapter_name_of(base) is not None:
        raise AdapterSubjectError(
            f"{where}: its subject {manifest.subject.digest} is not a base model manifest"
        )
    if len(base.raw) != manifest.subject.size:
        raise AdapterSubjectError(
            f"{where}: its subject says {manifest.subject.size} bytes, the base manifest is {len(base.raw)}"
        )
    return base


def find_adapters(target: ReadableTarget, base: Descriptor) -> AdapterListing:
    """Every adapter of ``base`` listed by ``target`` (the first ``MAX_ADAPTERS``), each verified."""
    listing = AdapterListing()
    try:
        descs = target.referrers(Descriptor(base.media_type, base.digest, base.size), ARTIFACT_TYPE_MODEL)
    except NotFoundError:
        return listing
    seen: set[str] = set()
    for desc in descs:
        if str(desc.digest) in seen:
            continue
        if len(seen) >= MAX_ADAPTERS:
            listing.skipped.append(
                f"more than {MAX_ADAPTERS} adapters listed; examined the first {MAX_ADAPTERS}"
            )
            break
        seen.add(str(desc.digest))
        where = f"{target.name} referrer {desc.digest}"
        try:
            manifest = fetch_verified_manifest(target, desc, "adapter manifest")
            name = check_adapter_for_base(manifest, where, str(desc.digest), str(base.digest))
        except (ModelpackError, ValueError) as exc:
            listing.skipped.append(f"{where}: {exc}")
            continue
        real = Descriptor(
            manifest.media_type, desc.digest, len(manifest.raw), artifact_type=manifest.artifact_type
        )
        listing.adapters.append(FoundAdapter(name, real, manifest))
    listing.adapters.sort(key=lambda a: (a.name, a.digest))
    return listing


__all__ = [
    "MAX_ADAPTERS",
    "AdapterListing",
    "FoundAdapter",
    "check_adapter_for_base",
    "check_adapter_manifest",
    "check_subject_resolves",
    "fetch_verified_manifest",
    "find_adapters",
    "is_model_manifest",
]
