"""Binding a snapshot directory to the manifest whose digest names it, before any file is trusted.

A directory named ``snapshots/<hex>`` with a ``<hex>.ready`` marker next to it proves nothing by
itself: anyone can create one, copy a marker, or edit a file. What the node cache does guarantee
is narrower, and this module checks exactly that:

- the directory sits in a node cache: ``oci-layout`` and ``blobs/sha256/`` at its root, and the
  manifest ``blobs/sha256/<hex>`` present and hashing to ``sha256:<hex>`` (the pin);
- the ready marker lists exactly the manifest's weight layers (path, digest, size), so the file
  list cannot be edited apart from the manifest;
- each weight file is the store's committed blob itself (same inode: a hard link), read-only,
  owned by root or by this process's user, in directories only those users can write.

A file that meets all of these was hashed when the cache committed it and nobody else can have
changed it since, so it is read without hashing (a hit stays a hit). A file that does not — a
copy, a replaced file, a blob left writable or owned by another user, a cache copied elsewhere —
is not refused outright: it is hashed against its layer digest while it is read, and the load
fails if it does not match. What is refused is a directory whose manifest is not in a store, or
whose marker disagrees with the manifest: then there is nothing to check the files against.

Files extracted from tar layers (the image-shaped variant, modelcars, modctl and ModelPack
``tar`` layers) are no store blob, so no inode can vouch for them: each is hashed while it is
read against its own sha256 as the ready marker records it (``check_marker`` says which checks
tie the marker to the manifest first, ``bind_extracted`` binds the files). The marker counts
only as the cache owner's, read under the reader lease (``mount.snapshots``), the same trust as
the cache's signature record; ``modelpack cache verify`` re-derives every file from the manifest.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from modelpack.loader.weight_files import tar_layer
from modelpack.mediatypes import BlobFormat
from modelpack.mediatypes.annotations import layer_filepath, safe_relative_path

from modelpack import boundedjson
from modelpack.errors import (
    DigestMismatchError,
    DocumentError,
    ManifestError,
    UnsafePathError,
    UnsupportedLayerError,
    UnverifiedSourceError,
)
from modelpack.oci.descriptor import Descriptor, Manifest
from modelpack.oci.digest import Digest, verify_bytes
from modelpack.transfer.layer_formats import layer_format

MAX_MANIFEST_BYTES = 4 * 1024 * 1024
_HEX_RE = re.compile(r"^[0-9a-f]{64}$")
_PLAIN_HINT = "or pass --allow-unverified to load it as a plain directory (no digest, no pin)"


def _uncompressed(manifest: Manifest, layer: Descriptor) -> bool:
    """A tar layer stored without compression: its blob holds at least its files' bytes."""
    try:
        return layer_format(manifest.config.media_type, layer.media_type).format is BlobFormat.TAR
    except UnsupportedLayerError:
        return False


def trusted_uids() -> frozenset[int]:
    """Who may own trusted cache files: root (a DaemonSet filling the cache) and this process's user."""
    return frozenset({0, os.geteuid()})


@dataclass(frozen=True)
class SnapshotClaim:
    """A path that claims to be ``<cache>/snapshots/<hex>`` with a ready marker."""

    path: str
    root: str
    digest: str

    @property
    def marker(self) -> str:
        return self.path + ".ready"


@dataclass(frozen=True)
class BoundFile:
    """One weight file of a snapshot and what vouches for it."""

    relpath: str
    path: str
    layer: Descriptor
    trusted: bool  # the store's committed blob: read without hashing
    reason: str  # why it must be hashed (empty when trusted)
    identity: tuple[int, int] | None  # (st_dev, st_ino) the opened file must still have
    extracted: bool = False  # from a tar layer: ``layer`` is the file's own digest and size


