"""The copy engine: ``copy(src, dst, ref)`` walks manifest → config → layers (→ referrers).

push, pull and cp are all this function between two targets. It skips blobs the destination
has, lets a destination mount across repositories when it can (from the source repository, from
``mount_from`` hints, and from the repositories this user pushed the same blobs to before, see
``pushed_blobs``), runs transfers concurrently, and
only then writes the manifest, so a tag never points at a manifest with missing blobs. Every
blob read from a source goes through a target's verified write (see ``Target.push_blob``); the
manifest bytes are copied exactly, never re-serialised, unless ``spec_names`` asks for the model
manifest in the other ModelPack naming (``modelpack.oci.spec_names``: a new manifest over the same
blobs; referrers are then refused, their signatures name the old digest). The first blob that fails stops the
others: none queued after it starts, and those in flight stop within one chunk.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from modelpack.errors import ManifestError, RegistryError
from modelpack.mediatypes import SpecNames
from modelpack.oci.descriptor import Descriptor, Index, Manifest, parse_manifest_or_index
from modelpack.oci.spec_names import respelled_manifest
from modelpack.progress import CountingReader, Progress, TransferBar
from modelpack.targets.base import BlobMounter, BlobSource, LocalBlobSource, ReadableTarget, Target
from modelpack.transfer.cancel import Cancel, CancellableReader
from modelpack.transfer.pushed_blobs import PushedBlobs, mount_candidates
from modelpack.transfer.workers import run_all

DEFAULT_JOBS = 4


@dataclass
class CopyResult:
    descriptor: Descriptor
    manifest: Manifest | Index
    blobs_total: int = 0
    blobs_copied: int = 0
    blobs_skipped: int = 0
    blobs_mounted: int = 0
    bytes_copied: int = 0
    bytes_skipped: int = 0
    referrers: list[Descriptor] = field(default_factory=list)
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "digest": str(self.descriptor.digest),
            "mediaType": self.descriptor.media_type,
            "size": self.descriptor.size,
            "blobs": {
                "total": self.blobs_total,
                "copied": self.blobs_copied,
                "skipped": self.blobs_skipped,
                "mounted": self.blobs_mounted,
            },
            "bytes": {"copied": self.bytes_copied, "skipped": self.bytes_skipped},
            "referrers": [str(r.digest) for r in self.referrers],
            "seconds": round(self.seconds, 3),
        }

    def add(self, sub: CopyResult) -> None:
        """Count a child manifest's blobs (an index's) into this result."""
        self.blobs_total += sub.blobs_total
        self.blobs_copied += sub.blobs_copied
        self.blobs_skipped += sub.blobs_skipped
        self.blobs_mounted += sub.blobs_mounted
        self.bytes_copied += sub.bytes_copied
        self.bytes_skipped += sub.bytes_skipped


def blob_source_for(
    src: ReadableTarget, desc: Descriptor, bar: TransferBar | None = None, cancel: Cancel | None = None
) -> BlobSource:
    """A BlobSource reading ``desc`` from ``src``; offers a local path when the source has one.
    With ``cancel``, a read after a sibling failed stops the transfer (``TransferCancelled``)."""

    def wrap(raw: Any) -> Any:
        if cancel is not None:
            raw = CancellableReader(raw, cancel)
        return CountingReader(raw, bar)

    if isinstance(src, LocalBlobSource):
        source = src.blob_source(desc)
        if bar is None and cancel is None:
            return source
        inner = source.opener
        return dataclasses.replace(source, opener=lambda off: wrap(inner(off)))  # keeps its recheck
    return BlobSource(desc, lambda off: wrap(src.fetch_blob(desc, off)))


def _blobs_of(manifest: Manifest, layer_filter: Callable[[Descriptor], bool] | None) -> list[Descriptor]:
    layers = [lyr for lyr in manifest.layers if layer_filter is None or layer_filter(lyr)]
    out: list[Descriptor] = []
    seen: set[str] = set()
    for d in [manifest.config, *layers]:
        if d.digest not in seen:
            seen.add(d.digest)
            out.append(d)
    return out


@dataclass
class _CopyJob:
    """What every level of one copy shares: the two ends, the settings, the mount record."""

    src: ReadableTarget
    dst: Target
    jobs: int
    progress: str
    on_event: Callable[[dict[str, Any]], None] | None
    mount_from: Sequence[str]
    record: PushedBlobs | None
    host: str | None
    spec_names: SpecNames | None = None


def copy(
    src: ReadableTarget,
    dst: Target,
    src_ref: str,
    dst_tag: str | None = None,
    *,
    jobs: int = DEFAULT_JOBS,
    referrers: bool = False,
    progress: str = "auto",
    on_event: Callable[[dict[str, Any]], None] | None = None,
    mount_from: Sequence[str] = (),
    record: PushedBlobs | None = None,
    spec_names: SpecNames | None = None,
) -> CopyResult:
    """Copy the manifest (or index) named by ``src_ref`` and everything it references.

    ``dst_tag`` tags the result in ``dst`` (None: push by digest only). With ``referrers=True``
    the manifests that refer to it (signatures, chunk tables) are copied too, recursively.
    A registry destination mounts a missing blob from ``mount_from`` (repositories of the same
    registry) or from where the per-user record says it was pushed, and records where it put
    every blob for the next push.

    ``spec_names`` writes the model manifest with its ModelPack media types in that naming (the
    same blobs, a new manifest digest unless it already was in that naming); an index or a
    manifest that is not a model is refused, and so is ``referrers`` (the signatures sign the
    old digest).
    """
    if spec_names is not None and referrers:
        raise ManifestError(
            "--spec-names writes a new manifest digest, and referrers (signatures) name the old one: "
            "copy without --referrers and sign the copy"
        )
    host = dst.registry_host if isinstance(dst, BlobMounter) else None
    if record is None and host is not None:
        record = PushedBlobs()
    job = _CopyJob(src, dst, jobs, progress, on_event, mount_from, record, host, spec_names)
    return _copy_manifest(job, src_ref, dst_tag, referrers)


def _copy_manifest(job: _CopyJob, src_ref: str, dst_tag: str | None, referrers: bool) -> CopyResult:
    """One manifest or index: its blobs (an index's child manifests) first, itself next, then
    (``referrers``) the manifests that refer to it."""
    start = time.monotonic()
    desc = job.src.resolve(src_ref)
    raw, media_type = job.src.fetch_manifest(str(desc.digest))
    parsed: Manifest | Index = parse_manifest_or_index(raw, media_type)
    if job.spec_names is not None:
        parsed = respelled_manifest(parsed, job.spec_names)
        raw = parsed.raw
    result = CopyResult(descriptor=desc, manifest=parsed)
    if isinstance(parsed, Index):
        for child in parsed.manifests:
            result.add(_copy_manifest(job, str(child.digest), None, referrers))
    else:
        _copy_blobs(job, desc, parsed, result)
    pushed = job.dst.push_manifest(raw, desc.media_type, dst_tag)
    result.descriptor = Descriptor(
        pushed.media_type,
        pushed.digest,
        pushed.size,
        artifact_type=pushed.artifact_type
        or (parsed.artifact_type if job.spec_names is not None and isinstance(parsed, Manifest) else None)
        or desc.artifact_type,
    )
    if referrers:
        for r in job.src.referrers(desc):
            copy(
                job.src,
                job.dst,
                str(r.digest),
                None,
                jobs=job.jobs,
                referrers=True,
                progress="off",
                on_event=job.on_event,
            )
            result.referrers.append(r)
    result.seconds = time.monotonic() - start
    return result


def _copy_blobs(job: _CopyJob, desc: Descriptor, manifest: Manifest, result: CopyResult) -> None:
    """The config and layers the destination lacks, mounted when it can, else streamed."""
    blobs = _blobs_of(manifest, None)
    result.blobs_total = len(blobs)
    todo = _missing(job.dst, blobs, result)
    mounted = _mounter(job)
    cancel = Cancel()
    with Progress(sum(b.size for b in todo), f"copy {desc.digest.hex[:12]}", job.progress) as prog:

        def transfer(b: Descriptor) -> str:
            if mounted(b):
                prog.update(b.size)
                return "mounted"
            bar = prog.transfer(b.size, b.digest.hex[:12]) if prog.enabled else None
            try:
                job.dst.push_blob(blob_source_for(job.src, b, bar, cancel))
            finally:
                if bar is not None:
                    bar.close()
            return "copied"

        outcomes = run_all(todo, transfer, job.jobs, cancel)
    for b, outcome in zip(todo, outcomes, strict=True):
        if outcome == "mounted":
            result.blobs_mounted += 1
        else:
            result.blobs_copied += 1
            result.bytes_copied += b.size
        if job.on_event:
            job.on_event({"event": f"blob.{outcome}", "digest": str(b.digest), "bytes": b.size})
    if job.record is not None and job.host is not None and isinstance(job.dst, BlobMounter):
        job.record.remember(job.host, job.dst.repository, [str(b.digest) for b in blobs])
        job.record.save()


def _missing(dst: Target, blobs: list[Descriptor], result: CopyResult) -> list[Descriptor]:
    """The blobs ``dst`` does not have yet; the others are counted as skipped."""
    todo: list[Descriptor] = []
    for b in blobs:
        if dst.exists(b):
            result.blobs_skipped += 1
            result.bytes_skipped += b.size
        else:
            todo.append(b)
    return todo


def _mounter(job: _CopyJob) -> Callable[[Descriptor], bool]:
    """Whether a blob could be mounted into ``dst`` instead of sent: from the source repository,
    then from the ``mount_from`` hints and the push record's repositories."""
    dst = job.dst
    if not isinstance(dst, BlobMounter):
        return lambda b: False

    def mounted(b: Descriptor) -> bool:
        if dst.try_mount(b, job.src):
            return True
        if job.host is None:
            return False
        for repo in mount_candidates(job.record, job.host, dst.repository, b.digest, job.mount_from):
            try:
                if dst.try_mount_from(b, repo):
                    return True
            except RegistryError:
                continue  # a hint, not a requirement: e.g. no pull access there; upload instead
        return False

    return mounted
