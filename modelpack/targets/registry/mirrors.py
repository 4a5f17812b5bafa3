"""Blob reads through an ordered list of mirrors before the origin, with fallback per blob.

Configured the way containerd, Dragonfly's dfdaemon, Harbor proxy caches and Spegel already are
(``mirror_config``: ``--mirror URL`` / ``MODELPACK_MIRRORS``, then ``hosts.toml``).

A mirror never chooses the version: tags are resolved at the origin only; a mirror serves blobs
and manifests by digest (the target asks it for a manifest by digest first, verified against the
digest), and referrer listings only when the origin cannot be reached. A mirror's bytes go
to a spool (memory, then a temp file) and are hashed on the way; the consumer sees them only once
the whole blob matched its digest. So a mirror that refuses, errors, stalls (no byte for the
stall time: the read timeout of its client, whose retry budget is short) or dies mid-blob is
abandoned for that blob and the next mirror, finally the origin, continues from the byte reached;
a mirror whose bytes do not hash to the digest is dropped for that blob and the next mirror asked
for the whole blob (the origin when no other is left). Each abandonment is an
event (``registry.mirror_abandoned``: mirror, blob, reason, offset); each blob a mirror served
(maybe finished by the origin) is a ``registry.blob_sources`` event, and ``bytes_by_source``
totals the bytes delivered per source host for the run. A mirror whose connection failed is skipped for
``DOWN_FOR_S`` so a dead mirror costs one short budget per run, not one per blob.

Every mirror read has a stall limit (no byte for ``stall_s``) and a throughput floor
(``Floor``: fewer than ``min_rate`` bytes per second over ``rate_window_s`` is a mirror that
trickles), and is abandoned mid-blob for the next mirror and finally the origin, from the byte
reached. A stop request (``stopping``: SIGTERM) ends every wait at once.

What a lying mirror can cost: a whole-blob spool is verified only at its last byte, so a mirror
serving wrong bytes just above the floor would hold each blob for size ÷ floor. Bounded twice:
a mirror's part of a spool must average ``BLOB_RATE_FACTOR`` times the floor after a grace of
``BLOB_GRACE_WINDOWS`` windows (``blob_deadline_s``; with the default floor, 30 s + 1 s per MiB),
else the next source continues from the byte reached; and a mirror that alone served a blob
whose bytes failed its digest is not asked again during this run (``Mirror.lied``), so a liar
costs at most the blobs it was already serving. With a signed chunk table the caller verified
(``check_chunks``, from ``RegistryTarget.use_chunk_table``) a spool is checked chunk by chunk as
it arrives (``ChunkGate``): a liar is dropped at its first wrong chunk and the next source
continues from the last good one. The loader's ranges are checked the same way (``read_range``'s
``check``).

Range reads (the loader's streaming) go to the mirrors in order too, falling back on any error;
a range cannot be verified alone, so the caller may pass ``check`` (the loader's signed chunk
table): the chunks of a mirror's bytes that fail it are fetched again from the next source and
finally the origin, chunk by chunk. The loader verifies every chunk again, as for the origin.

This module decides which source to ask and spools whole blobs; beside it: ``mirror_config``
(which mirrors), ``mirror_ledger`` (each mirror's state, bytes per source, abandonments: the one
interface the spool, the stream and the ranges report through), ``mirror_stream`` (a blob read in
order through the sources), ``mirror_ranges`` (ranges), ``mirror_spool`` (what a spool accepts).
"""

from __future__ import annotations

import hashlib
import logging
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import BinaryIO

from modelpack import stopping
from modelpack.errors import (
    MirrorTooSlowError,
    ModelpackError,
    RegistryError,
    TransferInterrupted,
)
from modelpack.events import EventLog
from modelpack.oci.descriptor import Descriptor, Manifest
from modelpack.targets.base import ChunkBounds, RangeCheck
from modelpack.targets.registry.blob_reads import Floor, ResumingBlobStream
from modelpack.targets.registry.client import RegistryClient
from modelpack.targets.registry.mirror_config import (  # re-exported: where callers find them
    DEFAULT_HOSTS_DIR,
    MIRROR_STALL_S,
    MirrorEndpoint,
    configured_mirrors,
    hosts_toml_mirrors,
    mirror_limits,
    parse_mirror_url,
)
from modelpack.targets.registry.mirror_ledger import Mirror, SourceLedger
from modelpack.targets.registry.mirror_ranges import read_range_through
from modelpack.targets.registry.mirror_spool import (  # re-exported: where callers find them
    BLOB_GRACE_WINDOWS,
    BLOB_RATE_FACTOR,
    BadChunk,
    ChunkGate,
    blob_deadline_s,
)
from modelpack.targets.registry.mirror_stream import SourcesStream
from modelpack.targets.registry.owners import balanced_owners
from modelpack.targets.registry.peers import blob_order, rendezvous
from modelpack.targets.registry.repository import RepositoryAPI

