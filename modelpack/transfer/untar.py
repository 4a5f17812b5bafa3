"""Extract tar layers into directories, refusing anything that could write outside them or without bound.

Pull-to-directory (``materialize``), the node cache (``modelpack.mount``) and runtime assets turn
tar layers into files: the image-shaped variant's layers (files under ``models/``) and ModelPack
``tar`` / ``tar+gzip`` / ``tar+zstd`` layers (files at their own paths). The tar comes from a
registry, and a blob's digest only proves that it is the publisher's, not that it is harmless: a
32 KB zstd stream expands to 1 GiB of zeros, a sparse member declares a terabyte of holes, a PAX
header can be as large as the stream. So every member is checked before a byte is written, what
is written is counted against a budget the caller sets (``max_bytes``: the free space, the cache
quota, ``--max-bytes``), header and trailer sizes are bounded, and sparse members are refused in
every encoding. A corrupt stream is a ``LayerFormatError``, a write the OS refuses a
``FileWriteError`` naming the path; nothing is ever left half-checked at a final path.

Speed and memory: tarfile parses the headers (``tar_reader.BoundedTarInfo``) straight from a
forward-only reader (``tar_reader.LayerReader``), and member data is copied from that reader to
the file in 1 MiB reads (``COPY_CHUNK``) with the disk's write-back started as it goes: no
tarfile stream buffer joining and slicing every read, no ``ExFileObject`` in between, a few MiB
per layer extracted at once.
Each file's sha256 is computed on the way only for callers that record it (``extract_tar_layer``:
the node cache's snapshot metadata, assets); pull into a directory, which proves the files by
the blob digest over the same stream before any is visible, uses ``extract_tar_files``.
"""

from __future__ import annotations

import hashlib
import os
import tarfile
import threading
from collections.abc import Callable
from typing import BinaryIO

from modelpack.errors import (
    DigestMismatchError,
    ExpansionLimitError,
    LayerFormatError,
    UnsafePathError,
    UnsafeTarError,
)
from modelpack.files import Writeback, write_error
from modelpack.mediatypes import BlobFormat
from modelpack.mediatypes.annotations import safe_relative_path
from modelpack.oci.image_config import MODELS_PREFIX
from modelpack.transfer.tar_reader import (
    COPY_CHUNK,
    MAX_HEADER_BYTES,
    BoundedTarInfo,
    LayerReader,
    is_sparse,
    open_layer_stream,
    sparse_refusal,
)

MAX_TAR_MEMBERS = 1_000_000
#: data read after the end-of-archive marker: tar pads to a record (10 KiB); more is not a tar
MAX_TRAILER_BYTES = 1024 * 1024


class ExpansionBudget:
    """How many bytes the files extracted by one pull may still take, shared by layers extracted in
    parallel. A member is charged its declared size before it is opened, so a bomb is refused
    without being written; ``limit`` None counts without refusing."""

    def __init__(self, limit: int | None, described: str = "the limit (max_bytes)") -> None:
        self.limit = limit
        self.described = described
        self.used = 0
        self._lock = threading.Lock()

    @property
    def left(self) -> int | None:
        return None if self.limit is None else self.limit - self.used

    def charge(self, n: int, *, where: str, member: str) -> None:
        with self._lock:
            if self.limit is not None and n > self.limit - self.used:
                raise ExpansionLimitError(where, member, n, max(0, self.limit - self.used), self.described)
            self.used += n