def claim(real: str) -> SnapshotClaim | None:
    """The claim ``real`` makes by its name and marker; None for a directory that makes none."""
    name = os.path.basename(real)
    parent = os.path.dirname(real)
    if not _HEX_RE.match(name) or os.path.basename(parent) != "snapshots":
        return None
    if not os.path.lexists(real + ".ready"):
        return None
    return SnapshotClaim(real, os.path.dirname(parent), "sha256:" + name)


def require_store(c: SnapshotClaim) -> None:
    """Refuse unless the claimed cache root holds a store (checked before anything opens it)."""
    layout = os.path.join(c.root, "oci-layout")
    blobs = os.path.join(c.root, "blobs", "sha256")
    if not os.path.isfile(layout) or os.path.islink(layout) or not os.path.isdir(blobs):
        raise UnverifiedSourceError(
            f"{c.path}: looks like a node-cache snapshot, but {c.root} is not a node cache (no oci-layout "
            f"and blobs/sha256/ store), so nothing ties its files to {c.digest}. Load the path printed by "
            f"'modelpack pull --cache DIR REF', {_PLAIN_HINT}"
        )


def pinned_manifest(c: SnapshotClaim) -> Manifest:
    """The manifest whose digest names the snapshot, read from the store and hashed against it."""
    path = os.path.join(c.root, "blobs", "sha256", Digest(c.digest).hex)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise UnverifiedSourceError(
            f"{c.path}: the manifest {c.digest} is not in the cache's store ({path}: {exc.strerror}), so "
            f"nothing ties the snapshot's files to it. Pull it again with 'modelpack pull --cache "
            f"{c.root} REF@{c.digest}', {_PLAIN_HINT}"
        ) from exc
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UnverifiedSourceError(f"{path}: the snapshot's manifest is not a regular file")
        with os.fdopen(fd, "rb", closefd=False) as f:
            raw = f.read(MAX_MANIFEST_BYTES + 1)
    finally:
        os.close(fd)
    if len(raw) > MAX_MANIFEST_BYTES:
        raise UnverifiedSourceError(f"{path}: manifest larger than {MAX_MANIFEST_BYTES} bytes")
    try:
        verify_bytes(raw, c.digest, None, what="manifest", source=c.root)
        return Manifest.parse(raw)
    except (DigestMismatchError, ManifestError) as exc:
        raise UnverifiedSourceError(
            f"{c.path}: the store's manifest {c.digest} is not usable: {exc}"
        ) from exc


# what an extracted file's descriptor says it is (it is no layer of the manifest)
EXTRACTED_MEDIA_TYPE = "application/vnd.modelpack.extracted-file"
EXTRACTED_REASON = (
    "extracted from the manifest's tar layers, so not a store blob that can be trusted by inode: "
    "hashed while it is read against its own sha256 in the ready marker"
)


