"""The wire format of a runtime asset: an OCI referrer of the model manifest.

::

    manifest  application/vnd.oci.image.manifest.v1+json
      artifactType  application/vnd.modelpack.runtime-asset.v1+json
      config        application/vnd.modelpack.runtime-asset.config.v1+json   (the record below)
      layers        [application/vnd.oci.image.layer.v1.tar+gzip]             (the cache directory)
      subject       the model manifest
      annotations   dev.modelpack.asset.kind, dev.modelpack.asset.fingerprint(.digest),
                    org.opencontainers.image.created

The config blob is the record a pull decides on: ``{"kind", "fingerprint": {…},
"fingerprintDigest", "files", "bytes"}``. The annotations repeat kind and fingerprint so that
``audit``, ``oras discover`` and a referrers listing show them without a blob fetch; a pull reads
them only to skip other kinds early and trusts nothing it did not fetch by digest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from modelpack.assets.fingerprint import EnvironmentFingerprint
from modelpack.boundedjson import loads
from modelpack.errors import AssetFingerprintError, DocumentError
from modelpack.mediatypes import (
    BlobFormat,
    LayerKind,
    layer_media_type,
    parse_media_type,
)
from modelpack.oci.descriptor import canonical_json

ARTIFACT_TYPE_RUNTIME_ASSET = "application/vnd.modelpack.runtime-asset.v1+json"
MEDIA_TYPE_ASSET_CONFIG = "application/vnd.modelpack.runtime-asset.config.v1+json"
#: the asset's one layer: the cache directory as a gzip tar (``assets.archive`` writes it)
MEDIA_TYPE_ASSET_LAYER = layer_media_type(LayerKind.IMAGE, BlobFormat.TAR_GZIP)

ANNOTATION_KIND = "dev.modelpack.asset.kind"
ANNOTATION_FINGERPRINT = "dev.modelpack.asset.fingerprint"
ANNOTATION_FINGERPRINT_DIGEST = "dev.modelpack.asset.fingerprint.digest"
ANNOTATION_CREATED = "org.opencontainers.image.created"
ANNOTATION_TITLE = "org.opencontainers.image.title"

MAX_CONFIG_BYTES = 256 * 1024
#: Bounds on what one asset may unpack to; compile caches of large models reach a few GiB.
MAX_ASSET_BYTES = 64 * 1024**3
MAX_ASSET_FILES = 500_000


@dataclass(frozen=True)
class AssetRecord:
    """What an asset's config blob says: its kind, the fingerprint it was built under, its size."""

    kind: str
    fingerprint: EnvironmentFingerprint
    files: int
    size: int  # bytes of all files, unpacked

    def to_bytes(self) -> bytes:
        return canonical_json(
            {
                "kind": self.kind,
                "fingerprint": self.fingerprint.to_dict(),
                "fingerprintDigest": self.fingerprint.digest,
                "files": self.files,
                "bytes": self.size,
            }
        )

    @classmethod
    def from_bytes(cls, raw: bytes, *, where: str) -> AssetRecord:
        try:
            doc: Any = loads(raw, what=where, max_bytes=MAX_CONFIG_BYTES)
        except DocumentError as exc:
            raise AssetFingerprintError(str(exc)) from exc
        if not isinstance(doc, dict):
            raise AssetFingerprintError(f"{where}: the asset config is a JSON object")
        unknown = sorted(set(doc) - {"kind", "fingerprint", "fingerprintDigest", "files", "bytes"})
        if unknown:
            raise AssetFingerprintError(f"{where}: unknown keys {unknown} (written by a newer modelpack?)")
        kind, files, size = doc.get("kind"), doc.get("files"), doc.get("bytes")
        if not isinstance(kind, str) or not kind:
            raise AssetFingerprintError(f"{where}: no kind")
        for name, v, top in (("files", files, MAX_ASSET_FILES), ("bytes", size, MAX_ASSET_BYTES)):
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= top:
                raise AssetFingerprintError(f"{where}: {name} must be an integer in [0, {top}], got {v!r}")
        fp = EnvironmentFingerprint.from_dict(doc.get("fingerprint"), where=f"{where} fingerprint")
        if doc.get("fingerprintDigest") != fp.digest:
            raise AssetFingerprintError(
                f"{where}: fingerprintDigest {doc.get('fingerprintDigest')!r} does not match the fields"
            )
        assert isinstance(files, int) and isinstance(size, int)
        return cls(kind, fp, files, size)


def asset_layer_format(media_type: str) -> BlobFormat | None:
    """How an asset's layer is framed: any OCI image layer tar the vocabulary names (written as
    ``tar+gzip``; the tar reader decompresses what the media type says); None for anything else."""
    lt = parse_media_type(media_type)
    if lt is None or lt.kind is not LayerKind.IMAGE or lt.legacy:
        return None
    return lt.format


def manifest_annotations(record: AssetRecord, created: str) -> dict[str, str]:
    return {
        ANNOTATION_KIND: record.kind,
        ANNOTATION_FINGERPRINT: canonical_json(record.fingerprint.to_dict()).decode(),
        ANNOTATION_FINGERPRINT_DIGEST: record.fingerprint.digest,
        ANNOTATION_CREATED: created,
    }