class ClaimedPaths:
    """The files one pull writes, by the layer that writes them (thread-safe). A second claim on a
    path, or a path that one layer writes as a file and another needs as a directory, is refused:
    otherwise the last writer wins, in whatever order the layers happened to finish."""

    def __init__(self) -> None:
        self._files: dict[str, str] = {}
        self._dirs: dict[str, str] = {}
        self._lock = threading.Lock()

    def claim(self, rel: str, owner: str) -> None:
        with self._lock:
            prev = self._files.get(rel)
            if prev is not None:
                also = "appears twice" if prev == owner else f"is also written by {prev}"
                raise UnsafeTarError(f"{owner}: {rel!r} {also}")
            if rel in self._dirs:
                raise UnsafeTarError(f"{owner}: {rel!r} is a file here but a directory in {self._dirs[rel]}")
            parts = rel.split("/")
            parents = ["/".join(parts[:i]) for i in range(1, len(parts))]
            for p in parents:
                if p in self._files:
                    raise UnsafeTarError(
                        f"{owner}: {rel!r} needs the directory {p!r}, which {self._files[p]} writes as a file"
                    )
            for p in parents:
                self._dirs.setdefault(p, owner)
            self._files[rel] = owner

    def __contains__(self, rel: object) -> bool:
        with self._lock:
            return rel in self._files

    def files(self) -> set[str]:
        with self._lock:
            return set(self._files)


def _claim(existing: ClaimedPaths | set[str], rel: str, where: str) -> None:
    if isinstance(existing, ClaimedPaths):
        existing.claim(rel, where)
        return
    if rel in existing:
        raise UnsafeTarError(f"{where}: {rel!r} appears twice")
    existing.add(rel)


def _located(exc: UnsafeTarError, where: str) -> UnsafeTarError:
    """The same refusal, naming the layer (header checks run inside tarfile, which does not know it)."""
    if str(exc).startswith(where):
        return exc
    if isinstance(exc, ExpansionLimitError):
        return exc
    return type(exc)(f"{where}: {exc}")


def extract_tar_layer(
    stream: BinaryIO,
    dest_dir: str,
    strip: str = MODELS_PREFIX,
    *,
    blob_format: BlobFormat = BlobFormat.TAR,
    diff_id: str | None = None,
    where: str = "layer",
    existing: ClaimedPaths | set[str] | None = None,
    max_bytes: int | None = None,
    budget: ExpansionBudget | None = None,
    select: Callable[[str], bool] | None = None,
    outside: str = "refuse",
    keep_prefix: bool = False,
) -> list[tuple[str, int, str]]:
    """Extract regular files of a layer tar under ``dest_dir``; returns (relpath, size, sha256).

    Refuses (``UnsafeTarError``) symlinks, hard links, devices, FIFOs, sparse members, absolute
    or ``..`` paths, whiteouts, members outside ``strip`` and duplicates (also across the layers
    sharing ``existing``). ``max_bytes`` (or a ``budget`` shared by several layers) caps the bytes
    written: each member's declared size is charged before it is opened and exactly that many
    bytes are written (a stream that ends first is a ``LayerFormatError``). ``select`` picks
    which files to write; the others are still checked and claimed. Files are created with
    O_EXCL|O_NOFOLLOW, fsynced and made read-only. ``outside="skip"`` passes over members outside
    ``strip`` instead (a modelcar built ``FROM busybox`` carries the OS under ``bin/``, ``etc/``:
    nothing of it is written, so its links and devices are not this pull's concern);
    ``keep_prefix`` writes files at their paths with ``strip`` (``models/config.json``). When
    ``diff_id`` is given, the uncompressed stream must hash to it (checked after the last byte);
    on any failure the caller discards ``dest_dir``.

    Each file's sha256 is computed as it is written: for callers that record it (the node
    cache's snapshot metadata, assets). ``extract_tar_files`` is the same without it.
    """
    out = _extract(
        stream,
        dest_dir,
        strip,
        blob_format,
        diff_id,
        where,
        existing,
        max_bytes,
        budget,
        select,
        outside,
        keep_prefix,
        file_digests=True,
    )
    return [(rel, size, digest) for rel, size, digest in out if digest is not None]


