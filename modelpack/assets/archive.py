"""A cache directory as one reproducible tar+gzip layer, and back into a directory, safely.

Packing walks the directory in sorted order and writes regular files only, with fixed owner,
time and permission bits, so the same cache packs to the same digest. Anything that is not a
regular file or directory (a symlink, a socket) is refused rather than dropped: a cache with a
link in it is not one we understand. Unpacking is ``modelpack.transfer.untar``'s checked
extraction (no links, no escaping paths, no duplicates), fed through a digest-checking reader.
"""

from __future__ import annotations

import contextlib
import gzip
import os
import stat
import tarfile
import tempfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import BinaryIO

from modelpack.assets.format import MAX_ASSET_BYTES, MAX_ASSET_FILES
from modelpack.assets.kinds import AssetKind
from modelpack.errors import AssetError, LayerFormatError, UnsafeTarError
from modelpack.files import TEMP_PREFIX
from modelpack.mediatypes import BlobFormat
from modelpack.oci.digest import HASH_CHUNK, Digest, HashingWriter, VerifyingReader
from modelpack.packing.staging_area import make_staging_dir, remove_staging_dir
from modelpack.transfer.untar import ExpansionBudget, extract_tar_layer

GZIP_LEVEL = 6


@dataclass(frozen=True)
class PackedCache:
    """A packed cache: the layer file and what went into it. The caller removes it with
    ``discard()`` (its staging directory too, when it has one)."""

    path: str
    digest: Digest
    size: int
    files: int
    bytes: int
    staging: str | None = None  # the held staging directory the file lives in (work_dir not given)

    def discard(self) -> None:
        if self.staging is not None:
            remove_staging_dir(self.staging)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)


def cache_files(directory: str, kind: AssetKind) -> list[tuple[str, str, os.stat_result]]:
    """(relpath, path, stat) of every file to ship, sorted; refuses links and special files."""
    root = os.path.abspath(directory)
    if not os.path.isdir(root):
        raise AssetError(f"{directory}: not a directory")
    out: list[tuple[str, str, os.stat_result]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        rel_dir = "" if rel_dir == "." else rel_dir.replace(os.sep, "/") + "/"
        dirnames[:] = sorted(d for d in dirnames if not kind.excluded(rel_dir + d))
        for d in dirnames:
            if os.path.islink(os.path.join(dirpath, d)):
                raise AssetError(
                    f"{os.path.join(dirpath, d)}: a symlink in a {kind.name} cache; refusing to pack it"
                )
        for name in sorted(filenames):
            rel = rel_dir + name
            if kind.excluded(rel):
                continue
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode):
                what = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a regular file"
                raise AssetError(f"{path}: {what} in a {kind.name} cache; refusing to pack it")
            out.append((rel, path, st))
    out.sort(key=lambda item: item[0])
    return out


def pack_cache(directory: str, kind: AssetKind, *, work_dir: str | None = None) -> PackedCache:
    """Write ``directory`` (minus the kind's scratch entries) as a tar+gzip file in ``work_dir``,
    else in a staging directory of its own (``modelpack.packing.staging_area``): held while this
    process lives, so what a SIGKILLed push left is swept by the next run."""
    entries = cache_files(directory, kind)
    if not entries:
        raise AssetError(f"{directory}: no {kind.name} cache files to pack (is it the cache directory?)")
    if len(entries) > MAX_ASSET_FILES:
        raise AssetError(f"{directory}: {len(entries)} files; an asset holds at most {MAX_ASSET_FILES}")
    staging = make_staging_dir("asset") if work_dir is None else None
    try:
        fd, tmp = tempfile.mkstemp(prefix=TEMP_PREFIX, suffix=".tar.gz", dir=staging or work_dir)
        try:
            with os.fdopen(fd, "wb") as raw:
                out = HashingWriter(raw)
                total = _write_tar_gz(out, entries, directory)
                raw.flush()
                os.fsync(raw.fileno())
        except BaseException:
            os.unlink(tmp)
            raise
    except BaseException:
        remove_staging_dir(staging)
        raise
    return PackedCache(tmp, out.digest, out.size, len(entries), total, staging)


def _write_tar_gz(out: HashingWriter, entries: list[tuple[str, str, os.stat_result]], directory: str) -> int:
    total = 0
    gz = gzip.GzipFile(filename="", mode="wb", fileobj=out, mtime=0, compresslevel=GZIP_LEVEL)
    with gz, tarfile.open(fileobj=gz, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        for rel, path, st in entries:
            info = tarfile.TarInfo(rel)
            info.size = st.st_size
            info.mode = 0o755 if st.st_mode & 0o111 else 0o644
            info.mtime = 0
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            with open(path, "rb") as f:
                tar.addfile(info, f)
            total += st.st_size
            if total > MAX_ASSET_BYTES:
                raise AssetError(f"{directory}: more than {MAX_ASSET_BYTES} bytes; too large for an asset")
    return total


def unpack_layer(
    stream: BinaryIO,
    digest: str,
    size: int,
    blob_format: BlobFormat,
    dest_dir: str,
    *,
    where: str,
    budget: ExpansionBudget,
    select: Callable[[str], bool] | None = None,
) -> list[tuple[str, int, str]]:
    """Extract a layer blob into the (new, empty) ``dest_dir``, checking its digest as it streams.
    ``budget`` caps the bytes written (each member charged its declared size before it is
    opened: ``ExpansionLimitError``); ``select`` sees each file before it is written (a counter).
    Files are only trustworthy once this returns: on any error the caller discards ``dest_dir``."""
    reader = VerifyingReader(stream, digest, size, source=where)
    try:
        try:
            files = extract_tar_layer(
                reader,  # type: ignore[arg-type]
                dest_dir,
                "",
                blob_format=blob_format,
                where=where,
                budget=budget,
                select=select,
            )
        except (LayerFormatError, gzip.BadGzipFile, EOFError, zlib.error, tarfile.TarError) as exc:
            # damaged bytes usually break gzip or tar before the digest is known: finish reading
            # so the refusal names the digest mismatch when that is what it is
            while reader.read(HASH_CHUNK):
                pass
            raise UnsafeTarError(f"{where}: not a readable tar+gzip layer ({exc})") from exc
        while reader.read(HASH_CHUNK):  # the digest check happens at EOF, past the tar's padding
            pass
    finally:
        reader.close()
    return files
