"""Local names for cached manifests: references as resolved at pull time, and pins.

::

    refs/<key>.json     {reference, repository, digest, resolved_at}; key = sha256(reference)[:40]
    pins/<hex>          a pinned manifest (GC never evicts it)

A tag's record is what the last pull on this node resolved it to, so ``open_snapshot`` and
``pin`` work without the network. Records are read with a size and depth cap and a digest
check, and only when the cache owner wrote them (``mount.modes``): a damaged or planted one
reads as absent, never as a different model.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from typing import Any

from modelpack.mount.modes import DIR_MODE, FILE_MODE, ensure_dir, read_trusted

from modelpack.boundedjson import loads_object
from modelpack.errors import DocumentError, NotFoundError
from modelpack.files import atomic_write_bytes
from modelpack.oci.digest import Digest
from modelpack.oci.reference import Reference, parse_reference

MAX_REF_BYTES = 64 * 1024


def read_record(path: str, owner: int) -> dict[str, Any] | None:
    """A small JSON record naming a digest; None when missing, oversized, malformed or not the
    cache owner's."""
    raw = read_trusted(path, owner, MAX_REF_BYTES)
    if raw is None or len(raw) > MAX_REF_BYTES:
        return None
    try:
        doc = loads_object(raw, what=path, max_bytes=MAX_REF_BYTES)
        Digest(doc["digest"])
    except (DocumentError, ValueError, KeyError, TypeError):
        return None
    return doc


class RefRecords:
    """``refs/``: reference → manifest digest, one file per reference."""

    def __init__(self, cache_root: str, owner: int, *, create: bool = True) -> None:
        self.cache_root = cache_root
        self.owner = owner
        self.dir = os.path.join(cache_root, "refs")
        if create:
            ensure_dir(self.dir, DIR_MODE, owner)

    def path(self, reference: str) -> str:
        return os.path.join(self.dir, hashlib.sha256(reference.encode()).hexdigest()[:40] + ".json")

    def record(self, ref: Reference, digest: str) -> None:
        key = str(ref)
        path = self.path(key)
        current = read_record(path, self.owner)
        if current and current.get("digest") == digest:
            return
        doc = {"reference": key, "repository": ref.repo_name, "digest": digest, "resolved_at": time.time()}
        atomic_write_bytes(path, json.dumps(doc, sort_keys=True).encode(), mode=FILE_MODE)

    def all(self) -> list[dict[str, Any]]:
        """Every readable record, each with its file under ``_path``."""
        out: list[dict[str, Any]] = []
        if not os.path.isdir(self.dir):
            return out
        for entry in os.scandir(self.dir):
            if entry.name.endswith(".json"):
                doc = read_record(entry.path, self.owner)
                if doc:
                    doc["_path"] = entry.path
                    out.append(doc)
        return out

    def resolve_local(self, reference: str | Reference) -> Digest:
        """The manifest digest a reference stands for on this node, without any network I/O.

        A digest-pinned reference is itself; a tag is what the last pull resolved it to. A bare
        ``sha256:…`` names a cached manifest directly.
        """
        if isinstance(reference, str) and reference.startswith("sha256:"):
            return Digest(reference)
        ref = parse_reference(reference) if isinstance(reference, str) else reference
        if ref.digest:
            return ref.digest
        doc = read_record(self.path(str(ref.with_tag(ref.tag or "latest"))), self.owner)
        if doc is None:
            raise NotFoundError(f"{ref}: not in the node cache {self.cache_root} (pull it first)")
        return Digest(doc["digest"])

    def remove_to(self, digest: str) -> int:
        """Forget every reference that names ``digest``; returns how many."""
        n = 0
        for doc in self.all():
            if doc["digest"] == digest:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(doc["_path"])
                    n += 1
        return n


class Pins:
    """``pins/``: manifests GC must keep, whatever their age."""

    def __init__(self, cache_root: str, owner: int, *, create: bool = True) -> None:
        self.dir = os.path.join(cache_root, "pins")
        self.owner = owner
        if create:
            ensure_dir(self.dir, DIR_MODE, owner)

    def path(self, digest: str) -> str:
        return os.path.join(self.dir, Digest(digest).hex)

    def is_pinned(self, digest: str) -> bool:
        return read_trusted(self.path(digest), self.owner, MAX_REF_BYTES) is not None

    def add(self, digest: str, reference: str) -> None:
        ensure_dir(self.dir, DIR_MODE, self.owner)
        atomic_write_bytes(self.path(digest), json.dumps({"reference": reference}).encode(), mode=FILE_MODE)

    def remove(self, digest: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path(digest))
