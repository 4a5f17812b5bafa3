"""Materialise an artifact from any target as files at their paths, verified.

Each file is downloaded to a temp name in its destination directory, checked for size and digest
as it streams, fsynced, and only then renamed to its final path: nothing unverified is ever at a
final path, and a failure leaves no partial file (a file already at the path is left untouched).

How a layer becomes files depends on its format: ``.raw`` layers are handled here, tar layers
(the image-shaped variant's, under ``models/``, and ModelPack ``tar`` / ``tar+gzip`` /
``tar+zstd``) by ``modelpack.transfer.untar``. The choice is a fixed table, so what pull
supports does not depend on which modules happen to be imported; a layer whose format has no
materializer is refused with ``UnsupportedLayerError`` (never skipped silently).
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
import posixpath
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from modelpack.errors import PullError, UnsafePathError, UnsupportedLayerError
from modelpack.files import TEMP_PREFIX, fsync_dir
from modelpack.mediatypes import (
    MEDIA_TYPE_IMAGE_LAYER_TAR,
    MEDIA_TYPE_IMAGE_LAYER_TAR_GZIP,
    MEDIA_TYPE_IMAGE_LAYER_TAR_ZSTD,
    parse_layer_media_type,
)
from modelpack.mediatypes.annotations import layer_filepath
from modelpack.oci.descriptor import Descriptor, Manifest
from modelpack.oci.digest import HASH_CHUNK, VerifyingReader, sha256_file
from modelpack.progress import CountingReader, Progress, TransferBar
from modelpack.targets.base import ReadableTarget
from modelpack.targets.fetch import fetch_manifest
from modelpack.transfer.untar import materialize_tar_layer


@dataclass(frozen=True)
class LayerJob:
    """One layer to materialise: the descriptor, its declared relative path, and where it goes."""

    descriptor: Descriptor
    relpath: str
    dest_dir: str

    @property
    def final_path(self) -> str:
        return os.path.join(self.dest_dir, *self.relpath.split("/"))


# (target, job, progress bar or None) -> "downloaded" | "present"
Materializer = Callable[[ReadableTarget, LayerJob, TransferBar | None], str]


def _file_matches(desc: Descriptor, digest: str, size: int, path: str) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    if st.st_size != size:
        return False
    got, _ = sha256_file(path)
    return got == digest


def materialize_raw(target: ReadableTarget, job: LayerJob, bar: TransferBar | None) -> str:
    """Stream a raw blob into a temp file next to its final path; rename after verification."""
    desc = job.descriptor
    final = job.final_path
    directory = os.path.dirname(final)
    os.makedirs(directory, exist_ok=True)
    real_dest = os.path.realpath(job.dest_dir)
    if os.path.commonpath([os.path.realpath(directory), real_dest]) != real_dest:
        raise UnsafePathError(f"{job.relpath}: its directory leaves {job.dest_dir} (symlink?)")
    if os.path.islink(final):
        raise UnsafePathError(f"{final} is a symlink; refusing to write through it")
    if _file_matches(desc, desc.digest, desc.size, final):
        if bar is not None:
            bar.update(desc.size)
        return "present"
    fd, tmp = tempfile.mkstemp(prefix=TEMP_PREFIX, dir=directory)
    try:
        with os.fdopen(fd, "wb") as out:
            raw = target.fetch_blob(desc)
            src: Any = CountingReader(raw, bar) if bar is not None else raw
            reader = VerifyingReader(src, desc.digest, desc.size, source=f"{target.name} ({job.relpath})")
            try:
                while True:
                    chunk = reader.read(HASH_CHUNK)
                    if not chunk:
                        break
                    out.write(chunk)
            finally:
                reader.close()
            out.flush()
            os.fsync(out.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, final)
        fsync_dir(directory)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return "downloaded"


def materialize_image_layer(target: ReadableTarget, job: LayerJob, bar: TransferBar | None) -> str:
    """An image-shaped variant's layer: a tar holding the files under ``models/``."""
    return materialize_tar_layer(target, job.descriptor, job.dest_dir, bar)


def materialize_modelpack_tar(target: ReadableTarget, job: LayerJob, bar: TransferBar | None) -> str:
    """A ModelPack ``tar`` / ``tar+gzip`` / ``tar+zstd`` layer: a tar holding files at their own paths."""
    return materialize_tar_layer(target, job.descriptor, job.dest_dir, bar, strip="")


