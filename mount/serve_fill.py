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
  pre-warms), and those manifests themselves, can be filled (for a pinned variant index: every
  entry's manifest, fetched by digest and verified, at most ``MAX_INDEX_ENTRIES``, and its
  blobs); any other digest is a plain miss (404), so a hostile requester cannot make a peer
  fetch arbitrary content or fill its disk;
- each pinned manifest is fetched on its own thread, outside the lock that misses and fills
  share: a miss waits (at most ``wait_s``) only until the manifest naming its digest loaded, so
  one pinned manifest stalling at the origin never holds up another model's requesters;
- the repository a blob is fetched from is the pinned reference's, never the request's name;
- the origin is asked with the serving node's own credentials (its docker config / environment);
  the requester's ``Authorization`` header is never forwarded;
- bytes are verified (size and sha256) before the commit; an origin serving wrong bytes commits
  nothing, and the digest is refused for ``retry_after_s`` so a flood cannot turn one bad blob
  into unbounded origin traffic;
- at most ``concurrency`` fills at once (a miss beyond that waits for a free one), a requester
  waits at most ``wait_s`` for a slot and then for each next byte (below the client's stall
  limit; before the first byte ``503`` with ``Retry-After``, later the response is cut: it asks
  its next source, and a started fill goes on for the next requester), and at most ``quota``
  bytes are fetched from the origin over the process's life (default: twice the pinned
  manifests' total).

A fill streams to its requesters as the origin's bytes land (:class:`~modelpack.mount.fill_stream.Fill`,
why that is safe: its docstring).