def check_marker(
    c: SnapshotClaim,
    marker_files: list[tuple[str, str, int, bool]],
    manifest: Manifest,
    blobs: set[str] | None = None,
) -> list[tuple[str, Descriptor]]:
    """Check the marker against the manifest; return the weight files extracted from tar layers.

    ``marker_files``: (path, digest, size, linked) as the ready marker lists them; ``blobs``: the
    marker's blob list. Raw weight layers must be listed exactly (path, digest, size, as hard
    links). Files extracted from tar layers cannot be listed from the manifest without reading the
    tar layers again (``modelpack cache verify`` does), so the marker's own per-file digests are
    used — the marker is the cache owner's (the lease read it) — after checking what is cheap: the
    manifest has tar layers at all, their blobs are in the store at their size, the marker's blob
    list is the manifest's, every path is safe and listed once, and uncompressed tar layers hold at
    least the bytes the marker says came out of them. A returned descriptor carries the file's
    own digest and size (``EXTRACTED_MEDIA_TYPE``)."""
    expected: dict[str, tuple[str, int]] = {}
    tars: list[Descriptor] = []
    for layer in manifest.layers:
        try:
            rel = layer_filepath(layer.annotations)
        except UnsafePathError as exc:
            raise UnverifiedSourceError(f"{c.path}: manifest layer {layer.digest}: {exc}") from exc
        if tar_layer(layer):
            tars.append(layer)
        elif rel and rel.endswith(".safetensors"):
            expected[rel] = (str(layer.digest), layer.size)
    listed = {p: (d, s, linked) for p, d, s, linked in marker_files if p.endswith(".safetensors")}
    problems = []
    for rel, (digest, size) in sorted(expected.items()):
        got = listed.get(rel)
        if got is None:
            problems.append(f"{rel}: in the manifest, missing from the marker")
        elif (got[0], got[1]) != (digest, size) or not got[2]:
            problems.append(f"{rel}: marker says {got[0]} ({got[1]} B), the manifest {digest} ({size} B)")
    problems += [
        f"{rel}: in the marker, not in the manifest"
        for rel, (_d, _s, linked) in sorted(listed.items())
        if rel not in expected and linked
    ]
    extracted: list[tuple[str, Descriptor]] = []
    seen: set[str] = set()
    total = 0
    for path, digest, size, linked in marker_files:
        if linked:
            continue
        try:
            rel = safe_relative_path(path, what="ready marker path")
            desc = Descriptor(EXTRACTED_MEDIA_TYPE, Digest(digest), size)
        except (UnsafePathError, ValueError) as exc:
            problems.append(f"{path!r}: {exc}")
            continue
        if not tars:
            problems.append(f"{rel}: listed as extracted from a tar layer, but the manifest has none")
        elif rel in seen or size < 0:
            problems.append(f"{rel}: listed twice, or with a negative size")
        elif rel.endswith(".safetensors") and rel not in expected:
            extracted.append((rel, desc))
        seen.add(rel)
        total += max(size, 0)
    if tars:
        wanted = {str(manifest.config.digest), *(str(layer.digest) for layer in manifest.layers)}
        if blobs is not None and set(blobs) != wanted:
            problems.append(
                f"the marker's blobs are not the manifest's config and layers ({len(wanted)} blobs)"
            )
        store = os.path.join(c.root, "blobs", "sha256")
        for layer in tars:
            try:
                st = os.lstat(os.path.join(store, Digest(layer.digest).hex))
                ok = stat.S_ISREG(st.st_mode) and st.st_size == layer.size
            except OSError:
                ok = False
            if not ok:
                problems.append(f"tar layer {layer.digest}: not in the store at its size ({layer.size} B)")
        uncompressed = [layer for layer in tars if _uncompressed(manifest, layer)]
        if len(uncompressed) == len(tars) and total > sum(layer.size for layer in tars):
            problems.append(
                f"the marker lists {total} B of extracted files, more than the tar layers hold "
                f"({sum(layer.size for layer in tars)} B)"
            )
    if problems:
        raise UnverifiedSourceError(
            f"{c.marker}: the ready marker does not match manifest {c.digest}: "
            + "; ".join(problems[:10])
            + ". Run 'modelpack cache verify' and pull again"
        )
    return extracted


def verified_by(c: SnapshotClaim, keys: Sequence[Any]) -> bool:
    """Whether the cache recorded that one of ``keys`` verified this digest's signature.

    The record (``snapshots/<hex>.trust.json``, written by the cache after a pull under a policy)
    counts only as root's or this user's read-only-to-others file: whoever owns a copied or fake
    cache could write any record into it."""
    from modelpack.mount.modes import read_trusted
    from modelpack.mount.trust import MAX_TRUST_BYTES

    path = c.path + ".trust.json"
    try:
        raw = read_trusted(path, os.geteuid(), MAX_TRUST_BYTES)
        if raw is None or len(raw) > MAX_TRUST_BYTES:
            return False
        doc = boundedjson.loads_object(raw, what=path, max_bytes=MAX_TRUST_BYTES)
    except (OSError, DocumentError):
        return False
    recorded = doc.get("key_ids")
    if doc.get("digest") != c.digest or not isinstance(recorded, list):
        return False
    wanted = {getattr(k, "key_id", None) for k in keys} - {None}
    return bool(wanted & {str(k) for k in recorded})


