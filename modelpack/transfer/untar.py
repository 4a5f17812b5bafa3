"""Extract tar layers into directories, refusing anything that could write outside them.

Pull-to-directory (``materialize``) and the node cache (``modelpack.mount``) both turn tar layers
into files: the image-shaped variant's layers (files under ``models/``) and ModelPack ``tar`` /
``tar+gzip`` / ``tar+zstd`` layers (files at their own paths). The tar comes from a registry, so
every member is checked before a byte is written, and nothing lands at a final path unverified.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tarfile
import tempfile
from typing import Any, BinaryIO

from modelpack.errors import DigestMismatchError, ManifestError, UnsafePathError, UnsafeTarError
from modelpack.files import TEMP_PREFIX, fsync_dir
from modelpack.mediatypes import MEDIA_TYPE_IMAGE_LAYER_TAR
from modelpack.mediatypes.annotations import safe_relative_path
from modelpack.oci.descriptor import Descriptor
from modelpack.oci.digest import HASH_CHUNK, VerifyingReader
from modelpack.oci.image_config import MODELS_PREFIX
from modelpack.progress import CountingReader, TransferBar
from modelpack.targets.base import ReadableTarget

MAX_TAR_MEMBERS = 1_000_000


class _HashingReader:
    def __init__(self, raw: Any) -> None:
        self.raw = raw
        self.h = hashlib.sha256()
        self.n = 0

    def read(self, n: int = -1) -> bytes:
        data: bytes = self.raw.read(n)
        self.h.update(data)
        self.n += len(data)
        return data

    def drain(self) -> None:
        while self.read(HASH_CHUNK):
            pass


def open_layer_stream(stream: BinaryIO, media_type: str) -> Any:
    """Decompressing view of a layer blob, by media type (or bare format: tar, tar+gzip, tar+zstd)."""
    if media_type.endswith("+zstd"):
        import zstandard

        return zstandard.ZstdDecompressor().stream_reader(stream, read_across_frames=True)
    if media_type.endswith("+gzip"):
        import gzip

        return gzip.GzipFile(fileobj=stream, mode="rb")
    if media_type.endswith("tar") or media_type in (MEDIA_TYPE_IMAGE_LAYER_TAR,):
        return stream
    raise ManifestError(f"unsupported layer media type {media_type!r}")


def extract_tar_layer(
    stream: BinaryIO,
    dest_dir: str,
    strip: str = MODELS_PREFIX,
    *,
    media_type: str = MEDIA_TYPE_IMAGE_LAYER_TAR,
    diff_id: str | None = None,
    where: str = "layer",
    existing: set[str] | None = None,
) -> list[tuple[str, int, str]]:
    """Extract regular files of a layer tar under ``dest_dir``; returns (relpath, size, sha256).

    Refuses (``UnsafeTarError``) symlinks, hard links, devices, FIFOs, absolute or ``..`` paths,
    whiteouts, members outside ``strip`` and duplicates: the tar comes from a registry and must
    not write anywhere else. Files are created with O_EXCL|O_NOFOLLOW and made read-only. When
    ``diff_id`` is given, the uncompressed stream must hash to it (checked after the last byte);
    on any failure the caller discards ``dest_dir``.
    """
    hashing = _HashingReader(open_layer_stream(stream, media_type))
    out: list[tuple[str, int, str]] = []
    seen = existing if existing is not None else set()
    dest_real = os.path.realpath(dest_dir)
    count = 0
    with tarfile.open(fileobj=hashing, mode="r|", encoding="utf-8") as tar:  # type: ignore[call-overload]
        for member in tar:
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
                raise UnsafeTarError(f"{where}: member {member.name!r} is outside {strip!r}")
            rel_raw = name[len(strip) :].rstrip("/") if strip else name.rstrip("/")
            try:
                rel = safe_relative_path(rel_raw, what=f"{where} member")
            except UnsafePathError as exc:
                raise UnsafeTarError(str(exc)) from exc
            if any(p.startswith(".wh.") for p in rel.split("/")):
                raise UnsafeTarError(
                    f"{where}: whiteout entry {member.name!r} is not allowed in a model layer"
                )
            target = os.path.join(dest_dir, *rel.split("/"))
            parent_real = os.path.realpath(os.path.dirname(target))
            if os.path.commonpath([dest_real, parent_real]) != dest_real:
                raise UnsafeTarError(f"{where}: member {member.name!r} would land outside the destination")
            if member.isdir():
                if os.path.lexists(target) and not os.path.isdir(target):
                    raise UnsafeTarError(f"{where}: directory {member.name!r} collides with a file")
                os.makedirs(target, mode=0o755, exist_ok=True)
                continue
            if not member.isreg():
                kind = "link" if (member.issym() or member.islnk()) else "special file"
                raise UnsafeTarError(
                    f"{where}: member {member.name!r} is a {kind}; only regular files are allowed"
                )
            if rel in seen:
                raise UnsafeTarError(f"{where}: {rel!r} appears twice")
            seen.add(rel)
            os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
            src = tar.extractfile(member)
            if src is None:  # pragma: no cover - regular files always have data
                raise UnsafeTarError(f"{where}: member {member.name!r} has no data")
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            h = hashlib.sha256()
            n = 0
            with os.fdopen(fd, "wb") as f:
                while True:
                    chunk = src.read(HASH_CHUNK)
                    if not chunk:
                        break
                    h.update(chunk)
                    f.write(chunk)
                    n += len(chunk)
                f.flush()
                os.fsync(f.fileno())
            if n != member.size:
                raise UnsafeTarError(
                    f"{where}: member {member.name!r} truncated ({n} of {member.size} bytes)"
                )
            os.chmod(target, 0o444)
            out.append((rel, n, "sha256:" + h.hexdigest()))
    hashing.drain()
    if diff_id is not None:
        actual = "sha256:" + hashing.h.hexdigest()
        if actual != diff_id:
            raise DigestMismatchError(diff_id, actual, what="uncompressed layer (diff_id)", source=where)
    return out


def materialize_tar_layer(
    target: ReadableTarget,
    desc: Descriptor,
    dest_dir: str,
    bar: TransferBar | None,
    *,
    strip: str = MODELS_PREFIX,
) -> str:
    """Extract the layer ``desc`` of ``target`` into ``dest_dir``: files land at final paths only verified.

    The layer is extracted into a temp directory inside the destination while its blob digest is
    checked as it streams; only after the last byte matched are the files renamed into place.
    """
    dest = os.path.abspath(dest_dir)
    os.makedirs(dest, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=TEMP_PREFIX, dir=dest)
    try:
        raw = target.fetch_blob(desc)
        src: Any = CountingReader(raw, bar) if bar is not None else raw
        reader = VerifyingReader(src, desc.digest, desc.size, source=f"{target.name} (layer {desc.digest})")
        try:
            files = extract_tar_layer(
                reader,  # type: ignore[arg-type]
                tmp,
                strip,
                media_type=desc.media_type,
                where=f"layer {desc.digest}",
            )
            while reader.read(HASH_CHUNK):  # the digest check happens at EOF
                pass
        finally:
            reader.close()
        for rel, _, _ in files:
            final = os.path.join(dest, *rel.split("/"))
            parent = os.path.dirname(final)
            os.makedirs(parent, exist_ok=True)
            real_parent = os.path.realpath(parent)
            if os.path.commonpath([real_parent, os.path.realpath(dest)]) != os.path.realpath(dest):
                raise UnsafeTarError(f"{rel}: its directory leaves {dest} (symlink?)")
            if os.path.islink(final):
                raise UnsafeTarError(f"{final} is a symlink; refusing to write through it")
            staged = os.path.join(tmp, *rel.split("/"))
            os.chmod(staged, 0o644)
            os.replace(staged, final)
            fsync_dir(parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return "downloaded"


__all__ = ["MAX_TAR_MEMBERS", "extract_tar_layer", "materialize_tar_layer", "open_layer_stream"]