Stopping (``Filler.close``, run when ``CacheServer.serve_forever`` returns: a signal or
``shutdown``) starts no new fill, stops the running ones at their next read and waits a bounded
time for them to remove their temp files (removing what is left itself); a new ``Filler`` first
removes the fill temp files a killed server left (unlocked ``.tmp-modelpack-fill-*``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from dataclasses import dataclass, field, replace

from modelpack.mount.fill_stream import DONE, FAILED, RUNNING, WAKE_S, Fill
from modelpack.mount.locks import is_locked
from modelpack.mount.modes import READ_ONLY_FILE_MODE
from modelpack.mount.refs import Pins
from modelpack.mount.store import FULL_CACHE_HINT, LockedTemp, Store

from modelpack.errors import CacheServeError, ModelpackError, TransferCancelled
from modelpack.files import TEMP_PREFIX, write_error
from modelpack.oci.descriptor import Descriptor, Index, Manifest, parse_manifest_or_index
from modelpack.oci.digest import Digest
from modelpack.oci.reference import parse_reference
from modelpack.targets.base import Closable, ReadableTarget
from modelpack.targets.options import TargetOptions
from modelpack.transfer.blob_writer import Landing, Partial, WriteHooks, fetch_verified

log = logging.getLogger("modelpack.mount.serve")

_CHUNK = 1024 * 1024
#: a fill's temp file in ``ingest/``: TEMP_PREFIX + this + …
_FILL_TAG = "fill-"
#: a fill reads the origin in pieces this small so its readers follow closely (a read blocks
#: until the whole piece arrived: 1 MiB on a slow link would hold the first byte back seconds)
_FILL_CHUNK = 256 * 1024
#: pinned manifests a server fills for, at most
MAX_PINNED = 64
#: entries of one pinned variant index that are filled, at most
MAX_INDEX_ENTRIES = 64
#: the index.json annotation naming the ``--fill`` reference a manifest is kept for
FILL_ANNOTATION = "io.modelpack.cache.fill"
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
    """A ``--fill`` reference: once loaded, the manifests it names (itself; for a variant index
    also every entry's manifest) by digest, with their media types, and every blob they name."""

    target: ReadableTarget
    digest: str
    reference: str
    docs: dict[str, tuple[bytes, str]] = field(default_factory=dict)
    blobs: dict[str, Descriptor] = field(default_factory=dict)
    total: int = 0  # bytes of every manifest and blob it names
    loading: bool = False
    load_again_at: float = 0.0  # after a failed load: not before this (monotonic)

    @property
    def loaded(self) -> bool:
        return bool(self.docs)


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
            self._pinned.append(_Pinned(_origin_target(text, opts.bound_to(ref)), str(ref.digest), str(ref)))
        self._lock = threading.Lock()  # state only: never held across network or disk I/O
        self._loads = threading.Condition(self._lock)  # notified when a pinned manifest loads
        self._inflight: dict[str, Fill] = {}
        self._failed_until: dict[str, float] = {}
        self._slots = threading.BoundedSemaphore(settings.concurrency)
        self._closing = threading.Event()
        self._threads: set[threading.Thread] = set()
        self._sweep_dead_temps()

    # ------------------------------------------------------------------ what may be filled
    def _load_pin(self, pin: _Pinned) -> None:
        """Fetch ``pin``'s manifest by digest (and, for a variant index, every entry's manifest
        by digest), verified, outside every lock: a pinned manifest that stalls at the origin
        holds up only the requesters of its own blobs."""
        try:
            docs, blobs = self._fetch_pinned(pin)
        except Exception as exc:  # any failure: logged, tried again after retry_after_s
            log.warning("fill: cannot read pinned manifest %s: %s", pin.digest, exc)
            with self._loads:
                pin.loading = False
                pin.load_again_at = time.monotonic() + self.settings.retry_after_s
                self._loads.notify_all()
            return
        for digest, (raw, media_type) in docs.items():
            self._record(pin, digest, raw, media_type)
        with self._loads:
            pin.docs, pin.blobs = docs, blobs
            pin.total = sum(d.size for d in blobs.values()) + sum(len(raw) for raw, _ in docs.values())
            pin.loading = False
            self._loads.notify_all()

    def _fetch_pinned(self, pin: _Pinned) -> tuple[dict[str, tuple[bytes, str]], dict[str, Descriptor]]:
        raw, media_type = pin.target.fetch_manifest(pin.digest)
        if Digest.from_bytes(raw) != pin.digest:  # the target verifies; say it here too
            raise CacheServeError(f"the origin's manifest for {pin.digest} has another digest")
        docs = {pin.digest: (raw, media_type)}
        parsed = parse_manifest_or_index(raw, media_type)
        manifests: list[Manifest] = []
        if isinstance(parsed, Index):  # a variant index: every entry (peers of any platform)
            if len(parsed.manifests) > MAX_INDEX_ENTRIES:
                raise CacheServeError(f"{pin.digest}: more than {MAX_INDEX_ENTRIES} entries")
            for entry in parsed.manifests:
                entry_raw, entry_type = pin.target.fetch_manifest(str(entry.digest))
                if Digest.from_bytes(entry_raw) != entry.digest:
                    raise CacheServeError(f"the origin's manifest for {entry.digest} has another digest")
                entry_doc = parse_manifest_or_index(entry_raw, entry_type or entry.media_type)
                if isinstance(entry_doc, Index):
                    raise CacheServeError(f"{pin.digest}: entry {entry.digest} is itself an index")
                docs[str(entry.digest)] = (entry_raw, entry_type or entry.media_type)
                manifests.append(entry_doc)
        else:
            manifests.append(parsed)
        blobs = {str(d.digest): d for m in manifests for d in (m.config, *m.layers)}
        return docs, blobs

    def _record(self, pin: _Pinned, digest: str, raw: bytes, media_type: str) -> None:
        """Commit a pinned manifest (or an entry of a pinned index) and enter it in
        ``index.json`` (``FILL_ANNOTATION``: the reference); the pinned digest is also pinned:
        GC keeps what a node fills for its peers while the pin stands (an index keeps its
        entries), and frees it after ``cache unpin`` or ``cache rm --force`` of that reference.
        A record that cannot be written (a full disk) leaves the fill working; GC then may
        take its blobs, the peers refill."""
        try:
            try:
                self.store.add_manifest(raw, media_type, annotations={FILL_ANNOTATION: pin.reference})
            except OSError as exc:  # the blob's own commit names its path; index.json's did not
                raise write_error(self.store.index_path, exc) from exc
            if digest == pin.digest:
                pins = Pins(self.store.root, self.store.owner)
                try:
                    pins.add(pin.digest, pin.reference)
                except OSError as exc:
                    raise write_error(pins.path(pin.digest), exc) from exc
        except ModelpackError as exc:
            log.warning(
                "fill: cannot record pinned manifest %s (fills go on; cache gc may take them): %s",
                digest,
                exc,
            )

    @property
    def quota(self) -> int | None:
        """Bytes fills may take from the origin over the process's life: ``--fill-quota``, else
        twice what the pinned manifests loaded so far name (None before any has loaded)."""
        if self.settings.quota is not None:
            return self.settings.quota
        loaded = [pin.total for pin in self._pinned if pin.loaded]
        return 2 * sum(loaded) if loaded else None

    def _find(self, digest: str) -> tuple[_Pinned, Descriptor] | None:
        for pin in self._pinned:
            if digest in pin.docs:
                raw, media_type = pin.docs[digest]
                return pin, Descriptor(media_type, Digest(digest), len(raw))
            if digest in pin.blobs:
                return pin, pin.blobs[digest]
        return None

    def _lookup(self, digest: str, deadline: float) -> tuple[_Pinned, Descriptor] | str:
        """The pin that names ``digest`` and its descriptor; MISS when no loaded pin names it and
        none is loading, BUSY when pins still load at ``deadline``. Loads start here (one at a
        time per pin, each on its own thread) and a lookup waits only until its digest is found:
        a pin that stalls never holds up the others' requesters."""
        with self._loads:
            while True:
                found = self._find(digest)
                if found is not None:
                    return found
                now = time.monotonic()
                for pin in self._pinned:
                    if not pin.loaded and not pin.loading and now >= pin.load_again_at:
                        pin.loading = True
                        threading.Thread(
                            target=self._load_pin, args=(pin,), name="modelpack-fill-load", daemon=True
                        ).start()
                if not any(pin.loading for pin in self._pinned):
                    return MISS
                if now >= deadline or self._closing.is_set():
                    return BUSY
                self._loads.wait(min(deadline - now, WAKE_S))

    # ------------------------------------------------------------------ filling
    def fill(self, hex_digest: str) -> str:
        """Make ``sha256:<hex>`` committed if it may be filled: READY when it now is, MISS when
        it may not be filled (or failed), BUSY when the caller should ask elsewhere for now."""
        deadline = time.monotonic() + self.settings.wait_s
        got = self.stream(hex_digest)
        if isinstance(got, str):
            return got
        _, state = got.wait(got.size, max(0.0, deadline - time.monotonic()))
        if state == RUNNING:
            return BUSY
        return READY if state == DONE and os.path.exists(self.store.blob_path(got.digest)) else MISS

    def stream(self, hex_digest: str) -> Fill | str:
        """The fill of ``sha256:<hex>`` in flight (joined, or started here) for the caller to
        stream from; MISS when it may not be filled (or failed just now), BUSY when no fill slot
        freed up within ``wait_s`` or the quota is spent."""
        digest = "sha256:" + hex_digest
        deadline = time.monotonic() + self.settings.wait_s
        found = self._lookup(digest, deadline)
        if isinstance(found, str):
            with self._lock:
                if found == MISS:
                    self.stats.refused += 1
                else:
                    self.stats.busy += 1
            return found
        pin, desc = found
        with self._lock:
            if self._failed_until.get(digest, 0.0) > time.monotonic():
                return MISS
            fill = self._inflight.get(digest)
        if fill is None:
            fill = self._start(digest, pin, desc, deadline)
        return BUSY if fill is None else fill

    def _start(self, digest: str, pin: _Pinned, desc: Descriptor, deadline: float) -> Fill | None:
        """The fill of ``digest`` (started here, or by whoever started it while this requester
        waited for a free slot), or None when no slot freed up before ``deadline`` or the quota
        is spent (BUSY: the requester asks its next source)."""
        if not self._slots.acquire(timeout=max(0.0, deadline - time.monotonic())):
            with self._lock:
                self.stats.busy += 1
            return None
        with self._lock:
            fill = self._inflight.get(digest)
            if fill is not None:  # another requester started it while this one queued
                self._slots.release()
                return fill
            if self._closing.is_set():  # shutting down: no new fill (and no new temp file)
                self._slots.release()
                return None
            size = desc.size
            quota = self.quota
            if quota is not None and self.stats.origin_bytes + size > quota:
                self._slots.release()
                self.stats.busy += 1
                log.warning("fill: quota of %d bytes reached; %s not filled", quota, digest)
                return None
            fill = Fill(digest, size)
            self._inflight[digest] = fill
            thread = threading.Thread(
                target=self._run, args=(pin, desc, fill), name="modelpack-fill", daemon=True
            )
            self._threads.add(thread)
        thread.start()
        return fill

    def _run(self, pin: _Pinned, desc: Descriptor, fill: Fill) -> None:
        state = FAILED
        try:
            if desc.digest in pin.docs:
                raw, _ = pin.docs[str(desc.digest)]
                self.store.put_bytes(Descriptor("application/octet-stream", desc.digest, len(raw)), raw)
            elif not self.store.has(desc):
                self._fetch(pin.target, desc, fill)
            with self._lock:
                self.stats.filled += 1
                self.stats.filled_bytes += fill.size
            state = DONE
        except Exception as exc:  # any failure is a miss for the requester, logged
            log.warning("fill: %s from %s failed: %s", fill.digest, pin.target.name, exc)
            with self._lock:
                self.stats.failed += 1
                self._failed_until[fill.digest] = time.monotonic() + self.settings.retry_after_s
        finally:
            with self._lock:
                self._inflight.pop(fill.digest, None)
                self._threads.discard(threading.current_thread())
            self._slots.release()
            fill.end(state)

    def _fetch(self, target: ReadableTarget, desc: Descriptor, fill: Fill) -> None:
        """Stream ``desc`` from the origin through the blob writer into a private temp file that
        ``fill``'s readers follow as it grows; committed only if it verifies (the temp file is
        gone on any failure before ``fill`` ends, so a failed fill leaves nothing behind)."""
        start = time.monotonic()
        landed = 0

        def wrote(n: int) -> None:  # unbuffered writes: what ``landed`` announces is in the file
            nonlocal landed
            if self._closing.is_set():  # shutdown: the writer removes its temp file on the way out
                raise TransferCancelled(f"fill of {desc.digest} stopped: the server is shutting down")
            landed += n
            with self._lock:
                self.stats.origin_bytes += n
            fill.landed(landed)

        fetch_verified(
            target,
            desc,
            _FillSlot(self.store, desc.digest, fill),
            Landing(
                self.store.blob_path(desc.digest), mode=READ_ONLY_FILE_MODE, full_disk_hint=FULL_CACHE_HINT
            ),
            WriteHooks(on_bytes=wrote),
            chunk=_FILL_CHUNK,
        )
        log.info(
            "fill: %s (%d bytes) from %s in %.2f s",
            desc.digest,
            landed,
            target.name,
            time.monotonic() - start,
        )

    def _sweep_dead_temps(self) -> None:
        """Remove the temp files of fills a killed server left in ``ingest/`` (a fill is never
        resumed; a temp file whose writer still holds its lock is another server's, kept)."""
        prefix = TEMP_PREFIX + _FILL_TAG
        with contextlib.suppress(OSError):
            for entry in list(os.scandir(self.store.ingest_dir)):
                if entry.name.startswith(prefix) and entry.is_file(follow_symlinks=False):
                    if not is_locked(entry.path):
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(entry.path)
                            log.info("fill: removed %s, left by a stopped fill", entry.path)

    def close(self, timeout: float = 10.0) -> None:
        """Stop: no new fill starts, running fills stop at their next read (a signal's
        ``stopping.request_stop`` ends a blocked one at once) and remove their temp files; waits
        at most ``timeout`` seconds for them, then removes what is left of theirs itself."""
        self._closing.set()
        with self._loads:
            self._loads.notify_all()
            threads = list(self._threads)
            fills = list(self._inflight.values())
        deadline = time.monotonic() + timeout
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        for fill in fills:
            if fill.temp_path is not None and fill.state == RUNNING:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(fill.temp_path)
        for pin in self._pinned:
            if isinstance(pin.target, Closable):
                with contextlib.suppress(Exception):
                    pin.target.close()


class _FillSlot:
    """A fill's ``PartialSlot``: a private temp file in ``ingest/`` (never resumed: a failed fill
    leaves nothing), opened a second time read-only for the fill's readers to follow."""

    def __init__(self, store: Store, digest: Digest, fill: Fill) -> None:
        self.store = store
        self.digest = digest
        self.fill = fill

    def open(self) -> Partial:
        partial = LockedTemp(self.store.ingest_dir, self.digest, tag=_FILL_TAG).open()
        self.fill.temp_path = partial.path
        try:
            self.fill.opened(os.open(partial.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC))
        except BaseException:
            os.close(partial.fd)
            os.unlink(partial.path)
            raise
        return partial


def _origin_target(text: str, options: TargetOptions) -> ReadableTarget:
    """The pinned reference's registry, never through mirrors (a fill asking peers would loop)."""
    from modelpack.targets.opener import open_readable
    from modelpack.targets.registry.target import RegistryTarget

    target = open_readable(text, options)
    if isinstance(target, RegistryTarget):
        target.mirrors = None
    return target


__all__ = [
    "BUSY",
    "FILL_ANNOTATION",
    "MISS",
    "READY",
    "FillSettings",
    "FillStats",
    "Filler",
]
