"""What a pack produces: hashed files as a read-only Target, and the options that shaped them.

``PackedArtifact`` is a Target so that ``pack``/``push`` are just ``copy(packed, destination)``:
a layout on the same filesystem gets reflinks or hard links, a registry gets the files streamed
straight from the checkpoint (no intermediate copy). Local directories, S3 checkpoints and the
image-shaped variant all build one.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import BinaryIO

from modelpack.errors import NotFoundError, PackError
from modelpack.file_selection import check_patterns
from modelpack.mediatypes import LayerKind, ModelSpecConfig, SpecNames
from modelpack.mediatypes.config import is_rfc3339
from modelpack.oci.descriptor import Descriptor, Manifest
from modelpack.oci.digest import Digest
from modelpack.packing.file_metadata import file_identity, source_date_epoch
from modelpack.packing.opened_input import InputFile
from modelpack.packing.staging_area import remove_staging_dir
from modelpack.targets.base import BlobSource, bytes_blob_source, file_blob_source


@dataclass
class PackOptions:
    """Everything that shapes the artifact; every config field can be overridden."""

    include: Sequence[str] = ()
    exclude: Sequence[str] = ()
    other_files: str = LayerKind.DOC
    name: str | None = None
    version: str | None = None
    family: str | None = None
    architecture: str | None = None
    param_size: str | None = None
    precision: str | None = None
    quantization: str | None = None
    vendor: str | None = None
    description: str | None = None
    licenses: Sequence[str] = ()
    created: str | None = None  # RFC 3339; None keeps the artifact reproducible
    #: ``descriptor.revision`` / ``descriptor.sourceURL`` (an ``hf://`` source records its commit and URL)
    revision: str | None = None
    source_url: str | None = None
    #: ``config.format`` (a Modelfile's FORMAT); None: ``safetensors`` when every weight file is one
    model_format: str | None = None
    max_file_size: int | None = None
    #: which ModelPack naming the manifest's media types use (``cncf``, or ``cnai`` for released
    #: Harbor): an input of the pack, so the same files give one digest per naming
    spec_names: str = SpecNames.CNCF
    #: the mtime recorded for every file (seconds); None: ``SOURCE_DATE_EPOCH``, else the epoch
    mtime: int | None = None
    jobs: int = 0  # hashing threads; 0 = one per core
    progress: str = "auto"

    def check(self, other_file_choices: Sequence[str]) -> None:
        """Refuse options that would fail only after every file was hashed, naming the CLI flag."""
        if self.other_files not in other_file_choices:
            raise PackError(f"--other-files must be one of {', '.join(other_file_choices)}")
        if self.created is not None and not is_rfc3339(self.created):
            raise PackError(
                f"--created {self.created!r} is not an RFC 3339 date-time; "
                "write it with a time and zone, e.g. 2025-01-02T00:00:00Z"
            )
        if self.name is not None and not self.name:
            raise PackError("--name must not be empty")
        if self.spec_names not in tuple(SpecNames):
            raise PackError(
                f"--spec-names must be one of {', '.join(SpecNames)}, got {str(self.spec_names)[:40]!r}"
            )
        check_patterns(self.include, self.exclude)
        if self.mtime is None:
            source_date_epoch()  # a malformed SOURCE_DATE_EPOCH is refused before any hashing


_CHANGES = {
    "size": "its size differs",
    "file": "it was replaced by another file",
    "time": "it was modified in place",
    "mode": "its mode changed",
}


@dataclass(frozen=True)
class PackedFile:
    relpath: str
    path: str  # absolute path of the bytes (the checkpoint file, or a re-sharded file)
    kind: LayerKind
    untested: bool
    size: int
    digest: Digest
    mode: int = 0o644  # permission bits recorded in the file metadata (and image tar headers)
    # Remote files (an S3 checkpoint) have no local path: ``opener(offset)`` streams their bytes.
    opener: Callable[[int], BinaryIO] | None = field(default=None, compare=False, repr=False)
    #: ``file_identity`` of ``path`` when it was hashed; checked again before its bytes are handed on
    identity: tuple[int, ...] | None = field(default=None, compare=False, repr=False)
    #: the input as the pack opened it: its bytes are read (and linked) from this descriptor only,
    #: never by ``path`` again (a name another user can point elsewhere)
    source: InputFile | None = field(default=None, compare=False, repr=False)

    def check_unchanged(self) -> None:
        """Refuse a file that is no longer the one hashed (replaced, rewritten, grown, removed):
        its bytes would otherwise be stored or pushed under the digest of the old ones."""
        if self.identity is None:
            return
        try:
            now: tuple[int, ...] = (
                self.source.now() if self.source is not None else file_identity(os.stat(self.path))
            )
        except OSError as exc:
            raise PackError(
                f"{self.path}: {exc.strerror or exc} — it changed after it was hashed; "
                "nothing of it was stored; pack again once nothing writes to the checkpoint"
            ) from None
        if now != self.identity:
            what = (
                "size" if now[2] != self.identity[2] else "file" if now[:2] != self.identity[:2] else "time"
            )
            raise PackError(
                f"{self.path}: changed after it was hashed ({_CHANGES[what]}); nothing of it was "
                "stored under the old digest; pack again once nothing writes to the checkpoint"
            )


@dataclass
class PackedArtifact:
    """A built artifact whose blobs are local files: a read-only Target for ``copy``."""

    manifest: Manifest
    config: ModelSpecConfig
    config_bytes: bytes
    files: list[PackedFile]
    tag: str = "latest"
    staging_dir: str | None = None
    name: str = "checkpoint"
    #: hidden entries of the source that were not packed (a directory ends with ``/``)
    skipped: list[str] = field(default_factory=list)
    #: what a person should know about what was packed (pickle files, …)
    warnings: list[str] = field(default_factory=list)
    _by_digest: dict[str, PackedFile] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._by_digest = {f.digest: f for f in self.files}

    @property
    def file_count(self) -> int:
        """How many of the source's files the artifact holds (an image overrides it: its layers
        are tars of the files)."""
        return len(self.files)

    @property
    def digest(self) -> Digest:
        return self.manifest.digest

    # -- ReadableTarget --------------------------------------------------------------
    def resolve(self, reference: str) -> Descriptor:
        if reference in (self.tag, str(self.manifest.digest)):
            return self.manifest.descriptor()
        raise NotFoundError(f"{self.name}: {reference!r} not found (the packed artifact is {self.digest})")

    def fetch_manifest(self, reference: str) -> tuple[bytes, str]:
        self.resolve(reference)
        return self.manifest.raw, self.manifest.media_type

    def blob_source(self, descriptor: Descriptor) -> BlobSource:
        if descriptor.digest == self.manifest.config.digest:
            return bytes_blob_source(descriptor, self.config_bytes)
        f = self._by_digest.get(descriptor.digest)
        if f is None:
            raise NotFoundError(f"{self.name}: blob {descriptor.digest} not found")
        if f.opener is not None:
            return BlobSource(descriptor, f.opener)  # unverified: the writer checks the digest
        f.check_unchanged()  # "verified" below means: these are the bytes this process hashed
        if f.source is not None:
            return BlobSource(
                descriptor,
                f.source.open,
                local_path=f.path,
                verified=True,
                recheck=f.check_unchanged,
                fileno=f.source.fd,
            )
        return file_blob_source(descriptor, f.path, verified=True, recheck=f.check_unchanged)

    def fetch_blob(self, descriptor: Descriptor, offset: int = 0) -> BinaryIO:
        return self.blob_source(descriptor).open(offset)

    def fetch_range(self, descriptor: Descriptor, offset: int, length: int) -> bytes:
        with self.fetch_blob(descriptor, offset) as f:
            return f.read(length)

    def exists(self, descriptor: Descriptor) -> bool:
        return descriptor.digest in self._by_digest or descriptor.digest == self.manifest.config.digest

    def list_tags(self) -> Iterator[str]:
        yield self.tag

    def referrers(self, subject: Descriptor, artifact_type: str | None = None) -> list[Descriptor]:
        return []

    def cleanup(self) -> None:
        for f in self.files:
            if f.source is not None:
                f.source.close()
        remove_staging_dir(self.staging_dir)
        self.staging_dir = None


__all__ = ["PackOptions", "PackedArtifact", "PackedFile"]
