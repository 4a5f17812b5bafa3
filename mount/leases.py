"""Pull leases and holds: how pulls and hand-offs tell GC which digests to keep, meeting at ``locks/gc.lock``.

::

    leases/<pid>-<id>.json        {pid, manifest, digests}; the pull holds an exclusive flock on it
    leases/hold-<id>.json         {digest, until, reference}; ``pull --hold``: kept until ``until``
    locks/gc.lock                 pulls take it shared to register; GC and rm take it exclusive

A pull registers its lease under the shared lock, GC runs under the exclusive one, so GC sees
every running pull or runs entirely before it. A lease file nobody holds a flock on belongs to a
pull that died; reading the leases removes it.

A hold bridges the hand-off from a pull to the process that reads the snapshot (``pull --cache
--hold 10m`` in an init container, the server starting after it): it outlives the pull's process
and needs no running holder, and it expires on its own, so a reader that never comes cannot pin
the model forever. The reader takes its own lease when it opens the snapshot.

``leases/`` is ``0700`` and its files ``0600``, and ``gc.lock`` is ``0600``: another uid can
neither register leases nor hold the gate. Every wait on the gate is bounded (``mount.locks``).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from modelpack.mount.locks import exclusive_lock, shared_lock, try_exclusive
from modelpack.mount.modes import PRIVATE_DIR_MODE, ensure_dir, open_private, read_trusted

from modelpack.boundedjson import loads_object
from modelpack.errors import DocumentError
from modelpack.oci.digest import Digest

MAX_LEASE_BYTES = 16 * 1024 * 1024
HOLD_PREFIX = "hold-"


@dataclass
class Hold:
    """A time-limited promise to GC: keep ``digest`` until ``until`` (epoch seconds)."""

    path: str
    digest: str
    until: float


class PullLeases:
    """``leases/`` and the GC lock they are registered under."""

    def __init__(
        self, cache_root: str, locks_dir: str, *, owner: int, lock_timeout: float, create: bool = True
    ) -> None:
        self.dir = os.path.join(cache_root, "leases")
        self.gc_lock_path = os.path.join(locks_dir, "gc.lock")
        self.owner = owner
        self.lock_timeout = lock_timeout
        if create:
            ensure_dir(self.dir, PRIVATE_DIR_MODE, owner)

    def gc_exclusive(self) -> contextlib.AbstractContextManager[int]:
        """Held by GC and ``rm`` while they delete: no pull can register a lease meanwhile."""
        return exclusive_lock(self.gc_lock_path, timeout=self.lock_timeout, what="node cache GC gate")

    def _gate_shared(self) -> contextlib.AbstractContextManager[int]:
        return shared_lock(self.gc_lock_path, timeout=self.lock_timeout, what="node cache GC gate")

    @contextlib.contextmanager
    def hold(self, digests: list[str]) -> Iterator[None]:
        """Announce the digests this pull needs (``digests[0]`` is its manifest) while it runs."""
        path = os.path.join(self.dir, f"{os.getpid()}-{uuid.uuid4().hex[:12]}.json")
        with self._gate_shared():
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
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

    def add_hold(
        self, digest: str, seconds: float, reference: str, still_there: Callable[[], bool] | None = None
    ) -> Hold:
        """Keep ``digest`` from GC for ``seconds`` from now, registered at the gate like a pull.

        ``still_there`` is checked under the gate: a snapshot GC evicted before the hold was
        registered raises ``FileNotFoundError`` instead of being held."""
        until = time.time() + seconds
        path = os.path.join(self.dir, f"{HOLD_PREFIX}{uuid.uuid4().hex}.json")
        doc = {
            "digest": str(Digest(digest)),
            "until": until,
            "seconds": seconds,
            "reference": reference,
            "pid": os.getpid(),
        }
        with self._gate_shared():
            if still_there is not None and not still_there():
                raise FileNotFoundError(digest)
            fd = open_private(path, os.O_WRONLY, self.owner)
            try:
                os.write(fd, json.dumps(doc, sort_keys=True).encode())
                os.fsync(fd)
            finally:
                os.close(fd)
        return Hold(path, str(digest), until)

    def release_hold(self, path: str) -> bool:
        """End a hold early (the reader has its own lease now); True if it existed."""
        if os.path.dirname(os.path.abspath(path)) != self.dir or not os.path.basename(path).startswith(
            HOLD_PREFIX
        ):
            raise ValueError(f"{path}: not a hold of the node cache {os.path.dirname(self.dir)}")
        try:
            os.unlink(path)
        except FileNotFoundError:
            return False
        return True

    def holds(self, *, remove_expired: bool = False) -> list[Hold]:
        """Live holds; expired ones (and records the cache did not write) are removed when asked."""
        out = []
        now = time.time()
        for entry in list(os.scandir(self.dir)):
            if not entry.name.startswith(HOLD_PREFIX):
                continue
            hold = self._read_hold(entry.path, now, rewrite=remove_expired)
            if hold is not None and hold.until > now:
                out.append(hold)
            elif remove_expired:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
        return out

    def _read_hold(self, path: str, now: float, *, rewrite: bool) -> Hold | None:
        """A hold as the cache wrote it. One whose deadline lies further ahead than its own length
        (the clock stepped back after it was made) is cut to its length from now, and with
        ``rewrite`` recorded so: a hold never lasts longer than it was asked for."""
        try:
            raw = read_trusted(path, self.owner, MAX_LEASE_BYTES)
            if raw is None:
                return None
            doc = loads_object(raw, what=path, max_bytes=MAX_LEASE_BYTES)
            hold = Hold(path, str(Digest(str(doc["digest"]))), float(doc["until"]))
            seconds = float(doc.get("seconds", 0) or 0)
        except (OSError, DocumentError, ValueError, KeyError, TypeError):
            return None
        if seconds > 0 and hold.until - now > seconds + 1.0:
            hold.until = now + seconds
            if rewrite:
                with contextlib.suppress(OSError):
                    self._rewrite_hold(path, {**doc, "until": hold.until})
        return hold

    def _rewrite_hold(self, path: str, doc: dict[str, object]) -> None:
        tmp = f"{path}.{uuid.uuid4().hex[:8]}.tmp"
        fd = open_private(tmp, os.O_WRONLY, self.owner)
        try:
            os.write(fd, json.dumps(doc, sort_keys=True).encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)

    def active(self) -> tuple[list[str], set[str]]:
        """(manifest digests being pulled, every digest they need) from live pull leases."""
        manifests: list[str] = []
        out: set[str] = set()
        for entry in list(os.scandir(self.dir)):
            if entry.name.startswith(HOLD_PREFIX):
                continue
            fd = try_exclusive(entry.path)
            if fd is not None:  # nobody holds it: a crashed pull's lease
                os.close(fd)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
                continue
            try:
                raw = read_trusted(entry.path, self.owner, MAX_LEASE_BYTES)
                if raw is None:
                    continue
                doc = loads_object(raw or b"{}", what=entry.path, max_bytes=MAX_LEASE_BYTES)
                digests = doc.get("digests", [])
                if isinstance(digests, list):
                    out.update(str(d) for d in digests)
                if doc.get("manifest"):
                    manifests.append(str(doc["manifest"]))
            except (OSError, DocumentError):
                continue
        return manifests, out

    def active_digests(self) -> set[str]:
        return self.active()[1]
