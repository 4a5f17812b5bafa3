"""Signing an artifact that is already in a writable target: the three signed referrers.

1. the manifest signature (cosign-readable, ``manifest_signature``),
2. the OpenSSF model_signing directory signature (``model_signing``; raw-layer artifacts only),
3. the chunk-digest table of the weight layers (``chunks``).

All three are bound to the manifest digest; none changes the manifest or its tags. Signing
returns only once every referrer it wrote is discoverable by reading it back (see
``referrers.confirm_referrers``): a concurrent signer on a registry without the referrers API
can otherwise make a signature vanish while this one reports success.

A publisher that tags (``modelpack push --sign-key``) pushes the manifest by digest, signs, and
tags last, so a failed signing leaves no tag pointing at an unsigned model.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from modelpack.mediatypes import ModelSpecConfig, is_model_config
from modelpack.signing.bundle import Bundle, sign_statement
from modelpack.signing.chunks import (
    DEFAULT_CHUNK_SIZE,
    ChunkTable,
    compute_chunk_table,
    push_chunk_table,
    weight_layers,
)
from modelpack.signing.keys import PrivateKey, PublicKey, load_private_key
from modelpack.signing.manifest_signature import sign_manifest
from modelpack.signing.model_signing import directory_statement, files_from_manifest
from modelpack.signing.referrers import (
    ARTIFACT_TYPE_MODEL_SIGNATURE,
    confirm_referrers,
    find_bundle_referrers,
    push_bundle_referrer,
)
from modelpack.signing.statements import PREDICATE_MODEL_SIGNING

from modelpack.errors import ModelpackError, SigningError
from modelpack.events import EventLog
from modelpack.files import atomic_write_bytes
from modelpack.oci.descriptor import Descriptor, Manifest
from modelpack.oci.digest import verify_bytes
from modelpack.oci.reference import Reference, parse_reference
from modelpack.targets.base import ReadableTarget, Target


@dataclass
class SignResult:
    manifest_digest: str
    key_id: str
    signature: Descriptor
    directory_signature: Descriptor | None = None
    chunk_table: Descriptor | None = None
    skipped: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "digest": self.manifest_digest,
            "keyId": self.key_id,
            "signature": str(self.signature.digest),
            "directorySignature": str(self.directory_signature.digest) if self.directory_signature else None,
            "chunkTable": str(self.chunk_table.digest) if self.chunk_table else None,
            "skipped": dict(self.skipped),
        }


def _fetch_manifest(target: ReadableTarget, manifest_desc: Descriptor) -> Manifest:
    raw, media_type = target.fetch_manifest(str(manifest_desc.digest))
    verify_bytes(raw, manifest_desc.digest, None, what="manifest", source=target.name)
    return Manifest.parse(raw, media_type=media_type)


def _is_index(target: ReadableTarget, manifest_desc: Descriptor) -> bool:
    """Whether ``manifest_desc`` names an image index (its bytes verified against the digest)."""
    from modelpack.oci.descriptor import Index, parse_manifest_or_index

    raw, media_type = target.fetch_manifest(str(manifest_desc.digest))
    verify_bytes(raw, manifest_desc.digest, None, what="manifest", source=target.name)
    return isinstance(parse_manifest_or_index(raw, media_type), Index)


def _model_name(target: ReadableTarget, manifest: Manifest, reference: Reference | None) -> str:
    if is_model_config(manifest.config.media_type) and manifest.config.size <= 4 * 1024 * 1024:
        try:
            with target.fetch_blob(manifest.config) as f:
                data = f.read(manifest.config.size + 1)
            verify_bytes(
                data, manifest.config.digest, manifest.config.size, what="config", source=target.name
            )
            name = ModelSpecConfig.from_bytes(data).to_dict().get("descriptor", {}).get("name")
            if isinstance(name, str) and name:
                return name
        except (ModelpackError, ValueError):
            pass
    if reference is not None and reference.scheme == "registry":
        return reference.repository.rsplit("/", 1)[-1]
    return "model"


def sign_artifact(
    target: Target,
    manifest_desc: Descriptor,
    private_key: PrivateKey | str,
    *,
    chunk_table: bool | ChunkTable = True,
    directory_signature: bool = True,
    reference: Reference | str | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    events: EventLog | None = None,
    signed_at: str | None = None,
    aligned_chunks: bool = True,
) -> SignResult:
    """Sign an artifact already stored in ``target``. ``chunk_table`` may be a precomputed table
    (the pusher hashed the files anyway); else the weight blobs are read back and hashed. The
    manifest signature carries ``signed_at`` (RFC 3339 UTC, default now) as its signing time.
    A table hashed here has chunks aligned to the tensors unless ``aligned_chunks`` is False
    (``signing.chunk_bounds``; fixed chunks are what verifiers before the aligned form accept).

    Returns once every referrer written is discoverable; raises ``SigningError`` if one is not."""
    key = private_key if isinstance(private_key, PrivateKey) else load_private_key(private_key)
    ref = parse_reference(reference) if isinstance(reference, str) else reference
    if _is_index(target, manifest_desc):
        # an index of variants: the manifest signature over its digest (same referrer layout);
        # files and chunks belong to each entry, signed on its own
        result = SignResult(
            str(manifest_desc.digest),
            key.key_id,
            sign_manifest(target, manifest_desc, key, signed_at=signed_at),
        )
        result.skipped["directorySignature"] = "an index has no files (each variant is signed on its own)"
        result.skipped["chunkTable"] = "an index has no weight layers"
        return result
    manifest = _fetch_manifest(target, manifest_desc)
    if manifest.digest != manifest_desc.digest:
        raise SigningError(
            f"{target.name}: fetched manifest is {manifest.digest}, not {manifest_desc.digest}"
        )
    table: ChunkTable | None = None
    if chunk_table is not False:
        # hashed before anything is written, so the writes are one short burst
        if isinstance(chunk_table, ChunkTable):
            table = chunk_table
        elif weight_layers(manifest):
            table = compute_chunk_table(target, manifest, chunk_size, aligned=aligned_chunks)
    longest = 0.0  # the slowest single referrer write: what a concurrent writer's update takes

    def timed(push: Callable[[], Descriptor]) -> Descriptor:
        nonlocal longest
        t = time.monotonic()
        desc = push()
        longest = max(longest, time.monotonic() - t)
        return desc

    signature = timed(lambda: sign_manifest(target, manifest_desc, key, confirm=False, signed_at=signed_at))
    result = SignResult(str(manifest_desc.digest), key.key_id, signature)
    if directory_signature:
        try:
            files = files_from_manifest(manifest)
        except SigningError as exc:
            result.skipped["directorySignature"] = str(exc)
        else:
            bundle = sign_statement(directory_statement(files, _model_name(target, manifest, ref)), key)
            result.directory_signature = timed(
                lambda: push_bundle_referrer(
                    target,
                    manifest_desc,
                    bundle,
                    artifact_type=ARTIFACT_TYPE_MODEL_SIGNATURE,
                    predicate_type=PREDICATE_MODEL_SIGNING,
                )
            )
    if table is not None:
        signed_table = table
        result.chunk_table = timed(lambda: push_chunk_table(target, manifest_desc, signed_table, key))
    elif chunk_table is not False:
        result.skipped["chunkTable"] = "no weight layers"
    written = [d for d in (result.signature, result.directory_signature, result.chunk_table) if d]
    confirm_referrers(target, manifest_desc, written, write_seconds=longest, events=events)
    return result


def write_directory_signature(
    target: ReadableTarget,
    manifest_desc: Descriptor,
    path: str | os.PathLike[str],
    trusted_keys: Sequence[PublicKey] | None = None,
) -> str:
    """Write the model_signing bundle of ``manifest_desc`` to ``path`` (e.g. ``DIR/model.sig``)
    so ``model_signing verify key --signature PATH --public_key PUB DIR`` can check the files.

    Picks a stored directory signature whose file list is exactly the manifest's (and, with
    ``trusted_keys``, signed by one of them); raises ``SigningError`` when there is none.
    """
    from modelpack.signing.verify import select_directory_bundle

    manifest = _fetch_manifest(target, manifest_desc)
    bundles: list[Bundle] = [
        item.bundle
        for item in find_bundle_referrers(target, manifest_desc, ARTIFACT_TYPE_MODEL_SIGNATURE)
        if item.bundle is not None
    ]
    chosen = select_directory_bundle(bundles, manifest, trusted_keys)
    if chosen is None:
        raise SigningError(
            f"{target.name}: {manifest_desc.digest} has no model_signing directory signature"
            + (" by a trusted key" if trusted_keys else "")
            + " matching its files"
        )
    p = os.fspath(path)
    atomic_write_bytes(p, chosen.to_bytes())
    return p
