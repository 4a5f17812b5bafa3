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
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from modelpack.mediatypes.annotations import layer_filepath

from modelpack import boundedjson
from modelpack.errors import (
    DigestMismatchError,
    DocumentError,
    ManifestError,
    UnsafePathError,
    UnverifiedSourceError,
)
from modelpack.oci.descriptor import Descriptor, Manifest
from modelpack.oci.digest import Digest, verify_bytes

MAX_MANIFEST_BYTES = 4 * 1024 * 1024
_HEX_RE = re.compile(r"^[0-9a-f]{64}$")
_PLAIN_HINT = "or pass --allow-unverified to load it as a plain directory (no digest, no pin)"


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


def check_marker(
    c: SnapshotClaim, marker_files: list[tuple[str, str, int, bool]], manifest: Manifest
) -> None:
    """The marker's weight files must be exactly the manifest's weight layers (path, digest, size).

    ``marker_files``: (path, digest, size, linked) as the ready marker lists them."""
    expected: dict[str, tuple[str, int]] = {}
    for layer in manifest.layers:
        try:
            rel = layer_filepath(layer.annotations)
        except UnsafePathError as exc:
            raise UnverifiedSourceError(f"{c.path}: manifest layer {layer.digest}: {exc}") from exc
        if rel and rel.endswith(".safetensors"):
            expected[rel] = (str(layer.digest), layer.size)
    listed = {p: (d, s, linked) for p, d, s, linked in marker_files if p.endswith(".safetensors")}
    problems = []
    for rel, (digest, size) in sorted(expected.items()):
        got = listed.get(rel)
        if got is None:
            problems.append(f"{rel}: in the manifest, missing from the marker")
        elif (got[0], got[1]) != (digest, size) or not got[2]:
            problems.append(f"{rel}: marker says {got[0]} ({got[1]} B), the manifest {digest} ({size} B)")
    problems += [f"{rel}: in the marker, not in the manifest" for rel in sorted(set(listed) - set(expected))]
    if problems:
        raise UnverifiedSourceError(
            f"{c.marker}: the ready marker does not match manifest {c.digest}: "
            + "; ".join(problems[:10])
            + ". Run 'modelpack cache verify' and pull again"
        )


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
