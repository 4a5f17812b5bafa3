"""Variants as Python functions: build an index of ModelPack manifests, add one, describe one.

``create_index(REF, [VARIANT_REF, …])`` copies each variant into REF's repository (blobs skipped
or mounted when already there, signatures copied along, manifest bytes kept exactly), reads what
selects it — ``config.precision`` and ``config.quantization`` from its config, the
``dev.modelpack.variant.*`` annotations of its manifest, then the caller's overrides — and writes
an OCI image index whose entries are the variants' descriptors with those annotations.

With a signing key, every entry the key has not signed yet is signed (manifest signature,
directory signature, chunk table: ``sign_artifact``), then the index digest is signed, and only
then is REF's tag written: no tag ever points at an index whose signatures are missing.

``push_variant(SRC, REF, fields)`` pushes SRC by digest into REF's repository and adds it to the
index at REF (creating the index), replacing the entry with the same variant fields.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from modelpack.errors import InvalidReferenceError, NotFoundError, VariantIndexError
from modelpack.mediatypes import MEDIA_TYPE_OCI_INDEX, ModelSpecConfig, is_model_config
from modelpack.mediatypes.variants import (
    QUANTIZATION_NONE,
    VARIANT_KEYS,
    check_variant_value,
    normalize_precision,
    variant_fields,
)
from modelpack.mount.variants import ResolvedVariant, resolve_variant
from modelpack.oci.descriptor import Descriptor, Index, Manifest, parse_manifest_or_index
from modelpack.oci.digest import verify_bytes
from modelpack.oci.reference import Reference, parse_reference
from modelpack.oci.variant_index import (
    VariantEntry,
    VariantIndex,
    build_variant_index,
    check_entry_manifest,
    entry_descriptor,
    is_index_media_type,
    variant_index,
)
from modelpack.oci.variant_selection import parse_variant_options
from modelpack.targets.base import ReadableTarget, Target
from modelpack.targets.fetch import fetch_config
from modelpack.targets.opener import TargetOptions, open_readable, open_target
from modelpack.transfer.copy import copy

if TYPE_CHECKING:
    from modelpack.signing.keys import PrivateKey


@dataclass
class IndexResult:
    reference: str
    digest: str
    index: VariantIndex
    signed: dict[str, Any] = field(default_factory=dict)  # digest → what was signed

    def to_json(self) -> dict[str, Any]:
        return {"reference": self.reference, **self.index.to_json(), "signed": self.signed}


def config_fields(target: ReadableTarget, manifest: Manifest) -> dict[str, str]:
    """precision and quantization from the variant's ModelPack config (lower case; quantization
    ``none`` when the config declares none)."""
    if not is_model_config(manifest.config.media_type):
        return {}
    cfg = ModelSpecConfig.from_bytes(fetch_config(target, manifest)).to_dict().get("config", {})
    out: dict[str, str] = {}
    precision = cfg.get("precision")
    if isinstance(precision, str) and precision:
        out["precision"] = check_variant_value(
            "precision", normalize_precision(precision), where="config.precision"
        )
    quant = cfg.get("quantization")
    out["quantization"] = check_variant_value(
        "quantization", quant.lower() if isinstance(quant, str) and quant else QUANTIZATION_NONE
    )
    return out


def _entry_fields(target: ReadableTarget, manifest: Manifest, overrides: Mapping[str, str]) -> dict[str, str]:
    fields = config_fields(target, manifest)
    fields.update(variant_fields(manifest.annotations, where=f"manifest {manifest.digest}"))
    fields.update(overrides)
    return fields


def _bring_variant(
    src_text: str, dst: Target, target_options: TargetOptions | None, jobs: int, progress: str
) -> Manifest:
    """Copy the variant (and its signatures) into ``dst`` unless it is there; its verified
    manifest, checked to be a ModelPack manifest (an index inside an index is refused)."""
    src_ref = parse_reference(src_text)
    src = open_readable(src_ref, target_options)
    desc = src.resolve(src_ref.identifier)
    if is_index_media_type(desc.media_type):
        raise VariantIndexError(f"{src_ref}: is an index; an index entry must be a model manifest")
    copy(src, dst, str(desc.digest), None, jobs=jobs, referrers=True, progress=progress)
    raw, media_type = dst.fetch_manifest(str(desc.digest))
    verify_bytes(raw, desc.digest, None, what="manifest", source=dst.name)
    entry = VariantEntry(0, Descriptor(media_type, desc.digest, len(raw)), {})
    return check_entry_manifest(entry, raw, media_type, index=f"(new, for {src_ref})")


def create_index(
    reference: str | Reference,
    variants: Sequence[str],
    *,
    overrides: Mapping[int, Mapping[str, str]] | None = None,
    target_options: TargetOptions | None = None,
    sign_key: PrivateKey | str | None = None,
    sign_passphrase: str | bytes | None = None,
    jobs: int = 4,
    progress: str = "auto",
) -> IndexResult:
    """Write the index of ``variants`` at ``reference`` (a tag). ``overrides[i]`` (0-based) sets
    variant fields of entry ``i`` over what its config and annotations say."""
    dst_ref = _tag_reference(reference)
    if not variants:
        raise VariantIndexError(f"{dst_ref}: an index needs at least one variant")
    key = _load_key(sign_key, sign_passphrase)
    topts = (target_options or TargetOptions.from_environ()).bound_to(dst_ref)
    dst = open_target(dst_ref, topts, for_write=True)
    entries = []
    for i, text in enumerate(variants):
        manifest = _bring_variant(text, dst, topts, jobs, progress)
        fields = _entry_fields(dst, manifest, dict((overrides or {}).get(i, {})))
        entries.append(entry_descriptor(manifest, fields))
    built = build_variant_index(entries)
    return _store_index(dst, dst_ref, built, key)


def push_variant(
    source: str,
    reference: str | Reference,
    variant: Sequence[str] | Mapping[str, str],
    *,
    target_options: TargetOptions | None = None,
    sign_key: PrivateKey | str | None = None,
    sign_passphrase: str | bytes | None = None,
    jobs: int = 4,
    progress: str = "auto",
    pack_options: Any = None,
) -> IndexResult:
    """Push ``source`` (a checkpoint directory or a reference) by digest into REF's repository
    and put it in the index at REF: it replaces the entry with the same variant fields, else it
    is added; no index at REF yet: one is created. REF holding a plain manifest is refused."""
    dst_ref = _tag_reference(reference)
    key = _load_key(sign_key, sign_passphrase)
    overrides = parse_variant_options(variant)
    topts = (target_options or TargetOptions.from_environ()).bound_to(dst_ref)
    dst = open_target(dst_ref, topts, for_write=True)
    current = _current_index(dst, dst_ref)
    if os.path.isdir(source):
        from modelpack.api.artifacts import pack
        from modelpack.packing.packer import PackOptions

        packed = pack(
            source, dst_ref, pack_options or PackOptions(progress=progress), topts, jobs=jobs, tag=False
        )
        # digest only: "oci:DIR:tag@sha256:…" would not parse back to the same layout directory
        source = str(dataclasses.replace(dst_ref, tag=None, digest=packed.artifact.digest))
    manifest = _bring_variant(source, dst, topts, jobs, progress)
    new = entry_descriptor(manifest, _entry_fields(dst, manifest, overrides))
    new_fields = variant_fields(new.annotations)
    kept: list[Descriptor] = []
    for e in current.entries if current else ():
        if dict(e.fields) == new_fields or e.descriptor.digest == new.digest:
            continue  # replaced
        kept.append(e.descriptor)
    built = build_variant_index([*kept, new], annotations=current.index.annotations if current else None)
    return _store_index(dst, dst_ref, built, key)


def read_index(target: ReadableTarget, identifier: str) -> VariantIndex | None:
    """The variant index at ``identifier`` (verified against the digest it resolved to), or None
    when it names a plain manifest."""
    desc = target.resolve(identifier)
    raw, media_type = target.fetch_manifest(str(desc.digest))
    verify_bytes(raw, desc.digest, None, what="manifest", source=target.name)
    parsed = parse_manifest_or_index(raw, media_type)
    return variant_index(parsed) if isinstance(parsed, Index) else None


def inspect_index(
    reference: str | Reference, target_options: TargetOptions | None = None
) -> VariantIndex | None:
    """The variants at ``reference`` (None: a plain manifest), for ``inspect``."""
    ref = parse_reference(reference) if isinstance(reference, str) else reference
    return read_index(open_readable(ref, target_options), ref.identifier)


def _current_index(dst: Target, ref: Reference) -> VariantIndex | None:
    try:
        current = read_index(dst, ref.identifier)
    except NotFoundError:
        return None
    if current is None:
        raise VariantIndexError(
            f"{ref}: holds a model manifest, not an index; write the index with "
            "'modelpack index create REF VARIANT_REF…' (the manifest can be one of its variants)"
        )
    return current


def _tag_reference(reference: str | Reference) -> Reference:
    ref = parse_reference(reference) if isinstance(reference, str) else reference
    if ref.digest:
        raise InvalidReferenceError(f"{ref}: an index is written to a tag, not a digest")
    return ref.with_tag(ref.tag or "latest")


def _load_key(sign_key: PrivateKey | str | None, passphrase: str | bytes | None) -> PrivateKey | None:
    if sign_key is None:
        return None
    from modelpack.signing.keys import PrivateKey, load_private_key

    return sign_key if isinstance(sign_key, PrivateKey) else load_private_key(sign_key, passphrase)


def _store_index(dst: Target, ref: Reference, built: VariantIndex, key: PrivateKey | None) -> IndexResult:
    """Index by digest → (signatures of unsigned entries, then of the index) → tag, last."""
    raw = built.index.raw
    desc = dst.push_manifest(raw, MEDIA_TYPE_OCI_INDEX, None)
    result = IndexResult(str(ref), str(desc.digest), built)
    if key is not None:
        from modelpack.signing import sign_artifact
        from modelpack.signing.manifest_signature import check_manifest_signatures

        for e in built.entries:
            checks = check_manifest_signatures(dst, e.descriptor, [key.public])
            if any(c.status == "verified" for c in checks):
                result.signed[str(e.descriptor.digest)] = "already signed"
                continue
            sign_artifact(
                dst,
                e.descriptor.reference_only(),
                key,
                reference=dataclasses.replace(ref, tag=None, digest=e.descriptor.digest),
            )
            result.signed[str(e.descriptor.digest)] = "signed"
        index_desc = Descriptor(MEDIA_TYPE_OCI_INDEX, desc.digest, len(raw))
        sign_artifact(dst, index_desc, key, reference=ref)
        result.signed[str(desc.digest)] = "signed (index)"
    dst.tag(Descriptor(MEDIA_TYPE_OCI_INDEX, desc.digest, len(raw)), ref.tag or "latest")
    return result


__all__ = [
    "VARIANT_KEYS",
    "IndexResult",
    "ResolvedVariant",
    "config_fields",
    "create_index",
    "inspect_index",
    "push_variant",
    "read_index",
    "resolve_variant",
]
