"""Runtime assets in the node cache: stored like models, handed to a runtime as a writable view.

A runtime asset (``modelpack.assets``: a compile cache pushed as a referrer of a model) is an OCI
artifact like the model, so the node cache pulls it the same way — one download per node,
verified, resumable, published read-only under ``snapshots/<asset hex>/`` behind a ready marker,
with the same reader leases, pins and LRU GC. Two things differ, and live here:

- GC's ``keep_versions`` counts versions per repository *and artifact type*
  (``version_kind``), so a model's compile caches never push the model itself out;
- a runtime writes into its cache directory (new graphs, its own lock files), so a start does
  not point it at the read-only snapshot but at a view: a fresh directory tree whose files are
  hard links into the snapshot (copies across filesystems), built under the snapshot's reader
  lease. The view costs no bytes, survives a later GC of the snapshot (the inodes stay), and a
  runtime that adds entries to it never touches the shared copy.
"""

from __future__ import annotations

import os

from modelpack.mediatypes import is_model_artifact_type
from modelpack.mount.snapshots import Snapshots
from modelpack.mount.store import Store

from modelpack.errors import ModelpackError
from modelpack.files import link_or_copy
from modelpack.oci.descriptor import Manifest, parse_manifest_or_index


def version_kind(store: Store, digest: str) -> str:
    """What a stored snapshot is a version *of*, for GC: "" for a model (either shape, or an
    unreadable manifest: treated as the model, the conservative choice), else its artifact type
    (e.g. a runtime asset)."""
    try:
        parsed = parse_manifest_or_index(store.read_small(digest))
    except (OSError, ModelpackError):
        return ""
    if not isinstance(parsed, Manifest) or parsed.artifact_type is None:
        return ""  # image-shaped models carry no artifactType
    return "" if is_model_artifact_type(parsed.artifact_type) else parsed.artifact_type


def writable_view(snapshots: Snapshots, digest: str, dest: str) -> tuple[int, int]:
    """Fill the new, empty directory ``dest`` with links to the ready snapshot ``digest``'s files;
    returns (files, bytes). Holds the snapshot's reader lease while linking, so GC waits."""
    files = size = 0
    with snapshots.lease(digest) as info:
        for entry in info.files:
            src = os.path.join(info.path, *entry.path.split("/"))
            dst = os.path.join(dest, *entry.path.split("/"))
            os.makedirs(os.path.dirname(dst), mode=0o755, exist_ok=True)
            link_or_copy(src, dst, mode="auto")
            files += 1
            size += entry.size
    return files, size
