"""A streamed load that fills the node cache as it goes: one registry read serves both (docs/loader.md).

``CacheStream(cache, REF@D)`` is a load source. On a hit (``snapshots/<hex>.ready``) it is the
cached snapshot, after the cache's own hit checks (``NodeCache.pull``: a policy's trust record,
rollback), so the start reads 0 registry blob bytes. On a miss the node cache's own pull runs in
a background thread (``NodeCache.pull``: the manifest lock, the signature policy, the per-blob
locks and resumable ``ingest/<hex>.partial`` files, the whole-blob size and sha256 check of the
one blob writer, the publish behind the ready marker, the trust record, the kept signature
referrers and the tag history — exactly what ``pull --cache`` does and records), and the load
reads its ranges from that ingest as the bytes land (``CacheFollowReader``): from the committed
blob once it is there, else from the growing partial (this process's or that of a concurrent
``pull --cache``, whose partial is followed the same way: one download per blob per node).

Reading a partial before its blob is verified is safe because the loader trusts nothing it
reads here: every chunk is checked against the signed chunk table, or the whole layer against
the manifest digest, before any tensor is handed out (``read_paths``). The snapshot is
published by the pull alone, only once every blob is committed; a ``kill -9`` leaves the pull's
resumable partials and no ready marker.

A rank that reads only its share (``tp_size`` or ``ep_size`` above 1) does not download the
rest by itself: with ``fill="leave"`` (default) it streams its share from the registry as any
streamed load, the snapshot stays unpublished, and the load says so (``loader.cache_left``,
``report.left_to == "fill"``: a ``pull --cache`` or the pre-warm fills it); with
``fill="background"`` the pull above runs and the rank reads its share from the cache as it
lands (every rank of a node asking for the same model shares the one download through the
cache's locks).
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from modelpack.loader.readers import _Counter
from modelpack.loader.weight_files import ResolvedSource

from modelpack.errors import (
    CacheFillStalledError,
    ExpectedDigestError,
    SourceError,
    TruncatedSourceError,
    UnpinnedReferenceError,
)
from modelpack.oci.descriptor import Descriptor
from modelpack.oci.digest import Digest
from modelpack.oci.reference import Reference, parse_reference

if TYPE_CHECKING:
    from modelpack.mount.cache import NodeCache, PullResult
    from modelpack.mount.store import Store
    from modelpack.mount.trust import PolicySource
    from modelpack.signing.chunks import ChunkTable

    from modelpack.oci.variant_selection import VariantSelector
    from modelpack.targets.base import ReadableTarget
    from modelpack.targets.options import TargetOptions

#: ``CacheStream.fill``: what a rank reading only its share does about the rest of the model
FILL_MODES = ("leave", "background")
#: a reader waits at most this long for a blob's bytes while nothing moves (no byte lands in its
#: partial, no blob is committed) before it gives up (``CacheFillStalledError``)
DEFAULT_STALL_S = 180.0
#: first and longest pause between two looks at a partial another process writes (this process's
#: own fill wakes its readers as its bytes land)
_POLL_S = (0.005, 0.05)


@dataclass
class StreamReport:
    """What the stream did to the node cache (``LoadStats``' neighbour; the CLI's ``--json``
    ``cache`` object)."""

    root: str
    state: str = ""  # hit | filled | share | failed
    published: bool = False
    path: str = ""  # the snapshot, once published
    left_to: str = ""  # a share: "fill" (left to a pull --cache / pre-warm) or "background"
    bytes_downloaded: int = 0  # blob bytes this process's fill fetched from the registry
    bytes_reused: int = 0  # blob bytes already in the cache (or fetched by a concurrent pull)
    error: str = ""
    wait_s: float = 0.0  # seconds the load waited for the fill to publish after its last tensor

    def to_json(self) -> dict[str, Any]:
        return {
            "root": self.root,
            "state": self.state,
            "published": self.published,
            "path": self.path or None,
            "leftTo": self.left_to or None,
            "bytesDownloaded": self.bytes_downloaded,
            "bytesReused": self.bytes_reused,
            "error": self.error or None,
            "publishWaitMs": round(self.wait_s * 1000, 3),
        }


@dataclass
class CacheStream:
    """A load source: stream ``reference`` (pinned by digest) and fill ``cache`` with it.

    ``policy`` is the signature policy the cache's pull checks (a ``TrustPolicy``, keys or a
    policy file); None takes the load's ``trusted_keys`` (the same keys then vouch for the chunk
    table and for the snapshot's trust record). ``jobs`` blobs are fetched at once. ``target``
    overrides the one the reference names (a mirrored or counting target), for the pull and the
    load alike.
    """

    cache: NodeCache
    reference: str | Reference
    target_options: TargetOptions | None = None
    target: ReadableTarget | None = None
    policy: PolicySource | None = None
    jobs: int = 8
    fill: str = "leave"
    stall_s: float = DEFAULT_STALL_S
    report: StreamReport = field(init=False)

    def __post_init__(self) -> None:
        if self.fill not in FILL_MODES:
            raise ValueError(f"fill={self.fill!r}: use one of {', '.join(FILL_MODES)}")
        self.report = StreamReport(self.cache.root)


class _Fill:
    """``NodeCache.pull`` on a background thread: its outcome, and a way to wait for it."""

    def __init__(
        self,
        stream: CacheStream,
        ref: Reference,
        policy: PolicySource | None,
        variant: VariantSelector | None,
    ) -> None:
        self.result: PullResult | None = None
        self.error: BaseException | None = None
        self.done = threading.Event()
        # bumped whenever this process's pull lands bytes (or ends): readers wait on it instead of
        # spinning; another process's writes are seen by the readers' bounded poll
        self.landed = 0
        self._cond = threading.Condition()
        self._thread = threading.Thread(
            target=self._run, args=(stream, ref, policy, variant), name="mp-stream-fill", daemon=True
        )
        self._thread.start()

    def _run(
        self,
        stream: CacheStream,
        ref: Reference,
        policy: PolicySource | None,
        variant: VariantSelector | None,
    ) -> None:
        try:
            self.result = stream.cache.pull(
                ref,
                stream.target_options,
                policy=policy,
                jobs=stream.jobs,
                variant=variant,
                source=stream.target,
                on_bytes=self._landed,
            )
        except BaseException as exc:  # handed to the readers and the report
            self.error = exc
        finally:
            self.done.set()
            self._landed(0)

    def _landed(self, n: int) -> None:
        with self._cond:
            self.landed += 1
            self._cond.notify_all()

    def wait_landed(self, seen: int, timeout: float) -> None:
        """Until bytes land after ``seen`` (``self.landed`` then), the pull ends, or ``timeout``."""
        with self._cond:
            self._cond.wait_for(lambda: self.landed != seen, timeout)

    def raise_if_failed(self) -> None:
        if self.error is not None:
            raise self.error

    def wait(self) -> None:
        self._thread.join()


class CacheFollowReader:
    """A blob read by ranges from the node cache's ingest while it is being filled: the committed
    blob once it is there, else the growing ``ingest/<hex>.partial``; a range not landed yet is
    waited for (the fill's failure is raised; no progress for ``stall_s`` is
    ``CacheFillStalledError``). Nothing read here is trusted: the loader verifies every byte."""

    local = True

    def __init__(
        self,
        store: Store,
        desc: Descriptor,
        fill: _Fill,
        *,
        name: str,
        stall_s: float,
        leftover: tuple[int, int] | None = None,
    ) -> None:
        self.store = store
        self.descriptor = desc
        self.size = desc.size
        self.name = name
        self._fill = fill
        self._stall_s = stall_s
        # (inode, bytes) of the partial that was there before this fill started: a crash's
        # leftover, verified only when its blob is committed, so its first bytes are never read
        # from it (the bytes a live writer appends after them come from the source)
        self._leftover = leftover
        self._fd = -1
        self._lock = threading.Lock()
        self._count = _Counter()

    @property
    def bytes_read(self) -> int:
        return self._count.value

    @property
    def reads(self) -> list[tuple[int, int, int]]:
        return self._count.reads

    def _committed(self) -> int:
        with self._lock:
            if self._fd >= 0:
                return self._fd
            if not self.store.has(self.descriptor):
                return -1
            try:
                fd = os.open(
                    self.store.blob_path(self.descriptor.digest), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
                )
            except OSError:
                return -1
            self._fd = fd
            return fd

    def _partial(self, offset: int, end: int) -> tuple[int, int]:
        """An open partial holding ``[offset, end)`` as its writer fetched it (fd, -1 otherwise)
        and its size. Of a leftover partial (there before the fill), the bytes it held then are
        not read until the writer started it over (it shrank): a resumed prefix is only re-hashed
        at the commit."""
        try:
            fd = os.open(
                self.store.partial_path(self.descriptor.digest), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
            )
        except OSError:
            return -1, -1
        st = os.fstat(fd)
        fresh_from = 0
        if self._leftover is not None and self._leftover[0] == st.st_ino:
            if st.st_size < self._leftover[1]:  # started over from zero: all it holds now is fetched
                self._leftover = None
            else:
                fresh_from = self._leftover[1]
        if offset >= fresh_from and st.st_size >= end and self.store.trusted(st):
            return fd, st.st_size
        os.close(fd)
        return -1, st.st_size

    def read_into(self, offset: int, buf: memoryview) -> None:
        self.read_scatter(offset, [buf])

    def read_scatter(self, offset: int, views: Sequence[memoryview]) -> None:
        want = sum(len(v) for v in views)
        if offset + want > self.size:
            raise TruncatedSourceError(self.name, offset, want, max(0, self.size - offset))
        end = offset + want
        seen = -2
        moved = time.monotonic()
        pause = _POLL_S[0]
        while True:
            landed = self._fill.landed
            fd = self._committed()
            if fd >= 0 and _preadv_all(fd, views, offset):
                break
            pfd, have = self._partial(offset, end)
            if pfd >= 0:
                try:
                    if _preadv_all(pfd, views, offset):  # short: truncated under us, wait again
                        break
                finally:
                    os.close(pfd)
            if self._fill.done.is_set():
                self._fill.raise_if_failed()
                if self._committed() < 0:
                    raise SourceError(
                        f"{self.name}: the node cache fill of {self.store.root} ended without blob "
                        f"{self.descriptor.digest}; refusing the load"
                    )
                continue
            now = time.monotonic()
            if have != seen:
                seen, moved = have, now
            elif now - moved > self._stall_s:
                raise CacheFillStalledError(
                    f"{self.name}: no byte of blob {self.descriptor.digest} landed in the node cache "
                    f"{self.store.root} for {self._stall_s:.0f}s (the fill holding its lock made no "
                    "progress); refusing the load"
                )
            self._fill.wait_landed(landed, pause)
            pause = min(pause * 2, _POLL_S[1])
        self._count.add(want, offset)

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


def _partials(store: Store) -> dict[str, tuple[int, int]]:
    """hex digest → (inode, size) of every resumable partial in the store's ``ingest/`` now."""
    from modelpack.mount.store import PARTIAL_SUFFIX

    out: dict[str, tuple[int, int]] = {}
    try:
        entries = list(os.scandir(store.ingest_dir))
    except OSError:
        return out
    for e in entries:
        if e.name.endswith(PARTIAL_SUFFIX):
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            out[e.name[: -len(PARTIAL_SUFFIX)]] = (st.st_ino, st.st_size)
    return out


