"""Fetch a manifest or config from any target, verified against the digest it resolved to."""

from __future__ import annotations

from modelpack.errors import ManifestError
from modelpack.oci.descriptor import Index, Manifest, parse_manifest_or_index
from modelpack.oci.digest import verify_bytes
from modelpack.targets.base import ReadableTarget


def fetch_manifest(target: ReadableTarget, identifier: str) -> tuple[Manifest, str]:
    """Resolve and fetch a manifest, verified against the digest it resolved to."""
    desc = target.resolve(identifier)
    raw, media_type = target.fetch_manifest(str(desc.digest))
    verify_bytes(raw, desc.digest, None, what="manifest", source=target.name)
    parsed = parse_manifest_or_index(raw, media_type)
    if isinstance(parsed, Index):
        raise ManifestError(f"{target.name} {identifier}: is an index, not a model manifest")
    return parsed, str(desc.digest)


def fetch_config(target: ReadableTarget, manifest: Manifest, *, limit: int = 4 * 1024 * 1024) -> bytes:
    desc = manifest.config
    if desc.size > limit:
        raise ManifestError(f"config {desc.digest} is {desc.size} bytes; refusing more than {limit}")
    with target.fetch_blob(desc) as f:
        data = f.read(desc.size + 1)
    verify_bytes(data, desc.digest, desc.size, what="config", source=target.name)
    return data
