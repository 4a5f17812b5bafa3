"""A snapshot's files, placed from committed store blobs: hard links for raw layers, extraction
for tar layers (bounded by one expansion budget), every path checked to stay inside the snapshot.

``Snapshots.build`` calls this on a private temp directory; nothing here publishes anything.
"""

from __future__ import annotations

import errno
import os
import shutil
from dataclasses import dataclass

from modelpack.mediatypes.annotations import layer_filepath
from modelpack.mount.modes import DIR_MODE, READ_ONLY_FILE_MODE
from modelpack.mount.store import Store

from modelpack.errors import ManifestError, SnapshotError, UnsafePathError
from modelpack.oci.descriptor import Descriptor, Manifest


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
    from modelpack.transfer.layer_formats import diff_ids_to_hash, manifest_layer_formats, needs_config
    from modelpack.transfer.untar import ExpansionBudget, extract_tar_layer

    formats = manifest_layer_formats(manifest)
    if config_raw is None and needs_config(manifest):
        raise SnapshotError(f"{manifest.digest}: image config missing")
    diff_ids = diff_ids_to_hash(manifest, config_raw)
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
                    diff_id=diff_ids[i],
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


def _safe_join(root: str, rel: str) -> str:
    target = os.path.join(root, *rel.split("/"))
    parent = os.path.realpath(os.path.dirname(target))
    if os.path.commonpath([os.path.realpath(root), parent]) != os.path.realpath(root):
        raise UnsafePathError(f"{rel!r} would land outside {root}")
    if os.path.lexists(target):
        raise ManifestError(f"{rel!r} appears twice")
    return target