def _preadv_all(fd: int, views: Sequence[memoryview], offset: int) -> bool:
    """Fill ``views`` from ``fd`` at ``offset``; False when the file ends first."""
    pos = offset
    for v in views:
        got = 0
        while got < len(v):
            n = os.preadv(fd, [v[got:]], pos + got)
            if n <= 0:
                return False
            got += n
        pos += len(v)
    return True


def _pinned(stream: CacheStream, expected_digest: str | None) -> Reference:
    ref = parse_reference(stream.reference) if isinstance(stream.reference, str) else stream.reference
    digest = str(ref.digest) if ref.digest else None
    if expected_digest:
        pin = str(Digest(expected_digest))
        if digest and digest != pin:
            raise ExpectedDigestError(pin, digest, source=str(ref))
        digest = pin
    if digest is None:
        raise UnpinnedReferenceError(
            f"{ref}: pin the manifest digest (@sha256:… or --expected-digest) to stream it into the node cache"
        )
    return dataclasses.replace(ref, tag=None, digest=Digest(digest))


def open_cache_stream(
    stream: CacheStream,
    *,
    share: bool,
    expected_digest: str | None,
    trusted_keys: Sequence[Any] | None,
    chunk_table: ChunkTable | None,
    allow_missing_chunk_table: bool,
    direct: bool,
    variant: VariantSelector | None,
) -> ResolvedSource:
    """The source a ``CacheStream`` stands for (module docstring): the snapshot on a hit, else the
    registry's manifest with its blobs read from the filling cache (or, for a share left to a
    fill, from the registry)."""
    from modelpack.loader.snapshot_source import open_cache_pair
    from modelpack.loader.target_source import open_target_source

    from modelpack.targets.opener import TargetOptions, open_readable

    ref = _pinned(stream, expected_digest)
    cache = stream.cache
    report = stream.report
    policy = stream.policy if stream.policy is not None else (list(trusted_keys) if trusted_keys else None)
    if cache.snapshots.ready(str(ref.digest)) is not None:
        # the cache's hit path: the trust record (or an online check), the rollback guard; no blob
        # (evicted since the look: then this pull filled it again, and it is read from there)
        hit = cache.pull(ref, stream.target_options, policy=policy, variant=variant, source=stream.target)
        src = open_cache_pair(
            cache, ref, expected_digest=str(ref.digest), direct=direct, trusted_keys=trusted_keys
        )
        report.state = "hit" if hit.state == "hit" else "filled"
        report.published, report.path = True, hit.path
        report.bytes_downloaded, report.bytes_reused = hit.bytes_downloaded, hit.bytes_reused
        return src
    target = stream.target or open_readable(
        ref, (stream.target_options or TargetOptions.from_environ()).bound_to(ref)
    )
    common: dict[str, Any] = {
        "expected_digest": str(ref.digest),
        "chunk_table": chunk_table,
        "trusted_keys": trusted_keys,
        "allow_missing_chunk_table": allow_missing_chunk_table,
        "direct": direct,
        "variant": variant,
    }
    if share and stream.fill == "leave":
        src = open_target_source(target, str(ref.digest), **common)
        report.state, report.left_to = "share", "fill"
        src.notices.append(
            (
                "loader.cache_left",
                {
                    "cache": cache.root,
                    "left_to": "fill",
                    "reason": "this rank reads only its share; the snapshot stays unpublished until "
                    f"a full fill (modelpack pull {ref} --cache {cache.root}, or the pre-warm)",
                },
            )
        )
        return src
    leftovers = _partials(cache.store)  # before the fill starts: what a crash may have left
    fill = _Fill(stream, ref, policy, variant)

    def follow(desc: Descriptor, name: str) -> CacheFollowReader:
        return CacheFollowReader(
            cache.store,
            desc,
            fill,
            name=name,
            stall_s=stream.stall_s,
            leftover=leftovers.get(Digest(desc.digest).hex),
        )

    try:
        src = open_target_source(target, str(ref.digest), blob_reader=follow, **common)
    except BaseException as exc:
        _finish(stream, fill, failed=exc)
        raise
    if share:
        report.left_to = "background"
    src.notices.append(
        (
            "loader.cache_stream",
            {"cache": cache.root, "left_to": report.left_to or None, "jobs": stream.jobs},
        )
    )
    src.state = "streamed"
    src._cleanup.insert(0, lambda: _finish(stream, fill))
    return src


def _finish(stream: CacheStream, fill: _Fill, failed: BaseException | None = None) -> None:
    """After the load: wait for the fill to publish (or fail) and report it. A load that failed
    on its own lets the fill finish: the verified model is cached for the next start."""
    t = time.monotonic()
    fill.wait()
    report = stream.report
    report.wait_s = time.monotonic() - t
    if fill.result is not None:
        report.state = "filled"
        report.published = True
        report.path = fill.result.path
        report.bytes_downloaded = fill.result.bytes_downloaded
        report.bytes_reused = fill.result.bytes_reused
        return
    report.state = "failed"
    err = fill.error or failed
    report.error = f"{type(err).__name__}: {err}" if err is not None else "the fill did not finish"


__all__ = ["FILL_MODES", "CacheFollowReader", "CacheStream", "StreamReport", "open_cache_stream"]
