"""What an upload request sends: a local blob read back, its size held to the descriptor.

A blob's bytes are re-read from the source for every attempt; these readers make a source that
changed since it was hashed (shorter, longer, unreadable) a typed error instead of a body the
HTTP stack would turn into a connection error and retry.
"""

from __future__ import annotations

from typing import BinaryIO

from modelpack.errors import SizeMismatchError, UploadSourceError
from modelpack.oci.descriptor import Descriptor
from modelpack.oci.digest import VerifyingReader


class BodySlice:
    """At most ``n`` bytes of ``reader``; has ``__len__`` so requests sends a Content-Length.

    A read error of the source is raised as ``UploadSourceError``: the HTTP stack would turn an
    ``OSError`` raised inside a request body into a connection error, and a retry loop would then
    re-read a broken source until its budget ran out."""

    def __init__(self, reader: UploadReader, n: int, desc: Descriptor) -> None:
        self._reader = reader
        self._left = n
        self._n = n
        self._desc = desc

    def __len__(self) -> int:
        return self._left

    def read(self, size: int = -1) -> bytes:
        if self._left <= 0:
            return b""
        if size < 0 or size > self._left:
            size = self._left
        try:
            data: bytes = self._reader.read(size)
        except OSError as exc:
            raise UploadSourceError(
                f"{self._reader.source}: reading {self._desc.digest} for upload failed: {exc}; "
                "nothing was committed"
            ) from exc
        if not data:
            raise SizeMismatchError(
                self._desc.digest, self._n, self._n - self._left, source=self._reader.source
            )
        self._left -= len(data)
        return data


class SizeCheckedReader:
    """Reads a ``verified`` local file from ``offset``; fails if it is shorter or longer than the
    descriptor says (a file edited since it was hashed)."""

    def __init__(self, raw: BinaryIO, desc: Descriptor, offset: int, source: str) -> None:
        self._raw = raw
        self._desc = desc
        self._pos = offset
        self.source = source

    def read(self, n: int = -1) -> bytes:
        left = self._desc.size - self._pos
        if left <= 0:
            if self._raw.read(1):
                raise SizeMismatchError(self._desc.digest, self._desc.size, self._pos + 1, source=self.source)
            return b""
        data = self._raw.read(left if n < 0 or n > left else n)
        if not data:
            raise SizeMismatchError(self._desc.digest, self._desc.size, self._pos, source=self.source)
        self._pos += len(data)
        return data

    def close(self) -> None:
        self._raw.close()


UploadReader = VerifyingReader | SizeCheckedReader


def reader_complete(reader: UploadReader, size: int) -> bool:
    """Whether every byte of the blob went through ``reader`` (so its end check can run)."""
    if isinstance(reader, VerifyingReader):
        return reader.bytes_read == size
    return False
