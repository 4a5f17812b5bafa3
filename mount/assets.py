"""Runtime assets in the node cache: stored like models, handed to a runtime as a writable view.

A runtime asset (``modelpack.assets``: a compile cache pushed as a referrer of a model) is an OCI
artifact like the model, so the node cache pulls it the same way — one download per node,
verified, resumable, published read-only under ``snapshots/<asset hex>/`` behind a ready marker,
with the same reader leases, pins and LRU GC. Two things differ, and live here:

- GC's ``keep_versions`` counts versions per repository *and artifact type*
  (``version_kind``), so a model's compile caches never push the model itself out;
- a runtime writes into its cache directory (new graphs, its own lock files), so a start does
  not point it at the read-only snapshot but at a writable view: a fresh directory tree of
  *copies* of the snapshot's files, built under the snapshot's reader lease. Never hard links: a
  hard link is the shared inode, so anyone editing a file of the view (root ignores the
  read-only mode) would change the snapshot every later replica takes as verified. Each file
  is hashed while it is copied and must match the digest in the snapshot's ready marker, so a
  view holds exactly the verified asset. The view survives a later GC of the snapshot.
"""

from __future__ import annotations

import hashlib
import os

from modelpack.mediatypes import is_model_artifact_type
from modelpack.mount.snapshots import Snapshots
from modelpack.mount.store import Store

from modelpack.errors import AssetError, DigestMismatchError, ModelpackError
from modelpack.oci.descriptor import Manifest, parse_manifest_or_index
from modelpack.oci.digest import HASH_CHUNK


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


def _copy_verified(src: str, dst: str, expected: str, mode: int) -> tuple[int, str]:
    """Copy ``src`` to the new file ``dst`` (``mode``, whatever the umask), hashing as it goes;
    raises ``DigestMismatchError`` unless the bytes hash to ``expected``."""
    h = hashlib.sha256()
    n = 0
    sfd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        dfd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            while True:
                chunk = os.read(sfd, HASH_CHUNK)
                if not chunk:
                    break
                h.update(chunk)
                n += len(chunk)
                view = memoryview(chunk)
                while view:
                    view = view[os.write(dfd, view) :]
            os.fchmod(dfd, mode)
        finally:
            os.close(dfd)
    finally:
        os.close(sfd)
    actual = "sha256:" + h.hexdigest()
    if actual != expected:
        raise DigestMismatchError(expected, actual, what=f"node-cache asset file {src}")
    return n, actual


def writable_view(
    snapshots: Snapshots, digest: str, dest: str, *, files: int, size: int
) -> list[tuple[str, int, str]]:
    """Fill the new, empty directory ``dest`` with verified copies of the ready snapshot
    ``digest``'s files; returns (relpath, bytes, sha256) per file. The snapshot must hold exactly
    ``files`` files of ``size`` bytes in all (what the asset's record declares) and fit in the
    free space, checked before the first byte is copied (``AssetError``). Holds the snapshot's
    reader lease while copying, so GC waits. Files are 0644 (0755 when executable in the snapshot)."""
    out: list[tuple[str, int, str]] = []
    with snapshots.lease(digest) as info:
        if (len(info.files), info.size) != (files, size):
            raise AssetError(
                f"{info.path}: {len(info.files)} files / {info.size} bytes in the node cache, the "
                f"asset's record says {files} / {size}; nothing copied"
            )
        st = os.statvfs(dest)
        if size > st.f_bavail * st.f_frsize:
            raise AssetError(f"{dest}: {size} bytes to copy, only {st.f_bavail * st.f_frsize} free")
        for entry in info.files:
            parts = entry.path.split("/")
            src = os.path.join(info.path, *parts)
            dst = os.path.join(dest, *parts)
            os.makedirs(os.path.dirname(dst), mode=0o755, exist_ok=True)
            executable = os.lstat(src).st_mode & 0o111
            size, sha = _copy_verified(src, dst, entry.digest, 0o755 if executable else 0o644)
            out.append((entry.path, size, sha))
    return out
