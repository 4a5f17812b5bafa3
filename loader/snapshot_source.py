"""Opening a snapshot directory (or, when the caller allows it, a plain directory) for a load.

A snapshot is leased from its node cache for the whole load and bound to the manifest whose
digest names it (``snapshot_binding``): files that are the store's committed blobs are served as
``trusted``, anything else is hashed against its layer digest, and files extracted from tar
layers are hashed against their own sha256 in the ready marker (``loader.hashing`` notice). A
plain directory has no digest: it is served only with ``--allow-unverified``, and then a pin or a
fingerprint fails closed.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from modelpack.loader import snapshot_binding
from modelpack.loader.weight_files import (
    MAX_CONFIG_BYTES,
    ResolvedSource,
    WeightFile,
    config_json_layer,
    file_opener,
    quantization_from_hf_config,
    read_small,
    weight_layers,
)

from modelpack.errors import (
    ExpectedDigestError,
    NotFoundError,
    SourceError,
    UnsafePathError,
    UnsignedSourceError,
    UnverifiedSourceError,
)
from modelpack.oci.descriptor import Manifest
from modelpack.oci.digest import Digest, verify_bytes

if TYPE_CHECKING:
    from modelpack.mount.cache import NodeCache

    from modelpack.oci.reference import Reference


def open_snapshot(
    path: str,
    *,
    expected_digest: str | None,
    allow_unverified: bool,
    direct: bool = False,
    trusted_keys: Sequence[Any] | None = None,
) -> ResolvedSource:
    """A snapshot directory bound to its manifest (see ``snapshot_binding``), or, if the caller
    allowed it, a plain directory. With ``trusted_keys`` the cache must have recorded that one of
    them verified the snapshot's signature (a key is never silently ignored)."""
    real = os.path.realpath(path)
    found = snapshot_binding.claim(real)
    if found is not None:
        if expected_digest and Digest(expected_digest) != found.digest:
            raise ExpectedDigestError(expected_digest, found.digest, source=real)
        try:
            snapshot_binding.require_store(found)
        except UnverifiedSourceError:
            if not allow_unverified or expected_digest:
                raise
        else:
            return _open_bound_snapshot(found, direct, trusted_keys)
    if not allow_unverified:
        raise UnverifiedSourceError(
            f"{real}: not a node-cache snapshot (no ready marker next to it); its bytes cannot be tied to a "
            "manifest digest. Load the path printed by 'modelpack pull --cache DIR REF', a pinned reference "
            "(REF@sha256:…), or pass --allow-unverified for a plain directory"
        )
    if expected_digest:
        raise UnverifiedSourceError(
            f"{real}: a plain directory has no manifest digest to compare with --expected-digest {expected_digest}"
        )
    files = []
    for dirpath, dirnames, filenames in os.walk(real):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for fname in sorted(filenames):
            if fname.endswith(".safetensors") and not fname.startswith("."):
                full = os.path.join(dirpath, fname)
                rel = os.path.relpath(full, real).replace(os.sep, "/")
                files.append(
                    WeightFile(
                        rel,
                        os.path.getsize(full),
                        file_opener(full, None, direct),
                        "trusted",
                        verification="unverified",
                    )
                )
    if not files:
        raise SourceError(f"{real}: no .safetensors files")
    hf = read_small(os.path.join(real, "config.json"))
    return ResolvedSource(
        real, None, None, files, False, quantization_from_hf_config(hf), "local", [], config=hf
    )