def _dir_reason(path: str, uids: frozenset[int]) -> str:
    try:
        st = os.lstat(path)
    except OSError as exc:
        return f"{path}: {exc.strerror}"
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a directory"
    if st.st_uid not in uids:
        return f"{path} is owned by uid {st.st_uid}"
    if stat.S_IMODE(st.st_mode) & 0o022:
        return f"{path} is writable by group or others ({stat.S_IMODE(st.st_mode):o})"
    return ""


def bind_files(c: SnapshotClaim, layers: list[tuple[str, Descriptor]]) -> list[BoundFile]:
    """Decide, per weight file, whether it is the store's committed blob (trusted) or must be hashed."""
    uids = trusted_uids()
    store_dir = os.path.join(c.root, "blobs", "sha256")
    shared = ""
    for d in (c.root, os.path.join(c.root, "blobs"), store_dir, os.path.dirname(c.path), c.path):
        shared = shared or _dir_reason(d, uids)
    out = []
    for rel, layer in layers:
        path = os.path.join(c.path, *rel.split("/"))
        try:
            st = os.lstat(path)
        except OSError as exc:
            raise UnverifiedSourceError(f"{path}: {exc.strerror}; the snapshot is incomplete") from exc
        if not stat.S_ISREG(st.st_mode):
            raise UnverifiedSourceError(f"{path}: not a regular file; a snapshot holds files only")
        reason = shared
        parent = os.path.dirname(path)
        while not reason and parent != c.path:
            reason = _dir_reason(parent, uids)
            parent = os.path.dirname(parent)
        blob = os.path.join(store_dir, Digest(layer.digest).hex)
        if not reason:
            try:
                bst = os.lstat(blob)
            except OSError:
                bst = None
            if bst is None:
                reason = f"its blob {layer.digest} is not in the store"
            elif (bst.st_dev, bst.st_ino) != (st.st_dev, st.st_ino):
                reason = f"{rel} is not the store's blob {layer.digest} (not a hard link of it)"
            elif st.st_uid not in uids:
                reason = f"{rel} is owned by uid {st.st_uid}"
            elif stat.S_IMODE(st.st_mode) & 0o222:
                reason = f"{rel} is writable ({stat.S_IMODE(st.st_mode):o}); committed blobs are read-only"
            elif st.st_size != layer.size:
                reason = f"{rel} is {st.st_size} bytes, the manifest says {layer.size}"
        trusted = not reason
        out.append(BoundFile(rel, path, layer, trusted, reason, (st.st_dev, st.st_ino) if trusted else None))
    return out


def bind_extracted(c: SnapshotClaim, files: list[tuple[str, Descriptor]]) -> list[BoundFile]:
    """Files extracted from tar layers: never trusted, hashed against the marker's per-file digest.

    The file must be a regular file inside the snapshot (no symlink, no path through one)."""
    real_root = os.path.realpath(c.path)
    out = []
    for rel, desc in files:
        path = os.path.join(c.path, *rel.split("/"))
        try:
            st = os.lstat(path)
        except OSError as exc:
            raise UnverifiedSourceError(
                f"{path}: {exc.strerror}; the ready marker lists it but the snapshot does not hold it"
            ) from exc
        if not stat.S_ISREG(st.st_mode):
            raise UnverifiedSourceError(f"{path}: not a regular file; a snapshot holds files only")
        if os.path.commonpath([real_root, os.path.realpath(path)]) != real_root:
            raise UnverifiedSourceError(f"{path}: reached through a symlink that leaves the snapshot")
        out.append(BoundFile(rel, path, desc, False, EXTRACTED_REASON, None, extracted=True))
    return out
