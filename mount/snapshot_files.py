"""A snapshot's files, placed from committed store blobs: hard links for raw layers, extraction
for tar layers (bounded by one expansion budget), every path checked to stay inside the snapshot.

``Snapshots.build`` calls this on a private temp directory; nothing here publishes anything.
"""

from __future__ import annotations

import errno
import os
import shutil
from dataclasses import dataclass
from typing import TYPE_CHECKING

from modelpack.mediatypes import BlobFormat
from modelpack.mediatypes.annotations import layer_filepath
from modelpack.mount.modes import DIR_MODE, READ_ONLY_FILE_MODE
from modelpack.mount.store import Store

from modelpack.errors import DigestMismatchError, ManifestError, SnapshotError, UnsafePathError
from modelpack.oci.descriptor import Descriptor, Manifest

if TYPE_CHECKING:  # transfer's modules load lazily: a cache hit never imports them
    from modelpack.transfer.layer_formats import LayerFormat


@dataclass
class SnapshotFile:
    path: str
    digest: str
    size: int
    linked: bool  # True: hard link of the blob (its digest is the file's); False: extracted


def materialise(
    store: Store,
    manifest: Manifest,
    config_raw: bytes | None,
    dest: str,
    max_expanded: int | None,
    expansion_limit: str,
) -> list[SnapshotFile]:
    from modelpack.oci.image_config import image_diff_ids
    from modelpack.transfer.layer_formats import manifest_layer_formats, needs_config
    from modelpack.transfer.untar import ExpansionBudget, extract_tar_layer

    formats = manifest_layer_formats(manifest)
    diff_ids: list[str] = []
    if needs_config(manifest):
        if config_raw is None:
            raise SnapshotError(f"{manifest.digest}: image config missing")
        diff_ids = image_diff_ids(config_raw, len(manifest.layers), where=str(manifest.digest))
    files: list[SnapshotFile] = []
    seen: set[str] = set()
    # one budget for all tar layers: the bytes they write together are capped
    budget = ExpansionBudget(max_expanded, expansion_limit)
    for i, (layer, fmt) in enumerate(zip(manifest.layers, formats, strict=True)):
        if fmt.is_tar:
            with open(store.blob_path(layer.digest), "rb") as blob:
                extracted = extract_tar_layer(
                    blob,
                    dest,
                    strip=fmt.strip,
                    blob_format=fmt.format,
                    diff_id=_diff_id_to_hash(layer, fmt, diff_ids[i]) if fmt.diff_id else None,
                    where=f"layer {layer.digest}",
                    existing=seen,
                    budget=budget,
                    outside=fmt.outside,
                )
            for path, size, digest in extracted:
                seen.add(path)
                files.append(SnapshotFile(path, digest, size, False))
            continue
        rel = raw_layer_path(manifest, layer)
        if rel in seen:
            raise ManifestError(f"{manifest.digest}: two layers claim the path {rel!r}")
        seen.add(rel)
        target = _safe_join(dest, rel)
        os.makedirs(os.path.dirname(target), mode=DIR_MODE, exist_ok=True)
        src = store.blob_path(layer.digest)
        try:
            os.link(src, target, follow_symlinks=False)
        except OSError as exc:
            if exc.errno not in (errno.EMLINK, errno.EXDEV, errno.EPERM):
                raise
            shutil.copyfile(src, target)
            os.chmod(target, READ_ONLY_FILE_MODE)
        files.append(SnapshotFile(rel, str(layer.digest), layer.size, True))
    return files


def raw_layer_path(manifest: Manifest, layer: Descriptor) -> str:
    """Where a raw layer's file sits in the snapshot (its title annotation, checked for safety)."""
    try:
        rel = layer_filepath(layer.annotations)
    except UnsafePathError as exc:
        raise ManifestError(f"{manifest.digest} layer {layer.digest}: {exc}") from exc
    if rel is None:
        raise ManifestError(
            f"{manifest.digest} layer {layer.digest}: no file path annotation; cannot place it in a snapshot"
        )
    return rel


def _diff_id_to_hash(layer: Descriptor, fmt: LayerFormat, diff_id: str) -> str | None:
    """The diff_id extraction must hash the tar stream for, or None when it is already vouched for.

    An uncompressed layer's tar stream is its blob, and the store committed the blob only after
    hashing it to ``layer.digest``: its diff_id must be that digest (a string compare), and hashing
    the same bytes again would be the extraction's costliest step for nothing.
    """
    if fmt.format is not BlobFormat.TAR:
        return diff_id
    if diff_id != layer.digest:
        raise DigestMismatchError(diff_id, layer.digest, what=f"layer {layer.digest} diff_id (uncompressed)")
    return None


def _safe_join(root: str, rel: str) -> str:
    target = os.path.join(root, *rel.split("/"))
    parent = os.path.realpath(os.path.dirname(target))
    if os.path.commonpath([os.path.realpath(root), parent]) != os.path.realpath(root):
        raise UnsafePathError(f"{rel!r} would land outside {root}")
    if os.path.lexists(target):
        raise ManifestError(f"{rel!r} appears twice")
    return target