def _open_bound_snapshot(
    found: snapshot_binding.SnapshotClaim, direct: bool, trusted_keys: Sequence[Any] | None
) -> ResolvedSource:
    """Lease the snapshot, then tie its marker and files to the manifest in the cache's store."""
    from modelpack.mount.snapshots import Snapshots
    from modelpack.mount.store import Store

    real, digest = found.path, found.digest
    # the cache's reader lease (shared flock) for the whole load: GC cannot delete the files,
    # and the marker is re-read under it (GC removes the marker first, then the files)
    lease = Snapshots(Store(found.root, create=False)).lease(digest)
    try:
        info = lease.__enter__()
    except NotFoundError as exc:
        raise UnverifiedSourceError(
            f"{real}: not ready in its cache (no ready marker the cache owner wrote and nobody else can "
            f"write, or it was removed while opening it); pull it again with 'modelpack pull --cache "
            f"{found.root} REF@{digest}'"
        ) from exc

    def release() -> None:
        lease.__exit__(None, None, None)

    try:
        manifest = snapshot_binding.pinned_manifest(found)
        if trusted_keys and not snapshot_binding.verified_by(found, trusted_keys):
            raise UnsignedSourceError(
                f"{real}: no record that a --trusted-key verified the signature of {digest} on this node "
                "(the cache pulled it without a policy trusting those keys, or the record is not root's or "
                f"this user's). Pull it with 'modelpack pull --cache {found.root} --policy FILE "
                f"REF@{digest}', or load it without --trusted-key",
                [f.path for f in info.files if f.path.endswith(".safetensors")],
            )
        marker = [(f.path, f.digest, f.size, f.linked) for f in info.files]
        extracted = snapshot_binding.check_marker(found, marker, manifest, info.blob_digests())
        bound = snapshot_binding.bind_files(found, weight_layers(manifest, real, from_cache=True))
        bound += snapshot_binding.bind_extracted(found, extracted)
        files = []
        for b in bound:
            if b.trusted:
                opener = file_opener(b.path, b.layer.size, direct, identity=b.identity)
                files.append(
                    WeightFile(b.relpath, b.layer.size, opener, "trusted", descriptor=b.layer, mappable=True)
                )
            else:
                opener = file_opener(b.path, b.layer.size, direct)
                files.append(
                    WeightFile(
                        b.relpath, b.layer.size, opener, "whole", descriptor=b.layer, verification="hashed"
                    )
                )
        notices: list[tuple[str, dict[str, Any]]] = []
        rehash = [b for b in bound if not b.trusted and not b.extracted]
        hashed = [b for b in bound if b.extracted]
        if hashed:
            notices.append(
                (
                    "loader.hashing",
                    {
                        "files": [b.relpath for b in hashed],
                        "reason": f"{snapshot_binding.EXTRACTED_REASON} (tar layer snapshot)",
                    },
                )
            )
        if rehash:
            notices.append(
                (
                    "loader.rehashing",
                    {
                        "files": [b.relpath for b in rehash],
                        "reason": "; ".join(dict.fromkeys(b.reason for b in rehash))[:2000],
                    },
                )
            )
        config = _verified_snapshot_config(real, manifest, marker)
        quant = quantization_from_hf_config(config)
    except UnsafePathError as exc:
        release()
        raise SourceError(str(exc)) from exc
    except BaseException:
        release()
        raise
    return ResolvedSource(real, digest, manifest, files, False, quant, "hit", [release], notices, config)


def _verified_snapshot_config(
    real: str, manifest: Manifest, marker: list[tuple[str, str, int, bool]]
) -> bytes | None:
    """config.json as the manifest has it (it decides the fingerprint's quantization field): its
    raw layer's digest, or, extracted from a tar layer, its sha256 in the ready marker."""
    layer = config_json_layer(manifest)
    if layer is not None:
        digest, size = str(layer.digest), layer.size
    else:
        listed = [(d, s) for p, d, s, linked in marker if p == "config.json" and not linked]
        if not listed or listed[0][1] > MAX_CONFIG_BYTES:
            return None
        digest, size = listed[0]
    path = os.path.join(real, "config.json")
    data = read_small(path)
    if data is None:
        raise UnverifiedSourceError(f"{path}: missing from the snapshot")
    verify_bytes(data, digest, size, what="config.json", source=path)
    return data


def open_cache_pair(
    cache: NodeCache,
    reference: str | Reference,
    *,
    expected_digest: str | None,
    direct: bool,
    trusted_keys: Sequence[Any] | None,
) -> ResolvedSource:
    """``(NodeCache, reference)``: hold the cache's reader lease for the whole load."""
    # the cache resolves the reference locally (tags were resolved once, at pull time); a pin that
    # differs from what the tag points at is refused by open_snapshot's digest check below
    ctx = cache.open_snapshot(str(reference))
    info = ctx.__enter__()
    try:
        src = open_snapshot(
            info.path,
            expected_digest=expected_digest,
            allow_unverified=False,
            direct=direct,
            trusted_keys=trusted_keys,
        )
    except BaseException:
        ctx.__exit__(None, None, None)
        raise

    def release() -> None:
        ctx.__exit__(None, None, None)

    src._cleanup.insert(0, release)
    return src
