"""Materialise an artifact from any target as files at their paths in a directory, verified.

Nothing unverified is ever at a final path, and nothing a person had there is lost: a raw layer
is downloaded to a resumable ``.partial`` next to its path and renamed once its digest matched
(``download``); a tar layer (the image-shaped variant's, under ``models/``, and ModelPack ``tar`` /
``tar+gzip`` / ``tar+zstd``) is extracted into a locked staging directory with every member
checked, counted and claimed (``untar``) while its blob digest is computed over the same stream,
and its files are renamed into place only after the whole blob matched (files are not hashed one
by one: their bytes are part of the verified blob; a staged file is hashed only to compare it
with a same-sized file already at the destination). Files that differ from what is at the destination are refused unless
``force``; files the artifact does not contain are reported, removed only with ``delete``
(``destination``). What is written is capped by the free space (or ``max_bytes``) and counted
as tar layers expand. Layers go in two phases, tar layers first, so that a conflict found inside
a tar layer is refused before any file is written. The first failure, a signal or a closed
output cancels the other transfers within one chunk; each removes its temp files on the way out
(only a partial download kept for a resume stays, and the error names it), and a later pull
resumes or sweeps what a killed one left (``staging``).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from modelpack.errors import (
    DestinationConflictError,
    DiskFullError,
    FileWriteError,
    LayerFormatError,
    PullError,
)
from modelpack.file_selection import file_selector
from modelpack.files import DirSyncs, free_bytes, write_error
from modelpack.mediatypes.annotations import layer_filepath, restored_mode
from modelpack.oci.descriptor import Descriptor, Manifest
from modelpack.oci.digest import HASH_CHUNK, VerifyingReader, sha256_file
from modelpack.progress import Progress
from modelpack.targets.base import ReadableTarget, SourceAccounting
from modelpack.targets.fetch import fetch_config, fetch_manifest
from modelpack.transfer import destination
from modelpack.transfer.blob_writer import Downloaded, Landing, WriteHooks, fetch_verified
from modelpack.transfer.cancel import Cancel, CancellableReader
from modelpack.transfer.dest_lock import destination_locked
from modelpack.transfer.layer_formats import (
    LayerFormat,
    diff_ids_to_hash,
    manifest_layer_formats,
    needs_config,
)
from modelpack.transfer.pull_document import pull_document
from modelpack.transfer.pull_options import PullOptions
from modelpack.transfer.staging import BesideFinal, StagingDir, partial_path, sweep
from modelpack.transfer.untar import ClaimedPaths, ExpansionBudget, extract_tar_files
from modelpack.transfer.workers import run_all

# How each layer becomes files (raw, or which tar with which prefix stripped and which members
# passed over) is transfer.layer_formats' one table, shared with the node cache and the loader.


@dataclass(frozen=True)
class LayerJob:
    """One layer to materialise: raw layers name their file; tar layers hold theirs inside."""

    descriptor: Descriptor
    relpath: str | None
    dest_dir: str
    format: LayerFormat | None = None  # a tar layer's: compression, prefix, members passed over
    diff_id: str | None = None  # what a tar layer's uncompressed stream must hash to (an image's)

    @property
    def final_path(self) -> str:
        assert self.relpath is not None
        return os.path.join(self.dest_dir, *self.relpath.split("/"))


@dataclass
class PullPlan:
    raw: list[LayerJob]  # raw files selected by include/exclude
    tar: list[LayerJob]  # every tar layer (the filters apply to the files inside)
    raw_paths: dict[str, str]  # every raw file of the artifact → its layer digest


def plan_layers(
    manifest: Manifest,
    dest_dir: str,
    include: Sequence[str] = (),
    exclude: Sequence[str] = (),
    *,
    config: Callable[[], bytes] | None = None,
) -> PullPlan:
    """Which layers go where; refuses raw layers without a path, unsafe paths, two raw layers with
    different content at one path, and formats pull cannot write (before downloading anything).
    ``config`` reads the manifest's config, verified: an image's ``rootfs.diff_ids`` vouch for
    its tar layers (``layer_formats.diff_ids_to_hash``)."""
    select = file_selector(include, exclude)
    plan = PullPlan([], [], {})
    formats = manifest_layer_formats(manifest)
    diff_ids: list[str | None] = [None] * len(formats)
    if needs_config(manifest) and any(fmt.is_tar for fmt in formats):
        diff_ids = diff_ids_to_hash(manifest, config() if config is not None else None)
    for i, (layer, fmt) in enumerate(zip(manifest.layers, formats, strict=True)):
        if fmt.is_tar:
            plan.tar.append(LayerJob(layer, None, dest_dir, fmt, diff_id=diff_ids[i]))
            continue
        relpath = layer_filepath(layer.annotations)
        if relpath is None:
            raise PullError(f"layer {i} ({layer.digest}) has no file path annotation")
        seen = plan.raw_paths.get(relpath)
        if seen is not None and seen != layer.digest:
            raise PullError(f"two layers claim {relpath!r}: {seen} and {layer.digest}")
        if seen is not None:
            continue
        plan.raw_paths[relpath] = str(layer.digest)
        if select is None or select(relpath):
            plan.raw.append(LayerJob(layer, relpath, dest_dir))
    return plan


@dataclass
class PullResult:
    digest: str
    dest_dir: str
    files: list[str] = field(default_factory=list)  # the artifact's files now at the destination
    downloaded: int = 0  # files written by this pull
    present: int = 0  # files that were already there, identical
    replaced: list[str] = field(default_factory=list)  # differing files overwritten (force)
    bytes_downloaded: int = 0  # bytes fetched from the source
    resumed_bytes: int = 0  # bytes of kept partial downloads reused instead
    extra_files: list[str] = field(default_factory=list)  # at the destination, not in the artifact
    deleted: list[str] = field(default_factory=list)  # removed by delete
    swept: list[str] = field(default_factory=list)  # temp entries of dead pulls removed
    bytes_by_source: dict[str, int] = field(default_factory=dict)  # mirror/origin → blob bytes
    seconds: float = 0.0
    #: set by the trusted pull (``api.transfer.pull_trusted``): the reference as asked for, the
    #: trust step's verdict, the index entry taken, and the start these events belong to
    reference: str = ""
    signature: str = "not-checked"
    variant: dict[str, Any] | None = None
    start_id: str = ""

    def to_json(self) -> dict[str, Any]:
        """``pull --json`` for a directory (``pull_document``: the same keys as a cache pull)."""
        return pull_document(
            mode="directory",
            reference=self.reference,
            digest=self.digest,
            path=self.dest_dir,
            files=len(self.files),
            bytes_downloaded=self.bytes_downloaded,
            bytes_by_source=self.bytes_by_source,
            timings_ms={"total": round(self.seconds * 1000.0, 3)},
            signature=self.signature,
            start_id=self.start_id,
            variant=self.variant,
            details={
                "paths": self.files,
                "downloaded": self.downloaded,
                "present": self.present,
                "replaced": self.replaced,
                "resumedBytes": self.resumed_bytes,
                "extraFiles": self.extra_files,
                "deleted": self.deleted,
            },
        )


def _budget(dest: str, max_bytes: int | None, raw_bytes: int) -> ExpansionBudget:
    """What this pull may write: the free space of the destination's filesystem, or less with
    ``max_bytes``. Raw files (sizes known) are charged now; tar layers as they expand."""
    try:
        free: int | None = free_bytes(dest)
    except OSError:
        free = None
    if max_bytes is not None and (free is None or max_bytes <= free):
        limit, described = max_bytes, f"--max-bytes ({max_bytes} bytes)"
        if raw_bytes > limit:
            raise PullError(f"{dest}: the files to download take {raw_bytes} bytes, more than {described}")
    elif free is not None:
        limit, described = free, f"the free space on {dest} ({free} bytes)"
        if raw_bytes > limit:
            raise DiskFullError(
                dest,
                f"the files to download take {raw_bytes} bytes but only {free} bytes are free; "
                "free space, or pull fewer files with --include/--exclude",
            )
    else:
        return ExpansionBudget(None)
    return ExpansionBudget(limit - raw_bytes, described)


@dataclass
class _Staged:
    dir: StagingDir
    files: list[tuple[str, int]]  # (relpath, size) inside dir, their blob's digest verified

    def digest_of(self, rel: str) -> Callable[[], str]:
        """The staged file's sha256, computed when asked (only to compare with a file already
        at the destination: the blob digest already proved these bytes)."""
        return lambda: str(sha256_file(os.path.join(self.dir.path, *rel.split("/")))[0])


def _stage_tar(
    target: ReadableTarget,
    job: LayerJob,
    claims: ClaimedPaths,
    budget: ExpansionBudget,
    select: Callable[[str], bool] | None,
    prog: Progress,
    cancel: Cancel,
    keep_prefix: bool = False,
) -> _Staged:
    """Extract one tar layer into a locked staging directory; the blob digest is checked to the
    last byte before the files count as staged."""
    desc, fmt = job.descriptor, job.format
    assert fmt is not None and fmt.is_tar
    where = f"layer {desc.digest}"
    staging = StagingDir(job.dest_dir)
    bar = prog.transfer(desc.size, where[6:25]) if prog.enabled else None
    try:
        src = CancellableReader(target.fetch_blob(desc), cancel, bar)
        reader = VerifyingReader(src, desc.digest, desc.size, source=f"{target.name} ({where})")  # type: ignore[arg-type]
        try:
            try:
                files = extract_tar_files(
                    reader,  # type: ignore[arg-type]
                    staging.path,
                    fmt.strip,
                    blob_format=fmt.format,
                    diff_id=job.diff_id,
                    where=where,
                    existing=claims,
                    budget=budget,
                    select=select,
                    outside=fmt.outside,
                    keep_prefix=keep_prefix,
                )
            except LayerFormatError:
                while reader.read(HASH_CHUNK):  # a corrupt download says so (digest) before "corrupt layer"
                    pass
                raise
            while reader.read(HASH_CHUNK):  # the digest check happens at EOF
                pass
        finally:
            reader.close()
    except FileWriteError as exc:
        staging.remove()
        raise type(exc)(exc.path.replace(staging.path, job.dest_dir), exc.reason) from exc
    except BaseException:
        staging.remove()
        raise
    finally:
        if bar is not None:
            bar.close()
    return _Staged(staging, files)


def _publish_staged(
    staged: list[_Staged], dest: str, force: bool, result: PullResult, dirs: DirSyncs
) -> dict[str, str]:
    """Check staged files against the destination, then rename them into place; returns each
    file's outcome. Conflicts are refused before any file moves."""
    places = [
        (s, rel, destination.placement(dest, rel, s.digest_of(rel), size))
        for s in staged
        for rel, size in s.files
    ]
    conflicts = [p.conflict for _, _, p in places if p.state == destination.DIFFERS]
    if conflicts and not force:
        raise DestinationConflictError(dest, sorted(conflicts))
    outcome: dict[str, str] = {}
    for s, rel, place in places:
        if place.state == destination.SAME:
            outcome[rel] = "present"
            continue
        destination.publish(os.path.join(s.dir.path, *rel.split("/")), dest, rel, dirs)
        outcome[rel] = "replaced" if place.state == destination.DIFFERS else "downloaded"
    return outcome