def extract_tar_files(
    stream: BinaryIO,
    dest_dir: str,
    strip: str = MODELS_PREFIX,
    *,
    blob_format: BlobFormat = BlobFormat.TAR,
    diff_id: str | None = None,
    where: str = "layer",
    existing: ClaimedPaths | set[str] | None = None,
    max_bytes: int | None = None,
    budget: ExpansionBudget | None = None,
    select: Callable[[str], bool] | None = None,
    outside: str = "refuse",
    keep_prefix: bool = False,
) -> list[tuple[str, int]]:
    """``extract_tar_layer`` without hashing each file; returns (relpath, size).

    For a caller that proves the files another way before anyone sees them: pull into a
    directory extracts into a staging directory while the layer's blob digest is checked over
    the same stream, and renames the files into place only once that digest matched (a file's
    bytes are a part of the verified blob, so a digest of its own proves nothing more and
    would cost a second SHA-256 pass over every byte). Same checks, same bounds.
    """
    out = _extract(
        stream,
        dest_dir,
        strip,
        blob_format,
        diff_id,
        where,
        existing,
        max_bytes,
        budget,
        select,
        outside,
        keep_prefix,
        file_digests=False,
    )
    return [(rel, size) for rel, size, _ in out]


def _extract(
    stream: BinaryIO,
    dest_dir: str,
    strip: str,
    blob_format: BlobFormat,
    diff_id: str | None,
    where: str,
    existing: ClaimedPaths | set[str] | None,
    max_bytes: int | None,
    budget: ExpansionBudget | None,
    select: Callable[[str], bool] | None,
    outside: str,
    keep_prefix: bool,
    *,
    file_digests: bool,
) -> list[tuple[str, int, str | None]]:
    reader = LayerReader(open_layer_stream(stream, blob_format, where), where, hashing=diff_id is not None)
    claims: ClaimedPaths | set[str] = existing if existing is not None else set()
    spend = budget if budget is not None else ExpansionBudget(max_bytes)
    out: list[tuple[str, int, str | None]] = []
    try:
        # "r:" (not the stream mode "r|"): tarfile reads headers straight from the reader, which
        # only goes forward, and leaves member data to _write_member
        tar = tarfile.open(  # type: ignore[call-overload]
            fileobj=reader, mode="r:", encoding="utf-8", tarinfo=BoundedTarInfo
        )
        with tar:
            _extract_members(
                tar,
                reader,
                dest_dir,
                strip,
                where,
                claims,
                spend,
                select,
                out,
                outside == "skip",
                keep_prefix,
                file_digests,
            )
        reader.drain_after_end(MAX_TRAILER_BYTES)
    except UnsafeTarError as exc:
        located = _located(exc, where)
        if located is exc:
            raise
        raise located from exc
    except tarfile.TarError as exc:
        raise LayerFormatError(f"{where}: not a readable tar: {exc}") from exc
    if diff_id is not None:
        actual = reader.digest
        if actual != diff_id:
            raise DigestMismatchError(diff_id, actual, what="uncompressed layer (diff_id)", source=where)
    return out


