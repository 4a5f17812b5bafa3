"""Fill-on-miss for ``cache serve``: the peer that owns a blob fetches it once from the origin.

In a release storm no peer holds anything at t=0, so without this every node misses at its
peers and goes to the origin (origin egress = N × the model). With ``cache serve --fill REF@DIGEST``
and ``MODELPACK_PEER_ORDER=blob`` on the pulling nodes (each blob asked first of its *owner*, the
peer chosen by rendezvous hashing on the blob digest — the same owner on every node), a miss at
the owner for a blob of a pinned manifest makes it fetch that blob once from the origin
(single-flight per digest), verify it, commit it to its store and serve it to everyone waiting:
origin egress ≈ 1 × the model, spread over the owners. Dragonfly's seed peer and Spegel's
pull-through are the precedent; the difference is that nothing here is trusted: every byte is
verified by digest on the way in and again by every client.

What a requester controls is only the path of its GET (and its bearer token). The fill is
therefore bounded by what the *operator* pinned, never by the request:

- only blobs referenced by a manifest given with ``--fill REF@sha256:…`` (the digests the node
  pre-warms), and those manifests themselves, can be filled; any other digest is a plain miss
  (404), so a hostile requester cannot make a peer fetch arbitrary content or fill its disk;
- the repository a blob is fetched from is the pinned reference's, never the request's name;
- the origin is asked with the serving node's own credentials (its docker config / environment);
  the requester's ``Authorization`` header is never forwarded;
- bytes are verified (size and sha256) before the commit; an origin serving wrong bytes commits
  nothing, and the digest is refused for ``retry_after_s`` so a flood cannot turn one bad blob
  into unbounded origin traffic;
- at most ``concurrency`` fills at once (a miss beyond that waits for a free one), a requester
  waits at most ``wait_s`` in all (below the client's stall limit; then ``503`` with
  ``Retry-After``: it asks its next source, and a started fill goes on for the next requester),
  and at most ``quota`` bytes are fetched from the origin over the process's life (default:
  twice the pinned manifests' total).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

from modelpack.mount.store import Store

from modelpack.errors import CacheServeError, ModelpackError
from modelpack.files import TEMP_PREFIX
from modelpack.oci.descriptor import Descriptor, Manifest
from modelpack.oci.digest import Digest
from modelpack.oci.reference import parse_reference
from modelpack.targets.base import ReadableTarget
from modelpack.targets.options import TargetOptions

log = logging.getLogger("modelpack.mount.serve")

_CHUNK = 1024 * 1024
#: pinned manifests a server fills for, at most
MAX_PINNED = 64
#: the origin's retry budget and per-read timeout for a fill (a requester is waiting)
ORIGIN_RETRY_FOR_S = 5.0
ORIGIN_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class FillSettings:
    """What ``cache serve --fill`` may fetch, and how much of it at once."""

    references: tuple[str, ...]
    plain_http: bool = False
    concurrency: int = 4
    wait_s: float = 8.0
    quota: int | None = None  # bytes fetched from the origin over the process's life
    retry_after_s: float = 5.0
    options: TargetOptions = field(default_factory=TargetOptions)


@dataclass
class _Pinned:
    target: ReadableTarget
    digest: str
    raw: bytes = b""
    blobs: dict[str, Descriptor] = field(default_factory=dict)


@dataclass
class FillStats:
    filled: int = 0
    filled_bytes: int = 0
    origin_bytes: int = 0  # including fills that failed verification
    failed: int = 0
    refused: int = 0  # not a pinned digest
    busy: int = 0  # concurrency or quota reached


#: outcomes of ``Filler.fill``
READY, MISS, BUSY = "ready", "miss", "busy"


class Filler:
    """Fills misses for the blobs of pinned manifests from their origin, once per digest."""

    def __init__(self, store: Store, settings: FillSettings) -> None:
        if not settings.references:
            raise CacheServeError("--fill needs at least one REF@sha256:… reference")
        if len(settings.references) > MAX_PINNED:
            raise CacheServeError(f"--fill: at most {MAX_PINNED} pinned references")
        if settings.concurrency < 1:
            raise CacheServeError("--fill-concurrency must be at least 1")
        self.store = store
        self.settings = settings
        self.stats = FillStats()
        self._pinned: list[_Pinned] = []
        for text in settings.references:
            ref = parse_reference(text)
            if ref.scheme != "registry" or ref.digest is None:
                raise CacheServeError(
                    f"--fill {text!r}: a registry reference pinned by digest (REF@sha256:…)"
                )
            opts = replace(
                settings.options,
                plain_http=settings.plain_http or settings.options.plain_http,
                # a requester waits on the fill: the origin gets a short budget, not a pull's 60 s
                retry_for=min(settings.options.retry_for or ORIGIN_RETRY_FOR_S, ORIGIN_RETRY_FOR_S),
                timeout=min(settings.options.timeout or ORIGIN_TIMEOUT_S, ORIGIN_TIMEOUT_S),
            )
            self._pinned.append(_Pinned(_origin_target(text, opts.bound_to(ref)), str(ref.digest)))
        self._lock = threading.Lock()
        self._loaded = False
        self._load_again_at = 0.0  # after a failed manifest fetch: not before this (monotonic)
        self._inflight: dict[str, threading.Event] = {}
        self._failed_until: dict[str, float] = {}
        self._slots = threading.BoundedSemaphore(settings.concurrency)

    # ------------------------------------------------------------------ what may be filled
    def _load(self) -> None:
        """Fetch each pinned manifest by digest (verified by the target) once, on first need."""
        with self._lock:
            if self._loaded or time.monotonic() < self._load_again_at:
                return  # a flood of misses while the origin is down costs one fetch per interval
            total = 0
            for pin in self._pinned:
                if pin.raw:
                    continue
                try:
                    raw, media_type = pin.target.fetch_manifest(pin.digest)
                    manifest = Manifest.parse(raw, media_type=media_type)
                except ModelpackError as exc:
                    log.warning("fill: cannot read pinned manifest %s: %s", pin.digest, exc)
                    continue
                if Digest.from_bytes(raw) != pin.digest:  # the target verifies; say it here too
                    log.warning("fill: origin's manifest for %s has another digest", pin.digest)
                    continue
                pin.raw = raw
                pin.blobs = {str(d.digest): d for d in (manifest.config, *manifest.layers)}
                total += manifest.total_size + len(raw)
            self._loaded = all(pin.raw for pin in self._pinned)
            if not self._loaded:
                self._load_again_at = time.monotonic() + self.settings.retry_after_s
            if self.settings.quota is None and self._loaded:
                self._quota = 2 * total

    _quota: int | None = None

    @property
    def quota(self) -> int | None:
        return self.settings.quota if self.settings.quota is not None else self._quota

    def _lookup(self, digest: str) -> tuple[_Pinned, Descriptor | None] | None:
        self._load()
        for pin in self._pinned:
            if pin.digest == digest and pin.raw:
                return pin, None
            if digest in pin.blobs:
                return pin, pin.blobs[digest]
        return None

    # ------------------------------------------------------------------ filling
    def fill(self, hex_digest: str) -> str:
        """Make ``sha256:<hex>`` committed if it may be filled: READY when it now is, MISS when
        it may not be filled (or failed), BUSY when the caller should ask elsewhere for now."""
        digest = "sha256:" + hex_digest
        found = self._lookup(digest)
        if found is None:
            with self._lock:
                self.stats.refused += 1
            return MISS
        pin, desc = found
        deadline = time.monotonic() + self.settings.wait_s
        with self._lock:
            if self._failed_until.get(digest, 0.0) > time.monotonic():
                return MISS
            event = self._inflight.get(digest)
        if event is None:
            event = self._start(digest, pin, desc, deadline)
            if event is None:
                return BUSY
        if not event.wait(max(0.0, deadline - time.monotonic())):
            return BUSY
        return READY if os.path.exists(self.store.blob_path(digest)) else MISS

    def _start(
        self, digest: str, pin: _Pinned, desc: Descriptor | None, deadline: float
    ) -> threading.Event | None:
        """The fill of ``digest`` (started here, or by whoever started it while this requester
        waited for a free slot), or None when no slot freed up before ``deadline`` or the quota
        is spent (BUSY: the requester asks its next source)."""
        if not self._slots.acquire(timeout=max(0.0, deadline - time.monotonic())):
            with self._lock:
                self.stats.busy += 1
            return None
        with self._lock:
            event = self._inflight.get(digest)
            if event is not None:  # another requester started it while this one queued
                self._slots.release()
                return event
            size = desc.size if desc is not None else len(pin.raw)
            quota = self.quota
            if quota is not None and self.stats.origin_bytes + size > quota:
                self._slots.release()
                self.stats.busy += 1
                log.warning("fill: quota of %d bytes reached; %s not filled", quota, digest)
                return None
            event = threading.Event()
            self._inflight[digest] = event
        threading.Thread(
            target=self._run, args=(digest, pin, desc, event), name="modelpack-fill", daemon=True
        ).start()
        return event

    def _run(self, digest: str, pin: _Pinned, desc: Descriptor | None, event: threading.Event) -> None:
        try:
            if desc is None:
                self.store.put_bytes(
                    Descriptor("application/octet-stream", Digest(digest), len(pin.raw)), pin.raw
                )
            elif not self.store.has(desc):
                self._fetch(pin.target, desc)
            with self._lock:
                self.stats.filled += 1
                self.stats.filled_bytes += desc.size if desc is not None else len(pin.raw)
        except Exception as exc:  # any failure is a miss for the requester, logged
            log.warning("fill: %s from %s failed: %s", digest, pin.target.name, exc)
            with self._lock:
                self.stats.failed += 1
                self._failed_until[digest] = time.monotonic() + self.settings.retry_after_s
        finally:
            with self._lock:
                self._inflight.pop(digest, None)
            self._slots.release()
            event.set()

    def _fetch(self, target: ReadableTarget, desc: Descriptor) -> None:
        """Stream ``desc`` from the origin into a private temp file; commit only if it verifies."""
        tmp = os.path.join(
            self.store.ingest_dir, f"{TEMP_PREFIX}fill-{desc.digest.hex[:16]}-{uuid.uuid4().hex[:8]}"
        )
        h = hashlib.sha256()
        n = 0
        start = time.monotonic()
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "wb") as f, target.fetch_blob(desc) as stream:
                while n <= desc.size:
                    data = stream.read(min(_CHUNK, desc.size + 1 - n))
                    if not data:
                        break
                    n += len(data)
                    with self._lock:
                        self.stats.origin_bytes += len(data)
                    h.update(data)
                    f.write(data)
                if n != desc.size:
                    raise CacheServeError(f"origin sent {n} bytes for {desc.digest}, expected {desc.size}")
                if "sha256:" + h.hexdigest() != desc.digest:
                    raise CacheServeError(f"origin's bytes for {desc.digest} hash to sha256:{h.hexdigest()}")
                f.flush()
                os.fsync(f.fileno())
            self.store.commit(tmp, desc.digest)
            log.info(
                "fill: %s (%d bytes) from %s in %.2f s", desc.digest, n, target.name, time.monotonic() - start
            )
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    def close(self) -> None:
        for pin in self._pinned:
            with contextlib.suppress(Exception):
                close = getattr(pin.target, "close", None)
                if close is not None:
                    close()


def _origin_target(text: str, options: TargetOptions) -> ReadableTarget:
    """The pinned reference's registry, never through mirrors (a fill asking peers would loop)."""
    from modelpack.targets.opener import open_readable

    target = open_readable(text, options)
    if getattr(target, "mirrors", None) is not None:
        target.mirrors = None  # type: ignore[attr-defined]
    return target


def fill_stats(filler: Filler | None) -> dict[str, Any]:
    return {} if filler is None else dict(vars(filler.stats))


__all__ = ["BUSY", "MISS", "READY", "FillSettings", "FillStats", "Filler"]