@contextlib.contextmanager
def _syncing(dirs: DirSyncs) -> Iterator[None]:
    """fsync the directories renamed into once the transfers are over: on success a failure to
    persist them is the pull's error; after a failure, what did land is persisted best-effort."""
    try:
        yield
    except BaseException:
        with contextlib.suppress(OSError, FileWriteError):
            dirs.sync()
        raise
    dirs.sync()


def _ensure_dest(dest: str) -> None:
    try:
        os.makedirs(dest, exist_ok=True)
    except OSError as exc:
        raise write_error(dest, exc) from exc


def pull_to_directory(
    target: ReadableTarget,
    identifier: str,
    dest_dir: str,
    options: PullOptions | None = None,
) -> PullResult:
    """Download the artifact ``identifier`` (tag or digest) from ``target`` into ``dest_dir``.

    Container-image layers (the image-shaped variant, KServe modelcars) put the files under the
    image's ``models/`` at their paths below it, or below ``models/`` with ``keep_prefix``.

    Files already present with the right digest are kept (a second pull downloads nothing); a
    file that differs is a ``DestinationConflictError`` unless ``options.force``; files the
    artifact does not contain are listed in ``extra_files`` and removed only with
    ``options.delete``. One pull at a time per directory (``dest_lock``): a concurrent one waits,
    so a return means the directory holds exactly this artifact's files. Nothing here checks a
    signature: callers pin ``identifier`` with ``mount.resolve.resolve_trusted`` first.
    """
    dest = os.path.abspath(dest_dir)
    _ensure_dest(dest)
    with destination_locked(dest):
        return _pull_locked(target, identifier, dest, options or PullOptions())