def _extract_members(
    tar: tarfile.TarFile,
    reader: LayerReader,
    dest_dir: str,
    strip: str,
    where: str,
    claims: ClaimedPaths | set[str],
    budget: ExpansionBudget,
    select: Callable[[str], bool] | None,
    out: list[tuple[str, int, str | None]],
    skip_outside: bool = False,
    keep_prefix: bool = False,
    file_digests: bool = True,
) -> None:
    dest_real = os.path.realpath(dest_dir)
    count = 0
    while True:
        member = tar.next()
        if member is None:
            return
        tar.members.clear()  # type: ignore[attr-defined]  # stream mode keeps every TarInfo: memory grows
        count += 1
        if count > MAX_TAR_MEMBERS:
            raise UnsafeTarError(f"{where}: more than {MAX_TAR_MEMBERS} members")
        name = member.name
        if name.startswith("./"):
            name = name[2:]
        if member.isdir():
            if (name.rstrip("/") + "/") == strip or not name.strip("/"):
                continue
        if strip and not (name.startswith(strip) or (member.isdir() and name.rstrip("/") + "/" == strip)):
            if skip_outside:
                continue  # not written, not claimed, not charged; tarfile skips its data
            raise UnsafeTarError(f"{where}: member {member.name!r} is outside {strip!r}")
        rel_raw = name[len(strip) :].rstrip("/") if strip else name.rstrip("/")
        if keep_prefix and strip:
            rel_raw = strip + rel_raw
        try:
            rel = safe_relative_path(rel_raw, what=f"{where} member")
        except UnsafePathError as exc:
            raise UnsafeTarError(str(exc)) from exc
        if any(p.startswith(".wh.") for p in rel.split("/")):
            raise UnsafeTarError(f"{where}: whiteout entry {member.name!r} is not allowed in a model layer")
        if is_sparse(member):
            raise sparse_refusal(member.name, "sparse headers")
        target = os.path.join(dest_dir, *rel.split("/"))
        parent_real = os.path.realpath(os.path.dirname(target))
        if os.path.commonpath([dest_real, parent_real]) != dest_real:
            raise UnsafeTarError(f"{where}: member {member.name!r} would land outside the destination")
        if member.isdir():
            if os.path.lexists(target) and not os.path.isdir(target):
                raise UnsafeTarError(f"{where}: directory {member.name!r} collides with a file")
            if select is None:
                _makedirs(target)
            continue
        if not member.isreg():
            kind = "link" if (member.issym() or member.islnk()) else "special file"
            raise UnsafeTarError(
                f"{where}: member {member.name!r} is a {kind}; only regular files are allowed"
            )
        if member.size < 0:
            raise LayerFormatError(f"{where}: member {member.name!r} declares a negative size")
        _claim(claims, rel, where)
        if os.path.lexists(target):
            raise UnsafeTarError(f"{where}: file {member.name!r} collides with a directory of the same layer")
        if select is not None and not select(rel):
            continue  # tarfile skips its data; nothing is written, nothing charged
        budget.charge(member.size, where=where, member=member.name)
        if reader.tell() != member.offset_data:  # pragma: no cover - tarfile leaves it at the data
            raise LayerFormatError(f"{where}: member {member.name!r}: reader not at its data")
        out.append((rel, member.size, _write_member(reader, target, member, where, file_digests)))


def _makedirs(path: str) -> None:
    try:
        os.makedirs(path, mode=0o755, exist_ok=True)
    except OSError as exc:
        raise write_error(path, exc) from exc


def _write_member(
    reader: LayerReader, target: str, member: tarfile.TarInfo, where: str, hashing: bool
) -> str | None:
    """Write exactly the member's declared bytes from the tar stream; returns their sha256 when
    ``hashing``. Write-back starts as it goes (``Writeback``), so the fsync waits for little."""
    _makedirs(os.path.dirname(target))
    h = hashlib.sha256() if hashing else None
    left = member.size
    try:
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            writeback = Writeback(fd)
            while left:
                chunk = reader.read_some(min(COPY_CHUNK, left))
                if not chunk:
                    raise LayerFormatError(
                        f"{where}: member {member.name!r} truncated "
                        f"({member.size - left} of {member.size} bytes)"
                    )
                view = memoryview(chunk)
                while view:
                    view = view[os.write(fd, view) :]
                writeback.wrote(len(chunk))
                if h is not None:
                    h.update(chunk)
                left -= len(chunk)
            os.fsync(fd)
            os.fchmod(fd, 0o444)
        finally:
            os.close(fd)
    except OSError as exc:
        raise write_error(target, exc) from exc
    return None if h is None else "sha256:" + h.hexdigest()


__all__ = [
    "COPY_CHUNK",
    "MAX_HEADER_BYTES",
    "MAX_TAR_MEMBERS",
    "MAX_TRAILER_BYTES",
    "ClaimedPaths",
    "ExpansionBudget",
    "extract_tar_files",
    "extract_tar_layer",
    "open_layer_stream",
]
