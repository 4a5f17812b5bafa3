"""The variant index: an OCI image index whose entries are ModelPack manifests of one model.

Reading one is bounded before anything looks at it, because the pusher controls every byte of
it: at most :data:`MAX_VARIANT_ENTRIES` entries, at most :data:`MAX_ENTRY_ANNOTATION_BYTES` of
annotations per entry, every variant value checked by ``modelpack.mediatypes.variants`` (letters,
digits and ``. _ + -`` only, 128 bytes), and every entry an OCI image manifest: an entry that is
itself an index is refused (one level of nesting, no more), as is any other media type.
Whether an entry really is a *ModelPack* manifest is known only once its bytes are fetched and
hashed against the entry digest; :func:`check_entry_manifest` is that check.

Building one keeps each variant's descriptor exactly (media type, digest, size, artifact type) and
adds the variant annotations; the bytes are canonical JSON so the same variants give the same
index digest.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from modelpack.errors import ManifestError, VariantIndexError
from modelpack.mediatypes import MEDIA_TYPE_OCI_INDEX, MEDIA_TYPE_OCI_MANIFEST
from modelpack.mediatypes.types import is_model_artifact_type, is_model_config
from modelpack.mediatypes.variants import VARIANT_KEYS, variant_fields
from modelpack.oci.descriptor import Descriptor, Index, Manifest, parse_manifest_or_index

#: far more than any model has layouts; bounds what a hostile index makes a node compare and print
MAX_VARIANT_ENTRIES = 256
MAX_ENTRY_ANNOTATION_BYTES = 8 * 1024

#: the OCI index JSON schema's required fields and types (image-spec schema/image-index-schema.json)
_INDEX_ENTRY_MEDIA_TYPES = (MEDIA_TYPE_OCI_MANIFEST,)


@dataclass(frozen=True)
class VariantEntry:
    """One entry: its position in the index (from 1, the N of ``index create --variant N:`` and of
    every message), its descriptor, and its checked variant fields."""

    position: int
    descriptor: Descriptor
    fields: Mapping[str, str]

    @property
    def label(self) -> str:
        """``#1 sha256:abcd…`` — how messages name an entry (position and short digest)."""
        return f"#{self.position} {str(self.descriptor.digest)[:19]}"

    def to_json(self) -> dict[str, object]:
        return {
            "position": self.position,
            "digest": str(self.descriptor.digest),
            "mediaType": self.descriptor.media_type,
            "size": self.descriptor.size,
            "variant": dict(self.fields),
        }


@dataclass(frozen=True)
class VariantIndex:
    """A parsed index and its entries; ``index.raw`` is the exact bytes (the signed digest)."""

    index: Index
    entries: tuple[VariantEntry, ...]

    @property
    def digest(self) -> str:
        return str(self.index.digest)

    def to_json(self) -> dict[str, object]:
        return {"digest": self.digest, "variants": [e.to_json() for e in self.entries]}


def is_index_media_type(media_type: str | None) -> bool:
    from modelpack.mediatypes import MEDIA_TYPE_DOCKER_MANIFEST_LIST

    return media_type in (MEDIA_TYPE_OCI_INDEX, MEDIA_TYPE_DOCKER_MANIFEST_LIST)


def parse_variant_index(raw: bytes, media_type: str | None = None) -> VariantIndex:
    """The index at ``raw`` as variants, or VariantIndexError naming the index and the entry."""
    parsed = parse_manifest_or_index(raw, media_type)
    if not isinstance(parsed, Index):
        raise VariantIndexError(f"manifest {parsed.digest}: not an index")
    return variant_index(parsed)