def _pull_locked(target: ReadableTarget, identifier: str, dest_dir: str, options: PullOptions) -> PullResult:
    """``pull_to_directory`` once the destination is held."""
    start = time.monotonic()
    manifest, digest = fetch_manifest(target, identifier)
    dest = os.path.abspath(dest_dir)
    _ensure_dest(dest)
    include, exclude, jobs, force = options.include, options.exclude, options.jobs, options.force
    plan = plan_layers(manifest, dest, include, exclude, config=lambda: fetch_config(target, manifest))
    select = file_selector(include, exclude)
    claims = ClaimedPaths()
    for rel, layer_digest in plan.raw_paths.items():
        claims.claim(rel, f"layer {layer_digest}")

    places = {
        job.relpath: destination.placement(dest, job.relpath, job.descriptor.digest, job.descriptor.size)
        for job in plan.raw
        if job.relpath is not None
    }
    conflicts = sorted(p.conflict for p in places.values() if p.state == destination.DIFFERS)
    if conflicts and not force:
        raise DestinationConflictError(dest, conflicts)
    fetch = [job for job in plan.raw if places[job.relpath].state != destination.SAME]  # type: ignore[index]
    for job in plan.raw:  # a file already there, right bytes: its mode mended to the recorded one
        if places[job.relpath].state == destination.SAME:  # type: ignore[index]
            destination.set_mode(job.final_path, restored_mode(job.descriptor.annotations))
    partials = {job.relpath: partial_path(job.final_path, job.descriptor.digest) for job in fetch}
    result = PullResult(digest=digest, dest_dir=dest)
    result.swept = sweep(dest, keep=partials.values())
    raw_bytes = sum(job.descriptor.size - _size(partials[job.relpath]) for job in fetch)
    budget = _budget(dest, options.max_bytes, raw_bytes)
    cancel = Cancel()
    dirs = DirSyncs()  # each directory fsynced once, after the renames into it
    outcome: dict[str, str] = {}
    total = sum(j.descriptor.size for j in plan.tar) + sum(j.descriptor.size for j in fetch)
    with _syncing(dirs), Progress(total, f"pull {digest[7:19]}", options.progress) as prog:
        staged = run_all(
            plan.tar,
            lambda job: _stage_tar(target, job, claims, budget, select, prog, cancel, options.keep_prefix),
            jobs,
            cancel,
            discard=lambda staged_layer: staged_layer.dir.remove(),
        )
        try:
            outcome.update(_publish_staged(staged, dest, force, result, dirs))
        finally:
            for s in staged:
                s.dir.remove()
        result.bytes_downloaded += sum(j.descriptor.size for j in plan.tar)

        def download(job: LayerJob) -> Downloaded:
            assert job.relpath is not None
            destination.make_parents(dest, job.relpath)
            bar = prog.transfer(job.descriptor.size, job.relpath) if prog.enabled else None
            try:
                return fetch_verified(
                    target,
                    job.descriptor,
                    BesideFinal(partials[job.relpath]),
                    Landing(
                        job.final_path,
                        mode=restored_mode(job.descriptor.annotations),
                        dirs=dirs,
                        root=dest,
                        what=f"blob for {job.final_path}",
                    ),
                    WriteHooks(
                        cancel=cancel,
                        on_bytes=bar.update if bar is not None else None,
                        on_resume=bar.update if bar is not None else None,
                    ),
                )
            finally:
                if bar is not None:
                    bar.close()

        for got in run_all(fetch, download, jobs, cancel):
            result.bytes_downloaded += got.fetched
            result.resumed_bytes += got.resumed
    for job in plan.raw:
        assert job.relpath is not None
        state = places[job.relpath].state
        outcome[job.relpath] = {"same": "present", "differs": "replaced"}.get(state, "downloaded")
    order = [j.relpath for j in plan.raw if j.relpath] + [rel for s in staged for rel, _ in s.files]
    result.files = order
    for rel in order:
        kind = outcome[rel]
        if kind == "present":
            result.present += 1
        else:
            result.downloaded += 1
            if kind == "replaced":
                result.replaced.append(rel)
    result.replaced.sort()
    artifact_files = claims.files()
    result.extra_files = destination.extra_files(dest, artifact_files)
    if options.delete and result.extra_files:
        result.deleted = destination.delete_extra(dest, result.extra_files, artifact_files)
        result.extra_files = []
    # Only registry targets with mirrors count their sources; others have nothing to say.
    result.bytes_by_source = target.bytes_by_source() if isinstance(target, SourceAccounting) else {}
    result.seconds = time.monotonic() - start
    return result


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


__all__ = [
    "LayerJob",
    "PullOptions",
    "PullPlan",
    "PullResult",
    "file_selector",
    "plan_layers",
    "pull_to_directory",
    "run_all",
]