log = logging.getLogger("modelpack.targets.registry")

#: a mirror's whole retry budget per blob: a dead mirror is abandoned quickly, the origin has 60 s
MIRROR_RETRY_FOR = 3.0
#: blobs up to this size are spooled in memory, larger ones in a temp file (``TMPDIR``)
SPOOL_IN_MEMORY = 16 * 1024 * 1024
_CHUNK = 1024 * 1024


class MirroredBlobs:
    """Blob streams and ranges for one repository: its mirrors in order, then the origin."""

    def __init__(
        self,
        origin: RepositoryAPI,
        endpoints: list[MirrorEndpoint],
        *,
        retry_for: float | None = None,
        stall_s: float | None = None,
        floor: Floor | None = None,
        events: EventLog | None = None,
        spool_dir: str | None = None,
    ) -> None:
        self.origin = origin
        self.events = events
        self.spool_dir = spool_dir
        self.floor = floor
        budget = MIRROR_RETRY_FOR if retry_for is None else min(retry_for, MIRROR_RETRY_FOR)
        self.mirrors = []
        for ep in endpoints:
            client = RegistryClient(
                ep.host,
                plain_http=ep.plain_http,
                ca_file=ep.ca_file,
                insecure_skip_verify=ep.skip_verify,
                credentials=None,  # credentials are bound to the origin's host, never a mirror's
                timeout=MIRROR_STALL_S if stall_s is None else stall_s,
                retry_for=budget,
            )
            client.session.headers.update(dict(ep.headers))
            self.mirrors.append(Mirror(ep, RepositoryAPI(client, origin.repository)))
        self._lock = threading.Lock()
        #: bytes per source and abandonments, shared with the ``SourcesStream``s it opens
        self.ledger = SourceLedger(origin, events)
        #: ``MODELPACK_PEER_ORDER=blob``: each blob is asked first of its owner peer (``_for_blob``)
        self.blob_order = blob_order()
        #: blob digest → owner peer, from the manifests read (``plan``; ``owners.balanced_owners``)
        self._owners: dict[str, str] = {}
        #: layer digest → (chunk bounds, check) from a verified signed chunk table (``check_chunks``)
        self._chunk_checks: dict[str, tuple[ChunkBounds, RangeCheck]] = {}

    def check_chunks(self, layer_digest: str, bounds: ChunkBounds, check: RangeCheck) -> None:
        """Check mirrors' whole-blob spools of ``layer_digest`` chunk by chunk (``bounds``: where
        the chunk holding an offset lies) with ``check`` (a verified signed chunk table's): a liar
        is dropped at its first wrong chunk."""
        with self._lock:
            self._chunk_checks[layer_digest] = (bounds, check)

    # ------------------------------------------------------------------ bookkeeping
    @property
    def bytes_by_source(self) -> dict[str, int]:
        """Bytes delivered per source host (mirror name or origin host) in this run."""
        return self.ledger.bytes_by_source

    @property
    def abandoned(self) -> int:
        """How many times a mirror was left for a blob, a range or a manifest."""
        return self.ledger.abandoned

    def url_of(self, name: str) -> str:
        """Mirror ``name``'s URL (never credentials: a mirror URL carries none)."""
        return next(m.endpoint.url for m in self.mirrors if m.name == name)

    def usable(self, name: str) -> bool:
        """Whether mirror ``name`` may be asked now (not marked down after a failed connection)."""
        return any(m.name == name for m in self._usable())

    def manifest_abandoned(self, name: str, what: str, exc: BaseException) -> None:
        """A manifest (or referrers listing) ``name`` could not serve: the next source is asked."""
        self.ledger.manifest_abandoned(next(m for m in self.mirrors if m.name == name), what, exc)

    def _usable(self) -> list[Mirror]:
        now = time.monotonic()
        return [m for m in self.mirrors if m.usable(now)]

    def _for_blob(self, desc: Descriptor) -> list[Mirror]:
        """The usable mirrors for ``desc``. With blob order, the peers (in the place of the first
        one) are ranked by rendezvous hashing on the blob digest, the owner ``plan`` assigned
        (bounded load) first: every node computes the same owner for a blob, so a storm asks one
        peer per blob, which fills it once from the origin (``cache serve --fill``); the
        next-ranked peers are the fallbacks, the origin last."""
        usable = self._usable()
        if not self.blob_order:
            return usable
        peers = {m.name: m for m in usable if m.endpoint.peer}
        if len(peers) < 2:
            return usable
        names = rendezvous(list(peers), str(desc.digest))
        owner = self._owners.get(str(desc.digest))
        if owner in peers:  # the planned owner first, the rest in rendezvous order
            names = [owner, *(n for n in names if n != owner)]
        ranked = iter([peers[name] for name in names])
        return [next(ranked) if m.endpoint.peer else m for m in usable]

    def plan(self, blobs: Sequence[Descriptor]) -> None:
        """With blob order: owners for a manifest's ``blobs`` with bounded load over every peer
        (down or not: the same on every node), asked first by ``_for_blob``."""
        if not self.blob_order:
            return
        peers = [m.name for m in self.mirrors if m.endpoint.peer]
        if len(peers) >= 2:
            owners = balanced_owners(peers, blobs)
            with self._lock:
                self._owners.update(owners)

    def plan_manifest(self, raw: bytes, media_type: str) -> None:
        """``plan`` for the blobs of an image manifest just read (an index or junk: nothing)."""
        if not self.blob_order:
            return
        try:
            manifest = Manifest.parse(raw, media_type=media_type)
        except (ModelpackError, ValueError, TypeError, KeyError):
            return
        self.plan([manifest.config, *manifest.layers])

    # ------------------------------------------------------------------ streams
    def open_blob(self, desc: Descriptor, offset: int = 0) -> BinaryIO:
        """The blob from ``offset``: spooled from the mirrors and verified, else from the origin
        (unverified here, like every origin read: the consumer verifies)."""
        if offset == 0:
            spooled = self._spool_or_none(desc)
            if spooled is not None:
                return spooled
        # a resume (``offset`` > 0: a kept partial) asks the mirrors too, each from the byte
        # reached; the caller re-hashed its prefix and checks the whole blob
        mirrors = self._for_blob(desc) if offset > 0 else []
        return SourcesStream(self.ledger, desc, offset, mirrors, floor=self.floor)  # type: ignore[return-value]

    def spool_verified(self, desc: Descriptor) -> BinaryIO | None:
        """The whole blob, verified, whoever serves it: the mirrors first (``_spool``), then the
        origin's bytes, spooled and checked too (``VerifiedSpooler``: for a reader that must not
        read a range it cannot check). None when no mirror is usable (the origin is read as
        usual) or no spool has room."""
        spooled = self._spool_or_none(desc)
        if spooled is None and self._usable():
            try:
                spooled, _ = self._spool_once(desc, {m.name for m in self.mirrors})
            except OSError as exc:
                log.warning("cannot spool %s from the origin (%s)", desc.digest, exc.strerror)
        return spooled

    def _spool_or_none(self, desc: Descriptor) -> BinaryIO | None:
        if desc.size == 0 or not self._usable():
            return None
        try:
            return self._spool(desc)
        except OSError as exc:  # no room for the spool (TMPDIR full): the origin serves it
            log.warning("cannot spool %s from a mirror (%s); using the origin", desc.digest, exc.strerror)
            return None

    def _spool(self, desc: Descriptor) -> BinaryIO | None:
        """The whole blob from the mirrors (the origin finishing what they could not deliver),
        verified; None when the origin must serve the whole blob (nothing usable was spooled).

        Bytes that fail the digest do not send the blob to the origin while another mirror is
        left: the mirrors that served them are dropped for this blob and the next ones asked
        (one more spool per liar, at most one per mirror), so a corrupting peer costs the
        origin nothing when an honest peer has the blob."""
        excluded: set[str] = set()
        while True:
            spooled, served = self._spool_once(desc, excluded)
            if spooled is not None or not served:
                return spooled
            excluded |= served
            if not [m for m in self._for_blob(desc) if m.name not in excluded]:
                return None

    def _spool_once(self, desc: Descriptor, excluded: set[str]) -> tuple[BinaryIO | None, set[str]]:
        """One pass over the mirrors not ``excluded`` (then the origin): the verified spool, or
        None and the names of the mirrors whose bytes went into a spool that failed the digest."""
        algo, _, want = str(desc.digest).partition(":")
        try:
            hasher = hashlib.new(algo)
        except ValueError:
            return None, set()
        spool = tempfile.SpooledTemporaryFile(max_size=SPOOL_IN_MEMORY, dir=self.spool_dir)
        pos = 0
        sources: list[tuple[Mirror | None, int]] = []
        chunks = ChunkGate(desc, self._chunk_checks.get(str(desc.digest)), hasher, spool)
        try:
            for mirror in [*(m for m in self._for_blob(desc) if m.name not in excluded), None]:
                if pos >= desc.size:
                    break
                repo = mirror.repo if mirror is not None else self.origin
                floor = self.floor if mirror is not None else None
                start = pos
                limit = blob_deadline_s(floor, desc.size - pos)
                began = time.monotonic()
                try:
                    with ResumingBlobStream(repo, desc, pos, floor=floor) as stream:
                        while pos < desc.size:
                            stopping.check()
                            data = stream.read(min(_CHUNK, desc.size - pos))
                            if not data:
                                break
                            pos += len(data)
                            chunks.add(data, checked=mirror is not None)
                            if limit is not None and time.monotonic() - began > limit:
                                raise self._too_slow_for_blob(desc, floor, pos - start, began, pos)
                    if pos < desc.size and mirror is not None:
                        self.ledger.abandon(
                            mirror, desc, f"short blob: ended at byte {pos}", pos, failure="short"
                        )
                except TransferInterrupted:
                    raise
                except BadChunk as bad:
                    assert mirror is not None
                    if bad.offset >= start:  # this mirror alone served the chunk: it lied
                        mirror.lied = True
                    pos = bad.offset  # the next source continues from the last good chunk
                    self.ledger.abandon(
                        mirror,
                        desc,
                        f"digest mismatch: chunk at byte {bad.offset} ({bad.length} bytes) does not "
                        "match the signed chunk table",
                        bad.offset,
                        failure="digest_mismatch",
                    )
                except (RegistryError, ModelpackError) as exc:
                    if mirror is None:
                        raise
                    self.ledger.mirror_failed(mirror, desc, exc, pos)
                sources.append((mirror, max(0, pos - start)))
            if pos == desc.size and hasher.hexdigest() == want:
                split: dict[str, int] = {}
                for mirror, n in sources:
                    name = mirror.name if mirror is not None else self.ledger.origin_name
                    self.ledger.count(name, n)
                    split[name] = split.get(name, 0) + n
                if self.events is not None:
                    urls = {m.name: m.endpoint.url for m, _ in sources if m is not None}
                    urls.setdefault(self.ledger.origin_name, self.ledger.origin_url)
                    self.events.emit(
                        "registry.blob_sources",
                        blob=str(desc.digest),
                        bytes=desc.size,
                        sources=split,
                        source_urls={k: urls[k] for k in split},
                    )
                spool.seek(0)
                return spool, set()  # type: ignore[return-value]
            liars: set[str] = set()
            served_by = {m.name if m is not None else "" for m, n in sources if n}
            if len(served_by) == 1 and "" not in served_by:  # one mirror served every byte: it lied
                for mirror, n in sources:
                    if mirror is not None and n:
                        mirror.lied = True
            for mirror, n in sources:
                if mirror is not None and n:
                    self.ledger.abandon(
                        mirror,
                        desc,
                        "digest mismatch: served bytes that are not the blob",
                        0,
                        failure="digest_mismatch",
                    )
                    liars.add(mirror.name)
                elif n:
                    self.ledger.count(self.ledger.origin_name, n)  # crossed the wire, then discarded
            spool.close()
            return None, liars
        except BaseException:
            spool.close()
            raise

    @staticmethod
    def _too_slow_for_blob(
        desc: Descriptor, floor: Floor | None, got: int, began: float, pos: int
    ) -> MirrorTooSlowError:
        assert floor is not None
        elapsed = time.monotonic() - began
        return MirrorTooSlowError(
            f"blob {desc.digest}: too slow for a whole blob, {got} bytes in {elapsed:.1f} s (a mirror "
            f"must average {BLOB_RATE_FACTOR * floor.min_bps:.0f} B/s over a blob after "
            f"{BLOB_GRACE_WINDOWS * floor.window_s:g} s), at byte {pos}"
        )

    # ------------------------------------------------------------------ ranges
    def read_range(
        self, desc: Descriptor, offset: int, length: int, check: RangeCheck | None = None
    ) -> bytes:
        """Exactly ``length`` bytes at ``offset`` from the first source that serves them. With
        ``check``, the chunks a mirror got wrong are fetched again from the next source and the
        origin (the loader verifies every chunk against the signed chunk table either way)."""
        return read_range_through(
            self.ledger, self._for_blob(desc), desc, offset, length, check, floor=self.floor
        )

    def close(self) -> None:
        for m in self.mirrors:
            m.repo.client.close()


__all__ = [
    "BLOB_GRACE_WINDOWS",
    "BLOB_RATE_FACTOR",
    "DEFAULT_HOSTS_DIR",
    "MIRROR_STALL_S",
    "MirrorEndpoint",
    "MirroredBlobs",
    "blob_deadline_s",
    "configured_mirrors",
    "hosts_toml_mirrors",
    "mirror_limits",
    "parse_mirror_url",
]
