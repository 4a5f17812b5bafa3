"""Which repository of a registry holds a blob this user pushed: where a later push mounts it from.

A registry mounts a blob into a new repository in one request (``POST …/blobs/uploads/?mount=D
&from=REPO``) instead of an upload, but only when the client names a repository that holds it.
Pushing a directory has no source repository to name, so every push remembers, per registry
host, the repository each blob went to; the next push of the same blobs to another repository
of that registry mounts them from there (and ``--mount-from REPO`` names one explicitly).

The record is a hint, never trusted: a wrong or stale entry only costs one request, because the
registry checks that ``REPO`` holds the blob and otherwise opens a normal upload. It lives in the
per-user upload state (``$MODELPACK_PUSH_RECORD``, else ``pushed-blobs.json`` in
``$MODELPACK_UPLOAD_STATE_DIR``, else in ``$XDG_CACHE_HOME/modelpack/uploads``),
0600 in a 0700 directory, bounded to ``MAX_ENTRIES`` digests (the oldest are forgotten), and read
with size and depth bounds; an unreadable record is ignored, as if empty.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterable

from modelpack import settings
from modelpack.boundedjson import loads_object
from modelpack.errors import DocumentError
from modelpack.files import atomic_write_bytes

RECORD_NAME = "pushed-blobs.json"
MAX_ENTRIES = 50_000
MAX_RECORD_BYTES = 16 * 1024 * 1024
#: repositories tried per blob (the explicit hints first, then the record's)
MAX_CANDIDATES = 3


def record_path() -> str:
    explicit = settings.PUSH_RECORD.get()
    if explicit:
        return explicit
    root = settings.UPLOAD_STATE_DIR.get()
    if not root:
        cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(cache, "modelpack", "uploads")
    return os.path.join(root, RECORD_NAME)


class PushedBlobs:
    """digest → repository, per registry host, most recent last (thread-safe)."""

    def __init__(self, path: str | None = None) -> None:
        self.path = path or record_path()
        self._hosts: dict[str, dict[str, str]] = {}
        self._lock = threading.Lock()
        self._load()

    def _load(self) -> None:
        try:
            with open(self.path, "rb") as f:
                raw = f.read(MAX_RECORD_BYTES + 1)
            doc = loads_object(raw, what=self.path, max_bytes=MAX_RECORD_BYTES, max_depth=4)
        except (OSError, DocumentError):
            return  # no record yet, or one not worth trusting even as a hint
        hosts = doc.get("registries")
        if not isinstance(hosts, dict):
            return
        for host, blobs in hosts.items():
            if isinstance(blobs, dict):
                self._hosts[host] = {d: r for d, r in blobs.items() if isinstance(r, str) and r}

    def repositories(self, host: str, digest: str) -> list[str]:
        with self._lock:
            repo = self._hosts.get(host, {}).get(digest)
        return [repo] if repo else []

    def remember(self, host: str, repository: str, digests: Iterable[str]) -> None:
        with self._lock:
            blobs = self._hosts.setdefault(host, {})
            for d in digests:
                blobs.pop(d, None)
                blobs[d] = repository
            total = sum(len(b) for b in self._hosts.values())
            for blobs in self._hosts.values():
                while total > MAX_ENTRIES and blobs:
                    blobs.pop(next(iter(blobs)))
                    total -= 1

    def save(self) -> None:
        """Write the record atomically; a record that cannot be written is only a lost hint."""
        with self._lock:
            data = json.dumps({"version": 1, "registries": self._hosts}, separators=(",", ":")).encode()
        try:
            os.makedirs(os.path.dirname(self.path), mode=0o700, exist_ok=True)
            atomic_write_bytes(self.path, data, mode=0o600)
        except OSError:
            pass


def mount_candidates(
    record: PushedBlobs | None, host: str, repository: str, digest: str, hints: Iterable[str]
) -> list[str]:
    """Repositories to mount ``digest`` from into ``repository``: the hints, then the record."""
    out: list[str] = []
    for repo in (*hints, *(record.repositories(host, digest) if record else [])):
        if repo and repo != repository and repo not in out:
            out.append(repo)
    return out[:MAX_CANDIDATES]


__all__ = ["MAX_ENTRIES", "PushedBlobs", "mount_candidates", "record_path"]
