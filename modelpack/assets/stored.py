"""Finding a model's runtime assets and choosing the one built for exactly this environment.

Every candidate is read the same way a signature referrer is: the manifest fetched by digest and
hashed, its ``subject`` checked to be this model, its one layer and its config of the expected
types, the config (the fingerprint record) fetched by digest and bounded. Annotations in a
referrers listing are never trusted; they only let other kinds be skipped without a fetch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from modelpack.assets.fingerprint import Difference, EnvironmentFingerprint, differences
from modelpack.assets.format import (
    ANNOTATION_CREATED,
    ANNOTATION_KIND,
    ARTIFACT_TYPE_RUNTIME_ASSET,
    MAX_ASSET_BYTES,
    MAX_CONFIG_BYTES,
    MEDIA_TYPE_ASSET_CONFIG,
    AssetRecord,
    asset_layer_format,
)
from modelpack.errors import AssetError, ModelpackError, NotFoundError
from modelpack.mediatypes import BlobFormat
from modelpack.oci.descriptor import Descriptor, Manifest
from modelpack.oci.digest import verify_bytes
from modelpack.signing.referrers import subject_descriptor
from modelpack.targets.base import ReadableTarget

MAX_ASSET_REFERRERS = 1000  # per model; each candidate costs two small fetches


@dataclass(frozen=True)
class StoredAsset:
    """One asset referrer as read back; ``error`` says why it cannot be used (never dropped)."""

    descriptor: Descriptor
    manifest: Manifest | None = None
    record: AssetRecord | None = None
    error: str = ""

    @property
    def digest(self) -> str:
        return str(self.descriptor.digest)

    @property
    def created(self) -> str:
        ann = self.manifest.annotations if self.manifest else None
        return (ann or {}).get(ANNOTATION_CREATED, "")

    @property
    def layer(self) -> Descriptor:
        assert self.manifest is not None
        return self.manifest.layers[0]

    @property
    def layer_format(self) -> BlobFormat:
        """How the layer is framed (``read_asset`` refused any layer that is not a known tar)."""
        fmt = asset_layer_format(self.layer.media_type)
        if fmt is None:
            raise AssetError(f"asset {self.digest}: layer media type {self.layer.media_type!r} is not a tar")
        return fmt

    def to_json(self) -> dict[str, object]:
        doc: dict[str, object] = {"digest": self.digest, "created": self.created}
        if self.record is not None:
            doc.update(
                kind=self.record.kind,
                fingerprint=self.record.fingerprint.to_dict(),
                fingerprintDigest=self.record.fingerprint.digest,
                files=self.record.files,
                bytes=self.record.size,
                compressedBytes=self.layer.size,
            )
        if self.error:
            doc["error"] = self.error
        return doc


def read_asset(target: ReadableTarget, desc: Descriptor, model: Descriptor) -> StoredAsset:
    where = f"{target.name} asset {desc.digest}"
    try:
        raw, media_type = target.fetch_manifest(str(desc.digest))
        verify_bytes(raw, desc.digest, None, what="asset manifest", source=target.name)
        manifest = Manifest.parse(raw, media_type=media_type)
    except (ModelpackError, ValueError) as exc:
        return StoredAsset(desc, error=f"{where}: unreadable manifest: {exc}")
    problem = ""
    if manifest.artifact_type != ARTIFACT_TYPE_RUNTIME_ASSET:
        problem = f"artifactType {manifest.artifact_type!r}"
    elif manifest.subject is None or manifest.subject.digest != model.digest:
        problem = f"subject is {manifest.subject.digest if manifest.subject else 'none'}, not {model.digest}"
    elif len(manifest.layers) != 1 or asset_layer_format(manifest.layers[0].media_type) is None:
        problem = f"expected one tar layer, found {[layer.media_type for layer in manifest.layers]}"
    elif manifest.layers[0].size > MAX_ASSET_BYTES:
        problem = f"layer of {manifest.layers[0].size} bytes exceeds {MAX_ASSET_BYTES}"
    elif manifest.config.media_type != MEDIA_TYPE_ASSET_CONFIG or manifest.config.size > MAX_CONFIG_BYTES:
        problem = f"config {manifest.config.media_type!r} of {manifest.config.size} bytes"
    if problem:
        return StoredAsset(desc, manifest, error=f"{where}: {problem}")
    try:
        with target.fetch_blob(manifest.config) as f:
            data = f.read(manifest.config.size + 1)
        verify_bytes(
            data, manifest.config.digest, manifest.config.size, what="asset config", source=target.name
        )
        record = AssetRecord.from_bytes(data, where=f"{where} config")
    except (ModelpackError, OSError) as exc:
        return StoredAsset(desc, manifest, error=f"{where}: {exc}")
    declared = (manifest.annotations or {}).get(ANNOTATION_KIND)
    if declared != record.kind:
        return StoredAsset(
            desc, manifest, error=f"{where}: annotated kind {declared!r}, recorded {record.kind!r}"
        )
    return StoredAsset(desc, manifest, record)


def list_assets(target: ReadableTarget, model: Descriptor, kind: str | None = None) -> list[StoredAsset]:
    """The model's assets (of ``kind``), newest first; unreadable ones carry ``error``."""
    try:
        descs = target.referrers(subject_descriptor(model), ARTIFACT_TYPE_RUNTIME_ASSET)
    except NotFoundError:
        return []
    if len(descs) > MAX_ASSET_REFERRERS:
        raise AssetError(
            f"{target.name}: {model.digest} has {len(descs)} runtime-asset referrers; "
            f"refusing to examine more than {MAX_ASSET_REFERRERS} (prune old ones)"
        )
    out: list[StoredAsset] = []
    seen: set[str] = set()
    for desc in descs:
        if desc.digest in seen or desc.artifact_type not in (None, ARTIFACT_TYPE_RUNTIME_ASSET):
            continue
        seen.add(desc.digest)
        listed_kind = (desc.annotations or {}).get(ANNOTATION_KIND)
        if kind is not None and listed_kind is not None and listed_kind != kind:
            continue  # a lying listing can only hide an asset: the start is then cold, not wrong
        asset = read_asset(target, desc, model)
        if kind is not None and asset.record is not None and asset.record.kind != kind:
            continue
        out.append(asset)
    out.sort(key=lambda a: (a.created, a.digest), reverse=True)
    return out


@dataclass
class Selection:
    """Exact matches (newest first), else the nearest misses and what differs in each."""

    matches: list[StoredAsset] = field(default_factory=list)
    near_misses: list[tuple[StoredAsset, list[Difference]]] = field(default_factory=list)
    unusable: list[StoredAsset] = field(default_factory=list)

    @property
    def candidates(self) -> int:
        return len(self.matches) + len(self.near_misses) + len(self.unusable)

    @property
    def nearest(self) -> tuple[StoredAsset, list[Difference]] | None:
        return self.near_misses[0] if self.near_misses else None


def select(assets: list[StoredAsset], running: EnvironmentFingerprint) -> Selection:
    sel = Selection()
    for asset in assets:
        if asset.record is None:
            sel.unusable.append(asset)
            continue
        diffs = differences(asset.record.fingerprint, running)
        if diffs:
            sel.near_misses.append((asset, diffs))
        else:
            sel.matches.append(asset)
    sel.near_misses.sort(key=lambda item: len(item[1]))  # stable: newest first among equals
    return sel