# Keyed by ModelPack layer format, or by exact media type for the image-shaped variant's layers.
_MATERIALIZERS: dict[str, Materializer] = {
    "raw": materialize_raw,
    "tar": materialize_modelpack_tar,
    "tar+gzip": materialize_modelpack_tar,
    "tar+zstd": materialize_modelpack_tar,
    MEDIA_TYPE_IMAGE_LAYER_TAR: materialize_image_layer,
    MEDIA_TYPE_IMAGE_LAYER_TAR_GZIP: materialize_image_layer,
    MEDIA_TYPE_IMAGE_LAYER_TAR_ZSTD: materialize_image_layer,
}


def materializer_for(media_type: str) -> Materializer:
    if media_type in _MATERIALIZERS:
        return _MATERIALIZERS[media_type]
    lt = parse_layer_media_type(media_type)
    if lt is not None and lt.format in _MATERIALIZERS:
        return _MATERIALIZERS[lt.format]
    raise UnsupportedLayerError(
        f"layer media type {media_type!r}: no materializer for this format "
        f"(supported: {', '.join(sorted(_MATERIALIZERS))})"
    )


def _matches(relpath: str, patterns: Sequence[str]) -> bool:
    name = posixpath.basename(relpath)
    return any(fnmatch.fnmatchcase(relpath, p) or fnmatch.fnmatchcase(name, p) for p in patterns)


@dataclass
class PullResult:
    digest: str
    dest_dir: str
    files: list[str] = field(default_factory=list)
    downloaded: int = 0
    present: int = 0
    bytes_downloaded: int = 0
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "digest": self.digest,
            "destination": self.dest_dir,
            "files": self.files,
            "downloaded": self.downloaded,
            "present": self.present,
            "bytesDownloaded": self.bytes_downloaded,
            "seconds": round(self.seconds, 3),
        }


def plan_layers(
    manifest: Manifest, dest_dir: str, include: Sequence[str] = (), exclude: Sequence[str] = ()
) -> list[LayerJob]:
    """Which layers go where; refuses layers without a path, unsafe paths and duplicate paths."""
    jobs: list[LayerJob] = []
    seen: dict[str, str] = {}
    for i, layer in enumerate(manifest.layers):
        relpath = layer_filepath(layer.annotations)
        if relpath is None:
            raise PullError(f"layer {i} ({layer.digest}) has no file path annotation")
        if include and not _matches(relpath, include):
            continue
        if exclude and _matches(relpath, exclude):
            continue
        if relpath in seen and seen[relpath] != layer.digest:
            raise PullError(f"two layers claim {relpath!r}: {seen[relpath]} and {layer.digest}")
        if relpath in seen:
            continue
        seen[relpath] = layer.digest
        materializer_for(layer.media_type)  # refuse unknown formats before downloading anything
        jobs.append(LayerJob(layer, relpath, dest_dir))
    return jobs


def pull_to_directory(
    target: ReadableTarget,
    identifier: str,
    dest_dir: str,
    *,
    include: Sequence[str] = (),
    exclude: Sequence[str] = (),
    jobs: int = 4,
    progress: str = "auto",
) -> PullResult:
    """Download the artifact ``identifier`` (tag or digest) from ``target`` into ``dest_dir``.

    Files already present with the right digest are kept (a second pull downloads nothing).
    """
    start = time.monotonic()
    manifest, digest = fetch_manifest(target, identifier)
    dest = os.path.abspath(dest_dir)
    os.makedirs(dest, exist_ok=True)
    plan = plan_layers(manifest, dest, include, exclude)
    result = PullResult(digest=digest, dest_dir=dest, files=[j.relpath for j in plan])
    total = sum(j.descriptor.size for j in plan)
    with Progress(total, f"pull {digest[7:19]}", progress) as prog:

        def run(job: LayerJob) -> str:
            bar = prog.transfer(job.descriptor.size, job.relpath) if prog.enabled else None
            try:
                return materializer_for(job.descriptor.media_type)(target, job, bar)
            finally:
                if bar is not None:
                    bar.close()

        if plan:
            with ThreadPoolExecutor(
                max(1, min(jobs, len(plan))), thread_name_prefix="modelpack-pull"
            ) as pool:
                for job, outcome in zip(plan, pool.map(run, plan), strict=True):
                    if outcome == "present":
                        result.present += 1
                    else:
                        result.downloaded += 1
                        result.bytes_downloaded += job.descriptor.size
    result.seconds = time.monotonic() - start
    return result
