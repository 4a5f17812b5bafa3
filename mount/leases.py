"""Pull leases: how a running pull tells GC which digests it needs, meeting at ``locks/gc.lock``.

::

    leases/<pid>-<id>.json   {pid, manifest, digests}; the pull holds an exclusive flock on it
    locks/gc.lock            pulls take it shared to register a lease; GC and rm take it exclusive

A pull registers its lease under the shared lock, GC runs under the exclusive one, so GC sees
every running pull or runs entirely before it. A lease file nobody holds a flock on belongs to a
pull that died; reading the leases removes it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import uuid
from collections.abc import Iterator

from modelpack.mount.locks import exclusive_lock, shared_lock, try_exclusive

MAX_LEASE_BYTES = 16 * 1024 * 1024


class PullLeases:
    """``leases/`` and the GC lock they are registered under."""

    def __init__(self, cache_root: str, locks_dir: str) -> None:
        self.dir = os.path.join(cache_root, "leases")
        self.gc_lock_path = os.path.join(locks_dir, "gc.lock")

    def gc_exclusive(self) -> contextlib.AbstractContextManager[int]:
        """Held by GC and ``rm`` while they delete: no pull can register a lease meanwhile."""
        return exclusive_lock(self.gc_lock_path)

    @contextlib.contextmanager
    def hold(self, digests: list[str]) -> Iterator[None]:
        """Announce the digests this pull needs (``digests[0]`` is its manifest) while it runs."""
        path = os.path.join(self.dir, f"{os.getpid()}-{uuid.uuid4().hex[:12]}.json")
        with shared_lock(self.gc_lock_path):
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.write(
                fd, json.dumps({"pid": os.getpid(), "manifest": digests[0], "digests": digests}).encode()
            )
        try:
            yield
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            os.close(fd)

    def active(self) -> tuple[list[str], set[str]]:
        """(manifest digests being pulled, every digest they need) from live pull leases."""
        manifests: list[str] = []
        out: set[str] = set()
        for entry in list(os.scandir(self.dir)):
            fd = try_exclusive(entry.path)
            if fd is not None:  # nobody holds it: a crashed pull's lease
                os.close(fd)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
                continue
            try:
                with open(entry.path, "rb") as f:
                    doc = json.loads(f.read(MAX_LEASE_BYTES) or b"{}")
                out.update(str(d) for d in doc.get("digests", []))
                if doc.get("manifest"):
                    manifests.append(str(doc["manifest"]))
            except (OSError, ValueError):
                continue
        return manifests, out

    def active_digests(self) -> set[str]:
        return self.active()[1]
