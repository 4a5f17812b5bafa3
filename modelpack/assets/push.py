"""Publishing a compile cache as a runtime asset of a model, optionally signed.

The asset is a referrer of the model manifest (it never changes the model, its tags or its other
referrers), carrying the fingerprint of the environment the cache was built in. The push returns
only once the referrer is discoverable (``signing.referrers.confirm_referrers``: read back,
re-add what a concurrent writer of the fallback index dropped, ``AssetError`` if it stays lost). The push refuses
a fingerprint that can never match (an empty field) or that names another model: publishing an
asset nobody can use only costs every later pull a fetch.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

from modelpack.assets.archive import pack_cache
from modelpack.assets.environment import running_fingerprint
from modelpack.assets.fingerprint import EnvironmentFingerprint, empty_fields
from modelpack.assets.format import (
    ANNOTATION_TITLE,
    ARTIFACT_TYPE_RUNTIME_ASSET,
    MEDIA_TYPE_ASSET_CONFIG,
    MEDIA_TYPE_ASSET_LAYER,
    AssetRecord,
    manifest_annotations,
)
from modelpack.assets.kinds import get_kind
from modelpack.errors import AssetError
from modelpack.events import EventLog, NullEventLog
from modelpack.mediatypes import MEDIA_TYPE_OCI_MANIFEST
from modelpack.oci.descriptor import Descriptor, Manifest
from modelpack.oci.digest import Digest
from modelpack.oci.reference import Reference, parse_reference
from modelpack.signing.keys import PrivateKey, load_private_key
from modelpack.signing.manifest_signature import sign_manifest
from modelpack.signing.referrers import confirm_referrers, subject_descriptor
from modelpack.targets.base import bytes_blob_source, file_blob_source
from modelpack.targets.opener import TargetOptions, open_target
from modelpack.timestamps import rfc3339_utc

FingerprintSource = EnvironmentFingerprint | str | os.PathLike[str]


@dataclass
class AssetPushResult:
    reference: str
    model_digest: str
    kind: str
    asset: Descriptor
    fingerprint: EnvironmentFingerprint
    files: int
    bytes: int
    compressed_bytes: int
    signature: Descriptor | None = None
    key_id: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "reference": self.reference,
            "digest": self.model_digest,
            "kind": self.kind,
            "asset": str(self.asset.digest),
            "fingerprint": self.fingerprint.to_dict(),
            "fingerprintDigest": self.fingerprint.digest,
            "files": self.files,
            "bytes": self.bytes,
            "compressedBytes": self.compressed_bytes,
            "signature": str(self.signature.digest) if self.signature else None,
            "keyId": self.key_id or None,
        }


def created_timestamp() -> str:
    """``SOURCE_DATE_EPOCH`` when set (reproducible CI), else now, as RFC 3339 UTC."""
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    when = float(epoch) if epoch and epoch.isdigit() else time.time()
    return rfc3339_utc(when)


def load_fingerprint(source: FingerprintSource) -> EnvironmentFingerprint:
    return source if isinstance(source, EnvironmentFingerprint) else EnvironmentFingerprint.read(source)


def push_asset(
    model_ref: str | Reference,
    directory: str | os.PathLike[str],
    kind: str,
    *,
    fingerprint: FingerprintSource | None = None,
    device: Any = "cpu",
    tp_size: int = 1,
    dtype: str | None = None,
    quantization: str | None = None,
    sign_key: PrivateKey | str | None = None,
    passphrase: str | None = None,
    target_options: TargetOptions | None = None,
    events: EventLog | None = None,
) -> AssetPushResult:
    """Pack ``directory`` (a ``kind`` cache) and push it as a referrer of ``model_ref``'s manifest.

    Without ``fingerprint`` the cache is taken to have been built here, for this model on
    ``device`` with ``tp_size`` ranks (``dtype``/``quantization`` when the engine overrides them).
    """
    events = events or NullEventLog()
    asset_kind = get_kind(kind)
    ref = parse_reference(model_ref) if isinstance(model_ref, str) else model_ref
    target = open_target(ref, target_options, for_write=True)
    model = target.resolve(ref.identifier)
    if fingerprint is not None:
        fp = load_fingerprint(fingerprint)
    else:
        fp = running_fingerprint(
            target, model, device=device, tp_size=tp_size, dtype=dtype, quantization=quantization
        )
    if fp.manifest_digest != model.digest:
        raise AssetError(
            f"{ref}: the fingerprint is for model {fp.manifest_digest or '(none)'}, but {ref} is {model.digest}"
        )
    missing = empty_fields(fp)
    if missing:
        raise AssetError(
            f"{ref}: the {kind} fingerprint has empty fields {missing}; an empty field never matches, "
            "so nobody could use this asset (describe the build machine completely)"
        )
    key = None
    if sign_key is not None:
        key = sign_key if isinstance(sign_key, PrivateKey) else load_private_key(sign_key, passphrase)
    packed = pack_cache(os.fspath(directory), asset_kind)
    try:
        record = AssetRecord(kind, fp, packed.files, packed.bytes)
        config_bytes = record.to_bytes()
        config = Descriptor(MEDIA_TYPE_ASSET_CONFIG, Digest.from_bytes(config_bytes), len(config_bytes))
        layer = Descriptor(
            MEDIA_TYPE_ASSET_LAYER,
            packed.digest,
            packed.size,
            annotations={ANNOTATION_TITLE: f"{kind}-cache.tar.gz"},
        )
        target.push_blob(bytes_blob_source(config, config_bytes))
        target.push_blob(file_blob_source(layer, packed.path, verified=True))
    finally:
        packed.discard()
    manifest = Manifest.build(
        config,
        [layer],
        artifact_type=ARTIFACT_TYPE_RUNTIME_ASSET,
        subject=subject_descriptor(model),
        annotations=manifest_annotations(record, created_timestamp()),
    )
    started = time.monotonic()
    asset = target.push_manifest(manifest.raw, MEDIA_TYPE_OCI_MANIFEST, None)
    # on a registry without the referrers API the model's fallback index is a read-modify-write
    # that a concurrent push (another replica's cache, a signer) can overwrite: read it back
    confirm_referrers(
        target,
        model,
        [asset],
        write_seconds=time.monotonic() - started,
        events=events,
        what=f"{kind} asset",
        lost_event="assets.referrer_lost",
        consequence="the asset is not published — push it again",
        error=AssetError,
    )
    result = AssetPushResult(
        str(ref), str(model.digest), kind, asset, fp, packed.files, packed.bytes, packed.size
    )
    if key is not None:
        result.signature = sign_manifest(target, asset, key)
        result.key_id = key.key_id
    events.emit(
        "assets.pushed",
        reference=str(ref),
        digest=str(model.digest),
        kind=kind,
        asset=str(asset.digest),
        fingerprint_digest=fp.digest,
        files=packed.files,
        bytes=packed.bytes,
        signed=key is not None,
    )
    return result
