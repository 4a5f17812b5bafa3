"""``NodeCache``: pull-and-verify into a node-local cache, snapshots, pins, GC (DESIGN §5).

Layout under the cache root (default ``$MODELPACK_CACHE``, else ``$XDG_CACHE_HOME/modelpack``,
else ``~/.cache/modelpack``)::

    oci-layout, index.json, blobs/sha256/   content-addressed store (``mount.store``)
    ingest/, locks/                         partial downloads, per-digest locks
    snapshots/<hex>{,.ready,.lease}         published models (``mount.snapshots``)
    refs/<key>.json                         reference → manifest digest, as resolved at pull time
    pins/<hex>                              pinned manifests (never evicted)
    leases/<id>.json                        digests a running pull is working on (GC skips them)
    events.jsonl                            one JSON line per decision

A hit costs one tag resolution (none when the reference is pinned by digest), one small file
read (the ready marker) and one ``utime``; nothing is hashed. A miss resolves once, fetches and
verifies the manifest, checks signatures per policy, checks free space and quota, downloads
missing blobs (resuming partial ones), builds the snapshot in a temp directory and publishes it.
GC and pulls meet at ``locks/gc.lock``: a pull registers its lease under a shared lock, GC runs
under an exclusive one, so GC sees every running pull or runs entirely before it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

from modelpack.mediatypes import MEDIA_TYPE_IMAGE_CONFIG
from modelpack.mount.locks import DEFAULT_STALE_AFTER_S, acquire, exclusive_lock, shared_lock, try_exclusive
from modelpack.mount.snapshots import SnapshotInfo, Snapshots
from modelpack.mount.store import IngestResult, Store

from modelpack.errors import (
    CacheError,
    DigestMismatchError,
    InsufficientSpaceError,
    ManifestError,
    ModelpackError,
    NotFoundError,
    QuotaExceededError,
    SizeMismatchError,
    SnapshotInUseError,
)
from modelpack.events import EventLog
from modelpack.files import atomic_write_bytes
from modelpack.oci.descriptor import Descriptor, Index, Manifest, parse_manifest_or_index
from modelpack.oci.digest import Digest, sha256_file, verify_bytes
from modelpack.oci.reference import Reference, parse_reference
from modelpack.targets.base import ReadableTarget
from modelpack.targets.opener import TargetOptions, open_readable

MAX_REF_BYTES = 64 * 1024


def default_cache_dir() -> str:
    env = os.environ.get("MODELPACK_CACHE")
    if env:
        return env
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = xdg if xdg else os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "modelpack")


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 3)


@dataclass
class PullResult:
    reference: str
    digest: Digest
    path: str
    state: str  # hit | cold
    files: int = 0
    bytes_total: int = 0
    bytes_downloaded: int = 0
    bytes_reused: int = 0  # already in the store, or a resumed prefix
    bytes_resumed: int = 0
    blobs_downloaded: int = 0
    blobs_reused: int = 0
    timings: dict[str, float] = field(default_factory=dict)  # milliseconds
    start_id: str = ""
    signature: str = "not-checked"

    def to_json(self) -> dict[str, Any]:
        return {
            "reference": self.reference,
            "digest": str(self.digest),
            "path": self.path,
            "state": self.state,
            "files": self.files,
            "bytes": {
                "total": self.bytes_total,
                "downloaded": self.bytes_downloaded,
                "reused": self.bytes_reused,
                "resumed": self.bytes_resumed,
            },
            "blobs": {"downloaded": self.blobs_downloaded, "reused": self.blobs_reused},
            "timings_ms": dict(self.timings),
            "start_id": self.start_id,
            "signature": self.signature,
        }


@dataclass
class CacheEntry:
    digest: str
    path: str
    size: int
    files: int
    references: list[str]
    repository: str
    pinned: bool
    in_use: bool
    last_used: float
    created: float

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class VerifyReport:
    digest: str
    ok: bool
    files: int
    bytes: int
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "digest": self.digest,
            "ok": self.ok,
            "files": self.files,
            "bytes": self.bytes,
            "problems": list(self.problems),
            "seconds": round(self.seconds, 3),
        }


@dataclass
class GCResult:
    evicted: list[str] = field(default_factory=list)
    kept_in_use: list[str] = field(default_factory=list)
    kept_pinned: list[str] = field(default_factory=list)
    kept_pulling: list[str] = field(default_factory=list)
    refs_removed: int = 0
    blobs_removed: int = 0
    bytes_freed: int = 0
    swept: list[str] = field(default_factory=list)
    bytes_before: int = 0
    bytes_after: int = 0

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


class NodeCache:
    """A node-local model cache. Safe for many threads and processes on one filesystem."""

    def __init__(
        self,
        root: str | None = None,
        *,
        max_cache_bytes: int | None = None,
        reserve_bytes: int = 0,
        stale_after: float = DEFAULT_STALE_AFTER_S,
        events: EventLog | str | None = None,
    ) -> None:
        self.root = os.path.abspath(root or default_cache_dir())
        self.store = Store(self.root, stale_after=stale_after)
        self.snapshots = Snapshots(self.store)
        self.refs_dir = os.path.join(self.root, "refs")
        self.pins_dir = os.path.join(self.root, "pins")
        self.leases_dir = os.path.join(self.root, "leases")
        for d in (self.refs_dir, self.pins_dir, self.leases_dir):
            os.makedirs(d, exist_ok=True)
        self.max_cache_bytes = max_cache_bytes
        self.reserve_bytes = reserve_bytes
        self.stale_after = stale_after
        self.events_path = os.path.join(self.root, "events.jsonl")
        self.events = self._event_log(events)

    def _event_log(self, events: EventLog | str | None) -> EventLog:
        if isinstance(events, EventLog):
            return events
        return EventLog.from_spec(self.events_path, events)

    @property
    def gc_lock_path(self) -> str:
        return os.path.join(self.store.locks_dir, "gc.lock")

    # ------------------------------------------------------------------ refs & pins
    def _ref_path(self, reference: str) -> str:
        return os.path.join(self.refs_dir, hashlib.sha256(reference.encode()).hexdigest()[:40] + ".json")

    def _record_ref(self, ref: Reference, digest: str) -> None:
        key = str(ref)
        path = self._ref_path(key)
        current = self._read_ref_file(path)
        if current and current.get("digest") == digest:
            return
        doc = {"reference": key, "repository": ref.repo_name, "digest": digest, "resolved_at": time.time()}
        atomic_write_bytes(path, json.dumps(doc, sort_keys=True).encode())

    @staticmethod
    def _read_ref_file(path: str) -> dict[str, Any] | None:
        try:
            with open(path, "rb") as f:
                raw = f.read(MAX_REF_BYTES + 1)
        except FileNotFoundError:
            return None
        if len(raw) > MAX_REF_BYTES:
            return None
        try:
            doc = json.loads(raw)
            Digest(doc["digest"])
        except (ValueError, KeyError, TypeError):
            return None
        return doc if isinstance(doc, dict) else None

    def _all_refs(self) -> list[dict[str, Any]]:
        out = []
        for entry in os.scandir(self.refs_dir):
            if entry.name.endswith(".json"):
                doc = self._read_ref_file(entry.path)
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
        doc = self._read_ref_file(self._ref_path(str(ref.with_tag(ref.tag or "latest"))))
        if doc is None:
            raise NotFoundError(f"{ref}: not in the node cache {self.root} (pull it first)")
        return Digest(doc["digest"])

    def _pin_path(self, digest: str) -> str:
        return os.path.join(self.pins_dir, Digest(digest).hex)

    def is_pinned(self, digest: str) -> bool:
        return os.path.exists(self._pin_path(digest))

    def pin(self, reference: str) -> Digest:
        digest = self.resolve_local(reference)
        if self.snapshots.ready(digest) is None:
            raise NotFoundError(f"{reference}: {digest} is not ready in {self.root}")
        atomic_write_bytes(self._pin_path(digest), json.dumps({"reference": reference}).encode())
        self.events.emit("cache.pin", reference=reference, digest=str(digest))
        return digest

    def unpin(self, reference: str) -> Digest:
        digest = self.resolve_local(reference)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._pin_path(digest))
        self.events.emit("cache.unpin", reference=reference, digest=str(digest))
        return digest

    # ------------------------------------------------------------------ pull
    def pull(
        self,
        reference: str | Reference,
        target_options: TargetOptions | None = None,
        *,
        policy: Any = None,
        jobs: int = 4,
        events: EventLog | str | None = None,
        source: ReadableTarget | None = None,
        start_id: str | None = None,
    ) -> PullResult:
        """Make ``reference`` available as a verified snapshot; returns where and what it cost.

        ``policy`` is a ``TrustPolicy``, a path to one, public keys, or None (no signature check).
        ``source`` overrides the target the reference names (tests, custom backings).
        """
        t0 = time.monotonic()
        log = self.events if events is None else self._event_log(events)
        ref = parse_reference(reference) if isinstance(reference, str) else reference
        ref_text = str(ref)
        # one start_id groups a model start's events across processes (init container → loader)
        sid = start_id or os.environ.get("MODELPACK_START_ID") or uuid.uuid4().hex[:16]
        timings: dict[str, float] = {}

        def ev(name: str, **fields: Any) -> None:
            fields.setdefault("reference", ref_text)
            fields.setdefault("start_id", sid)
            log.emit(name, **fields)

        ev("cache.pull_start", pinned=ref.is_pinned)
        target: ReadableTarget | None = source
        desc: Descriptor | None = None
        try:
            if ref.digest:
                digest = ref.digest
            else:
                target = target or open_readable(ref, target_options)
                desc = target.resolve(ref.identifier)
                digest = desc.digest
                timings["resolve"] = _ms(time.monotonic() - t0)
                self._record_ref(ref, digest)
            info = self.snapshots.ready(digest)
            if info is not None:
                signature = "not-checked"
                if policy is not None:
                    target, signature = self._policy_on_hit(
                        info, ref, target, target_options, policy, log, ev, timings
                    )
                return self._hit(info, ref_text, sid, t0, timings, ev, signature=signature)
            ev("cache.miss", digest=str(digest))
            if target is None:
                target = open_readable(ref, target_options)
            if ref.digest and not desc:
                self._record_ref(ref, digest)
            return self._pull_miss(ref, ref_text, digest, target, policy, jobs, sid, t0, timings, ev, log)
        except BaseException as exc:
            ev(
                "cache.pull_failed",
                digest=str(desc.digest) if desc else (str(ref.digest) if ref.digest else None),
                error=type(exc).__name__,
                reason=str(exc),
                duration_ms=_ms(time.monotonic() - t0),
            )
            raise

    def _hit(
        self,
        info: SnapshotInfo,
        ref_text: str,
        sid: str,
        t0: float,
        timings: dict[str, float],
        ev: Callable[..., None],
        *,
        waited_s: float = 0.0,
        signature: str = "not-checked",
    ) -> PullResult:
        self.snapshots.touch(info.digest)
        now = time.monotonic()
        ev(
            "cache.version_confirmed",
            digest=str(info.digest),
            stage="t2",
            state="hit",
            duration_ms=_ms(now - t0),
        )
        total = _ms(time.monotonic() - t0)
        timings["total"] = total
        ev(
            "cache.hit",
            digest=str(info.digest),
            stage="t4",
            state="hit",
            bytes=info.size,
            files=len(info.files),
            duration_ms=total,
            waited_ms=_ms(waited_s) if waited_s else None,
            path=info.path,
        )
        return PullResult(
            ref_text,
            info.digest,
            info.path,
            "hit",
            files=len(info.files),
            bytes_total=int(info.meta.get("bytes_total", info.size)),
            bytes_reused=int(info.meta.get("bytes_total", info.size)),
            timings=timings,
            start_id=sid,
            signature=signature,
        )

    def _pull_miss(
        self,
        ref: Reference,
        ref_text: str,
        digest: Digest,
        target: ReadableTarget,
        policy: Any,
        jobs: int,
        sid: str,
        t0: float,
        timings: dict[str, float],
        ev: Callable[..., None],
        log: EventLog,
    ) -> PullResult:
        def waiting(holder: str) -> None:
            ev("cache.lock_wait", digest=str(digest), holder=holder)

        mlock = acquire(
            os.path.join(self.store.locks_dir, "m-" + digest.hex + ".lock"),
            stale_after=self.stale_after,
            on_wait=waiting,
        )
        try:
            info = self.snapshots.ready(digest)
            if info is not None:  # another process published it while we waited
                signature = "not-checked"
                if policy is not None:
                    _, signature = self._policy_on_hit(info, ref, target, None, policy, log, ev, timings)
                return self._hit(
                    info, ref_text, sid, t0, timings, ev, waited_s=mlock.waited_s, signature=signature
                )
            t = time.monotonic()
            raw, media_type = target.fetch_manifest(str(digest))
            verify_bytes(raw, digest, None, what="manifest", source=target.name)
            parsed = parse_manifest_or_index(raw, media_type)
            if isinstance(parsed, Index):
                raise ManifestError(f"{ref_text}: {digest} is an index; pull one of its manifests by digest")
            manifest: Manifest = parsed
            timings["manifest"] = _ms(time.monotonic() - t)
            ev(
                "cache.version_confirmed",
                digest=str(digest),
                stage="t2",
                state="cold",
                duration_ms=_ms(time.monotonic() - t0),
            )
            verification = None
            if policy is not None:
                t = time.monotonic()
                verification = self._check_signature(target, ref, manifest, policy, log, ev, record=False)
                timings["signature"] = _ms(time.monotonic() - t)

            blobs = _unique_blobs(manifest)
            with self._pull_lease([str(digest), *(str(b.digest) for b in blobs)]):
                result = self._download_and_publish(
                    ref, ref_text, manifest, target, blobs, jobs, sid, t0, timings, ev, mlock.heartbeat
                )
            if verification is not None:
                self._record_trust(str(digest), verification)
                result.signature = str(verification.status)
            return result
        finally:
            mlock.release()

    @staticmethod
    def _load_policy(policy: Any) -> Any:
        if isinstance(policy, (str, os.PathLike)):
            from modelpack.signing import TrustPolicy

            return TrustPolicy.load(policy)
        return policy

    def _read_trust(self, digest: str) -> dict[str, Any]:
        try:
            with open(self.snapshots.trust_path(digest), "rb") as f:
                raw = f.read(MAX_REF_BYTES + 1)
            doc = json.loads(raw) if len(raw) <= MAX_REF_BYTES else {}
        except (OSError, ValueError):
            return {}
        return doc if isinstance(doc, dict) and doc.get("digest") == digest else {}

    def _record_trust(self, digest: str, result: Any) -> None:
        """Remember which keys verified this digest, so a hit under the same trust needs no network."""
        doc = self._read_trust(digest) or {"digest": digest, "key_ids": []}
        doc["key_ids"] = sorted(set(doc.get("key_ids", [])) | set(result.key_ids))
        for field_name, attr in (
            ("directory_signature", "directory_signature"),
            ("chunk_table", "chunk_table"),
        ):
            if getattr(result, attr, None) == "verified":
                doc[field_name] = "verified"
        atomic_write_bytes(self.snapshots.trust_path(digest), json.dumps(doc, sort_keys=True).encode())

    def _trusted_locally(self, digest: str, ref: Reference, policy: Any) -> bool:
        """Whether an earlier verification of ``digest`` satisfies ``policy`` for ``ref``."""
        from modelpack.signing.verify import resolve_policy

        rp = resolve_policy(policy, ref)
        rec = self._read_trust(digest)
        signed_by_trusted = bool(set(rp.key_ids) & set(rec.get("key_ids", [])))
        if rp.require_signature and not signed_by_trusted:
            return False
        if rp.require_directory_signature and rec.get("directory_signature") != "verified":
            return False
        return not (rp.require_chunk_table and rec.get("chunk_table") != "verified")

    def _policy_on_hit(
        self,
        info: SnapshotInfo,
        ref: Reference,
        target: ReadableTarget | None,
        target_options: TargetOptions | None,
        policy: Any,
        log: EventLog,
        ev: Callable[..., None],
        timings: dict[str, float],
    ) -> tuple[ReadableTarget | None, str]:
        """A hit under a policy: trusted if an earlier pull verified the same digest with a key
        this policy trusts (no network); otherwise verify now, before the hit is returned."""
        policy = self._load_policy(policy)
        if self._trusted_locally(info.digest, ref, policy):
            ev("cache.signature_verified", digest=str(info.digest), status="verified", cached=True)
            return target, "verified"
        t = time.monotonic()
        target = target or open_readable(ref, target_options)
        raw = self.store.read_small(info.digest)
        verify_bytes(raw, info.digest, None, what="manifest", source=self.root)
        result = self._check_signature(target, ref, Manifest.parse(raw), policy, log, ev)
        timings["signature"] = _ms(time.monotonic() - t)
        return target, str(result.status)

    def _check_signature(
        self,
        target: ReadableTarget,
        ref: Reference,
        manifest: Manifest,
        policy: Any,
        log: EventLog,
        ev: Callable[..., None],
        *,
        record: bool = True,
    ) -> Any:
        """Adapter to ``modelpack.signing.verify_artifact``; refusal → event + typed error.

        Returns the ``VerificationResult``. ``record`` stores which keys verified the digest; a
        miss records only after publishing, so no trust file exists for a snapshot that never
        became ready."""
        from modelpack.signing import verify_artifact

        from modelpack.errors import SignatureRefused

        policy = self._load_policy(policy)
        desc = Descriptor(manifest.media_type, manifest.digest, manifest.size)
        try:
            result = verify_artifact(target, ref, desc, policy, events=log)
        except SignatureRefused as exc:
            ev("cache.signature_refused", digest=str(manifest.digest), reason=exc.reason)
            raise
        ev(
            "cache.signature_verified",
            digest=str(manifest.digest),
            status=result.status,
            key_ids=result.key_ids,
        )
        if record:
            self._record_trust(str(manifest.digest), result)
        return result

    @contextlib.contextmanager
    def _pull_lease(self, digests: list[str]) -> Iterator[None]:
        """Announce the digests this pull needs, so a concurrent GC leaves them alone."""
        import fcntl

        path = os.path.join(self.leases_dir, f"{os.getpid()}-{uuid.uuid4().hex[:12]}.json")
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

    def _check_space(self, needed: int, ev: Callable[..., None], digest: str) -> None:
        if self.max_cache_bytes is not None:
            used = self.usage()
            if used + needed > self.max_cache_bytes:
                ev(
                    "cache.refused",
                    digest=digest,
                    reason="quota",
                    bytes=needed,
                    used=used,
                    quota=self.max_cache_bytes,
                )
                raise QuotaExceededError(self.root, needed, used, self.max_cache_bytes)
        st = os.statvfs(self.root)
        available = st.f_bavail * st.f_frsize
        if needed + self.reserve_bytes > available:
            ev(
                "cache.refused",
                digest=digest,
                reason="disk_full",
                bytes=needed,
                available=available,
                reserve=self.reserve_bytes,
            )
            raise InsufficientSpaceError(self.root, needed, available, self.reserve_bytes)

    def _download_and_publish(
        self,
        ref: Reference,
        ref_text: str,
        manifest: Manifest,
        target: ReadableTarget,
        blobs: list[Descriptor],
        jobs: int,
        sid: str,
        t0: float,
        timings: dict[str, float],
        ev: Callable[..., None],
        heartbeat: Callable[[], None],
    ) -> PullResult:
        digest = manifest.digest
        missing = [b for b in blobs if not self.store.has(b)]
        needed = sum(max(0, b.size - self.store.partial_bytes(b.digest)) for b in missing)
        # tar layers are extracted into the snapshot (not linked): count them once more
        needed += sum(b.size for b in manifest.layers if not _is_raw_layer(b))
        self._check_space(needed, ev, str(digest))
        result = PullResult(ref_text, digest, "", "cold", start_id=sid, timings=timings)
        result.bytes_total = sum(b.size for b in blobs)
        t = time.monotonic()
        ev(
            "cache.download_start",
            digest=str(digest),
            stage="t3",
            state="cold",
            blobs=len(missing),
            bytes=needed,
        )

        def on_event(name: str, **fields: Any) -> None:
            ev(name, digest=str(digest), **fields)

        def one(b: Descriptor) -> IngestResult:
            tb = time.monotonic()
            try:
                r = self.store.ingest(b, target, on_event=on_event, on_bytes=lambda _n: heartbeat())
            except (DigestMismatchError, SizeMismatchError) as exc:
                ev(
                    "cache.verify_failed",
                    digest=str(digest),
                    blob=str(b.digest),
                    bytes=b.size,
                    reason=str(exc),
                    source=target.name,
                )
                raise
            if r.downloaded or r.resumed_from:
                ev(
                    "cache.download",
                    digest=str(digest),
                    blob=str(b.digest),
                    bytes=r.downloaded,
                    resumed_from=r.resumed_from or None,
                    size=b.size,
                    duration_ms=_ms(time.monotonic() - tb),
                    waited_ms=_ms(r.waited_s) if r.waited_s else None,
                )
            return r

        results: list[IngestResult] = []
        if missing:
            with ThreadPoolExecutor(
                max_workers=max(1, min(jobs, len(missing))), thread_name_prefix="mp-cache"
            ) as pool:
                futures = [pool.submit(one, b) for b in missing]
                done, _ = wait(futures, return_when=FIRST_EXCEPTION)
                for f in futures:
                    if f in done and f.exception() is not None:
                        for other in futures:
                            other.cancel()
                        raise f.exception()  # type: ignore[misc]
                results = [f.result() for f in futures]
        timings["download"] = _ms(time.monotonic() - t)
        for b, r in zip(missing, results, strict=True):
            result.bytes_downloaded += r.downloaded
            result.bytes_resumed += r.resumed_from
            if r.downloaded:
                result.blobs_downloaded += 1
            else:
                result.blobs_reused += 1
                result.bytes_reused += b.size
        for b in blobs:
            if b not in missing:
                result.blobs_reused += 1
                result.bytes_reused += b.size
        result.bytes_reused += result.bytes_resumed
        # every blob this snapshot will use must be present now (a GC bug would show here)
        for b in blobs:
            if not self.store.has(b):
                raise CacheError(f"{self.root}: blob {b.digest} vanished before the snapshot was built")
        t = time.monotonic()
        self.store.add_manifest(manifest.raw, manifest.media_type, ref_text)
        config_raw = None
        if manifest.config.media_type == MEDIA_TYPE_IMAGE_CONFIG:
            config_raw = self.store.read_small(manifest.config.digest)
        tmp = self.snapshots.build(
            manifest, config_raw, extra={"reference": ref_text, "repository": ref.repo_name}
        )
        info = self.snapshots.publish(tmp, digest)
        timings["snapshot"] = _ms(time.monotonic() - t)
        timings["total"] = _ms(time.monotonic() - t0)
        result.path = info.path
        result.files = len(info.files)
        ev(
            "cache.ready",
            digest=str(digest),
            stage="t4",
            state="cold",
            bytes=result.bytes_downloaded,
            bytes_total=result.bytes_total,
            bytes_resumed=result.bytes_resumed or None,
            files=result.files,
            duration_ms=timings["total"],
            path=info.path,
        )
        return result

    # ------------------------------------------------------------------ readers
    @contextlib.contextmanager
    def open_snapshot(self, reference: str | Reference) -> Iterator[SnapshotInfo]:
        """Use a cached model: holds a reader lease so GC and ``rm`` leave it alone. No network."""
        digest = self.resolve_local(reference)
        with self.snapshots.lease(digest) as info:
            yield info

    def snapshot_path(self, reference: str | Reference) -> str:
        digest = self.resolve_local(reference)
        info = self.snapshots.ready(digest)
        if info is None:
            raise NotFoundError(f"{reference}: {digest} is not ready in {self.root}")
        return info.path

    # ------------------------------------------------------------------ listing
    def ls(self) -> list[CacheEntry]:
        refs_by_digest: dict[str, list[str]] = {}
        for doc in self._all_refs():
            refs_by_digest.setdefault(doc["digest"], []).append(doc["reference"])
        out = []
        for info in self.snapshots.list_ready():
            d = str(info.digest)
            out.append(
                CacheEntry(
                    digest=d,
                    path=info.path,
                    size=info.size,
                    files=len(info.files),
                    references=sorted(refs_by_digest.get(d, [])),
                    repository=str(info.meta.get("repository", "")),
                    pinned=self.is_pinned(d),
                    in_use=self.snapshots.in_use(d),
                    last_used=info.last_used,
                    created=info.created,
                )
            )
        out.sort(key=lambda e: -e.last_used)
        return out

    def usage(self) -> int:
        """Bytes the cache holds: blobs (hard links are not counted twice) + extracted files."""
        total = self.store.size_on_disk()
        for info in self.snapshots.list_ready():
            total += sum(f.size for f in info.files if not f.linked)
        return total

    # ------------------------------------------------------------------ verify
    def verify(self, reference: str | None = None, *, repair: bool = True) -> list[VerifyReport]:
        """Re-hash snapshots on demand; a damaged one is unpublished and its bad blobs removed."""
        if reference is not None:
            digest = self.resolve_local(reference)
            info = self.snapshots.ready(digest)
            if info is None:
                raise NotFoundError(f"{reference}: {digest} is not ready in {self.root}")
            infos = [info]
        else:
            infos = self.snapshots.list_ready()
        reports = []
        for info in infos:
            t = time.monotonic()
            report = VerifyReport(str(info.digest), True, len(info.files), 0)
            bad_blobs: set[str] = set()
            for f in info.files:
                p = os.path.join(info.path, *f.path.split("/"))
                try:
                    actual, size = sha256_file(p)
                except FileNotFoundError:
                    report.problems.append(f"{f.path}: missing")
                    continue
                report.bytes += size
                if actual != f.digest or size != f.size:
                    report.problems.append(
                        f"{f.path}: expected {f.digest} ({f.size} B), got {actual} ({size} B)"
                    )
                    if f.linked:
                        bad_blobs.add(f.digest)
            try:
                verify_bytes(self.store.read_small(info.digest), info.digest, None, what="manifest")
            except (OSError, ModelpackError) as exc:
                report.problems.append(f"manifest: {exc}")
            report.ok = not report.problems
            report.seconds = time.monotonic() - t
            if not report.ok:
                self.events.emit(
                    "cache.verify_failed",
                    digest=str(info.digest),
                    reason="; ".join(report.problems)[:2000],
                    path=info.path,
                )
                if repair:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(self.snapshots.marker_path(info.digest))
                    for b in bad_blobs:
                        self.store.remove_blob(b)
                    with contextlib.suppress(SnapshotInUseError):
                        self.snapshots.remove(info.digest)
            else:
                self.events.emit(
                    "cache.verified",
                    digest=str(info.digest),
                    bytes=report.bytes,
                    duration_ms=_ms(report.seconds),
                )
            reports.append(report)
        return reports

    # ------------------------------------------------------------------ removal & GC
    def _manifest_blobs(self, digest: str) -> set[str]:
        """Digests a stored manifest keeps alive (itself, config, layers)."""
        try:
            raw = self.store.read_small(digest)
            parsed = parse_manifest_or_index(raw)
        except (OSError, ModelpackError):
            return {digest}
        if isinstance(parsed, Index):
            return {digest, *(str(m.digest) for m in parsed.manifests)}
        return {digest, str(parsed.config.digest), *(str(layer.digest) for layer in parsed.layers)}

    def _active_pull_digests(self) -> set[str]:
        return self._active_pulls()[1]

    def _active_pulls(self) -> tuple[list[str], set[str]]:
        """(manifest digests being pulled, every digest they need) from live pull leases."""
        manifests: list[str] = []
        out: set[str] = set()
        for entry in list(os.scandir(self.leases_dir)):
            fd = try_exclusive(entry.path)
            if fd is not None:  # nobody holds it: a crashed pull's lease
                os.close(fd)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
                continue
            try:
                with open(entry.path, "rb") as f:
                    doc = json.loads(f.read(16 * 1024 * 1024) or b"{}")
                out.update(str(d) for d in doc.get("digests", []))
                if doc.get("manifest"):
                    manifests.append(str(doc["manifest"]))
            except (OSError, ValueError):
                continue
        return manifests, out

    def _remove_refs_to(self, digest: str) -> int:
        n = 0
        for doc in self._all_refs():
            if doc["digest"] == digest:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(doc["_path"])
                    n += 1
        return n

    def _delete_unreferenced_blobs(self, protected: set[str]) -> tuple[int, int]:
        live: set[str] = set(protected)
        for m in self.store.manifest_digests():
            live |= self._manifest_blobs(m)
        removed = freed = 0
        for d in self.store.blob_digests():
            if d not in live:
                freed += self.store.remove_blob(d)
                removed += 1
        return removed, freed

    def rm(self, reference: str, *, force: bool = False) -> Digest:
        digest = self.resolve_local(reference)
        d = str(digest)
        with exclusive_lock(self.gc_lock_path):
            if self.is_pinned(d) and not force:
                raise CacheError(f"{reference}: {d} is pinned; 'modelpack cache unpin' it first (or --force)")
            if self.snapshots.in_use(d) and not force:
                raise SnapshotInUseError(f"{reference}: {d} is in use by a reader; retry when it is released")
            self._remove_refs_to(d)
            self.snapshots.remove(d, force=force)
            self.store.remove_manifest(d)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._pin_path(d))
            self._delete_unreferenced_blobs(self._active_pull_digests())
        self.events.emit("cache.evict", reference=reference, digest=d, reason="rm")
        return digest

    def sweep(self) -> list[str]:
        """Remove temp files, dead builders' snapshot dirs and finished partials."""
        return self.store.sweep() + self.snapshots.sweep()

    def gc(
        self,
        *,
        keep_versions: int | None = None,
        max_bytes: int | None = None,
        dry_run: bool = False,
    ) -> GCResult:
        """Evict least-recently-used snapshots: beyond ``keep_versions`` per repository, then until
        the cache is under ``max_bytes``. Never a pinned, in-use or being-pulled model. Deletes refs
        → snapshots → manifests → blobs no remaining manifest needs."""
        res = GCResult()
        with exclusive_lock(self.gc_lock_path):
            res.swept = [] if dry_run else self.sweep()
            res.bytes_before = self.usage()
            pulling_manifests, pulling = self._active_pulls()
            res.kept_pulling = sorted(set(pulling_manifests))
            infos = sorted(self.snapshots.list_ready(), key=lambda i: i.last_used)  # LRU first
            protected: set[str] = set()
            for info in infos:
                d = str(info.digest)
                if self.is_pinned(d):
                    res.kept_pinned.append(d)
                    protected.add(d)
                elif self.snapshots.in_use(d):
                    res.kept_in_use.append(d)
                    protected.add(d)
                elif d in pulling:
                    protected.add(d)
            evict: list[SnapshotInfo] = []
            reasons: dict[str, str] = {}
            if keep_versions is not None:
                by_repo: dict[str, list[SnapshotInfo]] = {}
                for info in infos:
                    by_repo.setdefault(str(info.meta.get("repository", "")), []).append(info)
                for group in by_repo.values():
                    newest_first = sorted(group, key=lambda i: -i.last_used)
                    for info in newest_first[max(0, keep_versions) :]:
                        if str(info.digest) not in protected:
                            evict.append(info)
                            reasons[str(info.digest)] = "keep_versions"
            if max_bytes is not None:
                usage = res.bytes_before - sum(self._freed_by(evict, infos, pulling))
                for info in infos:
                    if usage <= max_bytes:
                        break
                    d = str(info.digest)
                    if d in protected or d in reasons:
                        continue
                    freed = sum(self._freed_by([*evict, info], infos, pulling)) - sum(
                        self._freed_by(evict, infos, pulling)
                    )
                    evict.append(info)
                    reasons[d] = "max_bytes"
                    usage -= freed
            if dry_run:
                res.evicted = [str(i.digest) for i in evict]
                res.bytes_after = res.bytes_before
                return res
            # leftovers of pulls that died after storing their manifest or renaming their snapshot
            # directory but before the marker: never ready, so never trusted; remove them
            ready = {str(i.digest) for i in infos}
            for m in self.store.manifest_digests():
                if m not in ready and m not in pulling:
                    self.store.remove_manifest(m)
            for entry in list(os.scandir(self.snapshots.dir)):
                if len(entry.name) == 64 and entry.is_dir(follow_symlinks=False):
                    d = "sha256:" + entry.name
                    if d not in ready and d not in pulling:
                        with contextlib.suppress(SnapshotInUseError):
                            self.snapshots.remove(d)
                            res.swept.append(entry.path)
            evict.sort(key=lambda i: i.last_used)
            for info in evict:
                d = str(info.digest)
                t = time.monotonic()
                res.refs_removed += self._remove_refs_to(d)
                try:
                    self.snapshots.remove(d)
                except SnapshotInUseError:  # a reader arrived after our check
                    res.kept_in_use.append(d)
                    continue
                self.store.remove_manifest(d)
                res.evicted.append(d)
                self.events.emit(
                    "cache.evict",
                    digest=d,
                    reason=reasons[d],
                    bytes=info.size,
                    last_used=info.last_used,
                    idle_s=round(time.time() - info.last_used, 3),
                    duration_ms=_ms(time.monotonic() - t),
                )
            removed, freed = self._delete_unreferenced_blobs(pulling)
            res.blobs_removed = removed
            res.bytes_after = self.usage()
            res.bytes_freed = max(0, res.bytes_before - res.bytes_after)
        self.events.emit(
            "cache.gc",
            evicted=len(res.evicted),
            bytes=res.bytes_freed,
            blobs=res.blobs_removed,
            kept_in_use=len(res.kept_in_use),
            kept_pinned=len(res.kept_pinned),
            kept_pulling=len(res.kept_pulling),
        )
        return res

    def _freed_by(self, evict: list[SnapshotInfo], infos: list[SnapshotInfo], pulling: set[str]) -> list[int]:
        """Bytes that evicting ``evict`` would free: their extracted files + blobs nobody else uses."""
        gone = {str(i.digest) for i in evict}
        keep_blobs: set[str] = set(pulling)
        for info in infos:
            if str(info.digest) not in gone:
                keep_blobs |= info.blob_digests() | {str(info.digest)}
        sizes: dict[str, int] = {}
        extracted = 0
        for info in evict:
            extracted += sum(f.size for f in info.files if not f.linked)
            for b in info.blob_digests() | {str(info.digest)}:
                if b not in keep_blobs and b not in sizes:
                    try:
                        sizes[b] = os.stat(self.store.blob_path(b)).st_size
                    except FileNotFoundError:
                        sizes[b] = 0
        return [extracted, *sizes.values()]


def _unique_blobs(manifest: Manifest) -> list[Descriptor]:
    out: list[Descriptor] = []
    seen: set[str] = set()
    for d in [manifest.config, *manifest.layers]:
        if d.digest not in seen:
            seen.add(d.digest)
            out.append(d)
    return out


def _is_raw_layer(desc: Descriptor) -> bool:
    from modelpack.mediatypes import parse_layer_media_type

    lt = parse_layer_media_type(desc.media_type)
    return lt is not None and lt.is_raw