def variant_index(index: Index) -> VariantIndex:
    """Check an already-parsed index against the variant bounds."""
    what = f"index {index.digest}"
    if len(index.manifests) > MAX_VARIANT_ENTRIES:
        raise VariantIndexError(
            f"{what}: {len(index.manifests)} entries; a variant index holds at most {MAX_VARIANT_ENTRIES}"
        )
    if not index.manifests:
        raise VariantIndexError(f"{what}: no entries")
    entries = []
    for i, desc in enumerate(index.manifests, start=1):
        where = f"{what} entry #{i} {str(desc.digest)[:19]}"
        if is_index_media_type(desc.media_type):
            raise VariantIndexError(f"{where}: is an index inside an index; nesting is refused")
        if desc.media_type not in _INDEX_ENTRY_MEDIA_TYPES:
            raise VariantIndexError(
                f"{where}: media type {desc.media_type[:100]!r} is not an OCI image manifest"
            )
        annotations = desc.annotations or {}
        total = sum(len(k.encode()) + len(v.encode()) for k, v in annotations.items())
        if total > MAX_ENTRY_ANNOTATION_BYTES:
            raise VariantIndexError(
                f"{where}: {total} bytes of annotations; an entry may carry {MAX_ENTRY_ANNOTATION_BYTES}"
            )
        entries.append(VariantEntry(i, desc, variant_fields(annotations, where=where)))
    return VariantIndex(index, tuple(entries))


def check_entry_manifest(entry: VariantEntry, raw: bytes, media_type: str | None, *, index: str) -> Manifest:
    """The entry's manifest, once its bytes are known to hash to the entry digest and it is a
    ModelPack manifest (model artifact type or model config); else VariantIndexError.

    The caller has verified ``raw`` against ``entry.descriptor.digest`` (a fetch by digest does):
    a hostile index cannot point at a container image, at another index, or at bytes that are
    not what its entry names."""
    from modelpack.oci.digest import Digest

    where = f"index {index} entry {entry.label}"
    if Digest.from_bytes(raw) != entry.descriptor.digest:
        raise VariantIndexError(f"{where}: the manifest fetched does not hash to the entry digest")
    if len(raw) != entry.descriptor.size:
        raise VariantIndexError(
            f"{where}: the manifest is {len(raw)} bytes, the entry says {entry.descriptor.size}"
        )
    try:
        parsed = parse_manifest_or_index(raw, media_type or entry.descriptor.media_type)
    except ManifestError as exc:
        raise VariantIndexError(f"{where}: {exc}") from exc
    if isinstance(parsed, Index):
        raise VariantIndexError(f"{where}: is an index inside an index; nesting is refused")
    if not (is_model_artifact_type(parsed.artifact_type) or is_model_config(parsed.config.media_type)):
        raise VariantIndexError(f"{where}: not a ModelPack manifest (no model artifact type or config)")
    return parsed


def entry_descriptor(manifest: Manifest, fields: Mapping[str, str]) -> Descriptor:
    """The index entry for ``manifest``: its media type, digest and size plus the variant
    annotations. No ``artifactType`` (on the entries or the index): ``skopeo copy --all``
    re-serialises an index and drops it, changing the digest that pins and index signatures
    name; what makes an entry a model is read from its manifest (``check_entry_manifest``)."""
    annotations = {VARIANT_KEYS[k]: v for k, v in sorted(fields.items())}
    return Descriptor(
        media_type=manifest.media_type,
        digest=manifest.digest,
        size=manifest.size,
        annotations=annotations or None,
    )


def build_variant_index(
    entries: Sequence[Descriptor], *, annotations: Mapping[str, str] | None = None
) -> VariantIndex:
    """An index of ``entries`` (canonical bytes), checked as any index read back would be.

    Two entries with the same variant fields could never be told apart by a node: refused here,
    so a pusher learns it at ``index create``, not at every node's pull."""
    built = variant_index(Index.build(list(entries), annotations=annotations))
    seen: dict[tuple[tuple[str, str], ...], VariantEntry] = {}
    for e in built.entries:
        key = tuple(sorted(e.fields.items()))
        if key in seen:
            raise VariantIndexError(
                f"entries {seen[key].label} and {e.label} have the same variant fields "
                f"({', '.join(f'{k}={v}' for k, v in key) or 'none'}); give each a --variant that sets them apart"
            )
        seen[key] = e
    return built
