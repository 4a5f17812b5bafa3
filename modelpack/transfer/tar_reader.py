"""The forward-only reader a tar layer is extracted from, and tarfile's header parser, bounded.

Split from ``untar`` (which checks members and writes files): here is what reads the layer. The
blob (gzip, zstd or plain tar, as its first bytes say) is decompressed into ``LayerReader``, which counts and optionally
hashes what passes (an image layer's ``diff_id``) and turns every decompression failure into a
``LayerFormatError`` naming the layer. tarfile parses headers straight from it with
``BoundedTarInfo``, which refuses an oversized PAX header or GNU long name before tarfile reads
it into memory, and every sparse encoding (holes expand into data that was never sent).
"""

from __future__ import annotations

import gzip
import hashlib
import os
import sys
import tarfile
import zlib
from collections.abc import Callable
from typing import Any, BinaryIO, cast

from modelpack.errors import LayerFormatError, ManifestError, UnsafeTarError
from modelpack.files import read_exact
from modelpack.mediatypes import BlobFormat, Compression
from modelpack.oci.digest import HASH_CHUNK

#: a PAX extended header or a GNU long name/link: real ones hold a path (≤ 4 KiB) and a few fields
MAX_HEADER_BYTES = 1024 * 1024
#: how much member data is read, written and hashed at a time: large enough that hashlib (which
#: releases the GIL above 2 KiB) and the write dominate the Python-level loop, small enough that
#: several layers extracted at once hold a few MiB between them
COPY_CHUNK = 1024 * 1024


class LayerReader:
    """The decompressed layer as the extraction reads it: counted, hashed when a diff_id is to be
    checked, and with every decompression failure turned into a ``LayerFormatError`` that names
    the layer.

    tarfile parses the headers from it directly (``r:`` mode: no ``_Stream`` buffer joining and
    slicing every read), and member data is copied from it by ``_write_member`` in
    ``COPY_CHUNK`` reads with no copy in between. It only goes forward: ``seek`` skips ahead
    (tarfile passing over a member's data and padding) and refuses to go back.
    """

    def __init__(self, raw: Any, where: str, *, hashing: bool) -> None:
        self.raw = raw
        self.where = where
        self._h = hashlib.sha256() if hashing else None
        self.size = 0  # bytes read so far: the position in the uncompressed tar

    def read_some(self, n: int) -> bytes:
        """Up to ``n`` bytes (fewer only where the source returns fewer; empty at the end)."""
        try:
            data: bytes = self.raw.read(n)
        except (EOFError, zlib.error, gzip.BadGzipFile) as exc:
            raise LayerFormatError(f"{self.where}: the compressed stream is corrupt: {exc}") from exc
        except Exception as exc:
            zstd = sys.modules.get("zstandard")  # imported only when a zstd layer is opened
            if zstd is not None and isinstance(exc, zstd.ZstdError):
                raise LayerFormatError(f"{self.where}: the zstd stream is corrupt: {exc}") from exc
            raise
        if self._h is not None:
            self._h.update(data)
        self.size += len(data)
        return data

    def read(self, n: int = -1) -> bytes:
        """Exactly ``n`` bytes unless the stream ends first (tarfile's header reads need whole
        blocks; a decompressor may return short reads)."""
        if n < 0:
            raise LayerFormatError(f"{self.where}: unbounded read")  # tarfile never asks for one
        data = self.read_some(n)
        if len(data) == n or not data:
            return data
        parts = [data]
        have = len(data)
        while have < n:
            more = self.read_some(n - have)
            if not more:
                break
            parts.append(more)
            have += len(more)
        return b"".join(parts)

    def tell(self) -> int:
        return self.size

    def seek(self, pos: int, whence: int = os.SEEK_SET) -> int:
        """Skip forward to ``pos`` (reading, so the bytes are still hashed and counted)."""
        if whence != os.SEEK_SET or pos < self.size:
            raise LayerFormatError(f"{self.where}: the tar reader asked to go back (to byte {pos})")
        while self.size < pos:
            if not self.read_some(min(COPY_CHUNK, pos - self.size)):
                break  # tarfile's read after the seek reports the end
        return self.size

    def drain_after_end(self, limit: int) -> None:
        """Read to the end, refusing more than ``limit`` bytes after the end-of-archive marker."""
        start = self.size
        while self.read_some(HASH_CHUNK):
            if self.size - start > limit:
                raise LayerFormatError(
                    f"{self.where}: more than {limit} bytes of data after the end of the archive"
                )

    @property
    def digest(self) -> str:
        assert self._h is not None, "opened without hashing"
        return "sha256:" + self._h.hexdigest()


def _zstd_reader(stream: BinaryIO) -> Any:
    import zstandard  # only when a zstd layer is opened

    return zstandard.ZstdDecompressor().stream_reader(stream, read_across_frames=True)


def _gzip_reader(stream: BinaryIO) -> Any:
    return gzip.GzipFile(fileobj=stream, mode="rb")


#: a tar layer's compression → the decompressing reader over its blob (None: the blob is the tar)
DECOMPRESSORS: dict[Compression | None, Callable[[BinaryIO], Any]] = {
    None: lambda stream: stream,
    Compression.GZIP: _gzip_reader,
    Compression.ZSTD: _zstd_reader,
}


