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

Reading a partial before its blob is verified is safe because nothing read there is handed out
unchecked: staged reads check every chunk against the signed chunk table, or the whole layer
against the manifest digest; host reads are held until the cache verified the very file they
came from (``loader.settled``, ``cache_follow.CacheFollowReader.settle``). The snapshot is
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
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from modelpack.loader.cache_follow import (
    DEFAULT_STALL_S,
    CacheFill,
    CacheFollowReader,
    StreamReport,
    partials_now,
)
from modelpack.loader.weight_files import ResolvedSource

from modelpack.errors import (
    ExpectedDigestError,
    UnpinnedReferenceError,
)
from modelpack.oci.descriptor import Descriptor
from modelpack.oci.digest import Digest
from modelpack.oci.reference import Reference, parse_reference

if TYPE_CHECKING:
    from modelpack.mount.cache import NodeCache, PullResult
    from modelpack.mount.trust import PolicySource
    from modelpack.signing.chunks import ChunkTable

    from modelpack.oci.variant_selection import VariantSelector
    from modelpack.targets.base import ReadableTarget
    from modelpack.targets.options import TargetOptions

#: ``CacheStream.fill``: what a rank reading only its share does about the rest of the model
FILL_MODES = ("leave", "background")
#: ``CacheStream.publish``: whether the load returns after the snapshot is published (``wait``: a
#: process that exits next, the CLI) or once its tensors are verified (``background``: a process
#: that keeps running, a serving engine; ``CacheStream.wait`` joins the fill)
PUBLISH_MODES = ("wait", "background")


@dataclass
class CacheStream:
    """A load source: stream ``reference`` (pinned by digest) and fill ``cache`` with it.

    ``policy`` is the signature policy the cache's pull checks (a ``TrustPolicy``, keys or a
    policy file); None takes the load's ``trusted_keys`` (the same keys then vouch for the chunk
    table and for the snapshot's trust record). ``jobs`` blobs are fetched at once. ``target``
    overrides the one the reference names (a mirrored or counting target), for the pull and the
    load alike.

    ``publish="background"`` takes the cache's durable commit (each blob's fsync and rename, the
    snapshot's publish) off the start: the load returns once every tensor is verified, and the
    fill finishes on its daemon thread; ``wait()`` joins it. A process that exits first leaves the
    fill's resumable partials and no snapshot (the next pull or start resumes them).
    """

    cache: NodeCache
    reference: str | Reference
    target_options: TargetOptions | None = None
    target: ReadableTarget | None = None
    policy: PolicySource | None = None
    jobs: int = 8
    fill: str = "leave"
    stall_s: float = DEFAULT_STALL_S
    publish: str = "wait"
    report: StreamReport = field(init=False)
    _fill: CacheFill | None = field(init=False, default=None, repr=False)

    def __post_init__(self) -> None:
        if self.fill not in FILL_MODES:
            raise ValueError(f"fill={self.fill!r}: use one of {', '.join(FILL_MODES)}")
        if self.publish not in PUBLISH_MODES:
            raise ValueError(f"publish={self.publish!r}: use one of {', '.join(PUBLISH_MODES)}")
        self.report = StreamReport(self.cache.root)

    def wait(self, timeout: float | None = None) -> StreamReport:
        """Wait (at most ``timeout`` seconds) for this stream's fill to publish or fail, and
        return the report (at once when there is no fill: a hit, a share left to a fill)."""
        if self._fill is not None:
            self._fill.wait(timeout)
        return self.report


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
    leftovers = partials_now(cache.store)  # before the fill starts: what a crash may have left

    def pull(watch: CacheFill) -> PullResult:
        return cache.pull(
            ref,
            stream.target_options,
            policy=policy,
            jobs=stream.jobs,
            variant=variant,
            source=stream.target,
            watch=watch,
        )

    fill = stream._fill = CacheFill(pull, report, writeback=stream.publish == "wait")

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
    except BaseException:
        _finish(stream, fill)
        raise
    if share:
        report.left_to = "background"
    else:  # a full load: the cache's whole-blob check vouches for what it reads (loader.settled)
        for f in src.files:
            f.settled = True
    src.notices.append(
        (
            "loader.cache_stream",
            {"cache": cache.root, "left_to": report.left_to or None, "jobs": stream.jobs},
        )
    )
    src.state = "streamed"
    src._cleanup.insert(
        0, fill.publishing if stream.publish == "background" else lambda: _finish(stream, fill)
    )
    return src


def _finish(stream: CacheStream, fill: CacheFill) -> None:
    """After the load (``publish="wait"``): wait for the fill to publish or fail (its outcome is
    in the report). A load that failed on its own lets the fill finish: the verified model is
    cached for the next start."""
    t = time.monotonic()
    fill.wait()
    stream.report.wait_s = time.monotonic() - t


__all__ = [
    "FILL_MODES",
    "PUBLISH_MODES",
    "CacheFollowReader",
    "CacheStream",
    "StreamReport",
    "open_cache_stream",
]