#: what is read to choose a decompressor: one tar header block (a tar's ``ustar`` magic is at 257)
SNIFF_BYTES = 512


def open_layer_stream(stream: BinaryIO, blob_format: BlobFormat, where: str = "layer") -> Any:
    """Decompressing view of a tar layer blob, decompressed as its bytes say (containerd's and
    podman's rule: ``podman push`` labels plain tar blobs ``tar+zstd``).

    The first block is read to sniff a compression's magic number (the vocabulary's
    ``Compression.sniff``) and put back in front of the stream. A blob labelled compressed may be
    gzip, zstd or a plain tar (its diff_id, hashed over what is extracted, still binds it); one
    that is none of these is refused naming its first bytes. A blob labelled a plain tar is
    never decompressed: its diff_id is its own digest, so nothing would check what
    decompression produced.
    """
    if not blob_format.is_tar:
        raise ManifestError(f"{where}: a {blob_format} layer is not a tar; nothing to extract")
    head = read_exact(stream, SNIFF_BYTES)
    found = Compression.sniff(head)
    source = cast(BinaryIO, _Prefixed(head, stream))  # the readers only call read()
    if blob_format.compression is None:
        if found is not None:
            raise LayerFormatError(
                f"{where}: labelled {blob_format} (a plain tar) but its bytes are a {found} stream; "
                "refusing to decompress a layer whose diff_id would not check the result"
            )
        return source
    if found is None and not _is_tar_header(head):
        raise LayerFormatError(
            f"{where}: labelled {blob_format} but its bytes are neither a gzip or zstd stream nor a "
            f"tar ({_describe(head)})"
        )
    return DECOMPRESSORS[found](source)


class _Prefixed:
    """``stream`` with ``head`` (read from it to sniff the format) put back in front."""

    def __init__(self, head: bytes, stream: BinaryIO) -> None:
        self._head = head
        self._stream = stream

    def read(self, n: int = -1, /) -> bytes:
        if not self._head:
            return self._stream.read(n)
        if n < 0:
            data, self._head = self._head + self._stream.read(), b""
            return data
        data, self._head = self._head[:n], self._head[n:]
        return data


def _is_tar_header(head: bytes) -> bool:
    """A tar's first header block: the ``ustar`` magic (POSIX, GNU, PAX) or a valid v7 header."""
    if head[257:262] == b"ustar":
        return True
    try:
        tarfile.TarInfo.frombuf(head[: tarfile.BLOCKSIZE], "utf-8", "surrogateescape")
    except tarfile.HeaderError:
        return False
    return True


def _describe(head: bytes) -> str:
    if not head:
        return "it is empty"
    return f"its {min(len(head), 8)} first bytes are {head[:8].hex(' ')}"


class BoundedTarInfo(tarfile.TarInfo):
    """tarfile's header parser with the reads it would do unbounded refused first: an extended
    header or long name is read into memory whole, and a sparse map expands holes into zeros."""

    def _proc_pax(self, tarfile: tarfile.TarFile) -> Any:
        _check_header_size(self, "PAX extended header")
        return super()._proc_pax(tarfile)  # type: ignore[misc]

    def _proc_gnulong(self, tarfile: tarfile.TarFile) -> Any:
        _check_header_size(self, "GNU long name header")
        return super()._proc_gnulong(tarfile)  # type: ignore[misc]

    def _proc_sparse(self, tarfile: tarfile.TarFile) -> Any:
        raise sparse_refusal(self.name, "GNU sparse type 'S'")

    def _proc_gnusparse_00(self, *args: Any) -> Any:
        raise sparse_refusal(self.name, "PAX GNU.sparse 0.0 headers")

    def _proc_gnusparse_01(self, *args: Any) -> Any:
        raise sparse_refusal(self.name, "PAX GNU.sparse 0.1 headers")

    def _proc_gnusparse_10(self, *args: Any) -> Any:
        raise sparse_refusal(self.name, "PAX GNU.sparse 1.0 headers")


def _check_header_size(info: tarfile.TarInfo, what: str) -> None:
    if not 0 <= info.size <= MAX_HEADER_BYTES:
        raise LayerFormatError(f"a {what} of {info.size} bytes (the limit is {MAX_HEADER_BYTES})")


def sparse_refusal(name: str, how: str) -> UnsafeTarError:
    return UnsafeTarError(
        f"member {name!r} is a sparse file ({how}); sparse members are refused (their holes expand "
        "to data that was never sent)"
    )


def is_sparse(member: tarfile.TarInfo) -> bool:
    return (
        member.type == tarfile.GNUTYPE_SPARSE
        or getattr(member, "sparse", None) is not None
        or any(k.startswith("GNU.sparse.") for k in member.pax_headers)
    )


__all__ = [
    "COPY_CHUNK",
    "DECOMPRESSORS",
    "MAX_HEADER_BYTES",
    "SNIFF_BYTES",
    "BoundedTarInfo",
    "LayerReader",
    "is_sparse",
    "open_layer_stream",
    "sparse_refusal",
]
