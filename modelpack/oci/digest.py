"""Content digests. Only sha256 is accepted: it is what OCI registries and signatures use."""

from __future__ import annotations

import hashlib
import io
import os
import re
from typing import Any, BinaryIO

from modelpack.errors import DigestMismatchError, InvalidDigestError, SizeMismatchError

_DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")
HASH_CHUNK = 4 * 1024 * 1024


class Digest(str):
    """A validated ``sha256:<hex>`` string. Being a ``str`` keeps JSON and dict keys simple."""

    __slots__ = ()

    def __new__(cls, value: str) -> Digest:
        if isinstance(value, Digest):
            return value
        if not isinstance(value, str) or not _DIGEST_RE.match(value):
            shown = repr(value[:80] + "…" if isinstance(value, str) and len(value) > 80 else value)
            if len(shown) > 100:  # a hostile document's list or object: its type is enough
                shown = type(value).__name__
            raise InvalidDigestError(f"invalid digest {shown}: expected sha256:<64 lowercase hex>")
        return super().__new__(cls, value)

    @property
    def hex(self) -> str:
        return self[7:]

    @classmethod
    def from_bytes(cls, data: bytes) -> Digest:
        return cls("sha256:" + hashlib.sha256(data).hexdigest())

    @classmethod
    def from_hex(cls, hexdigest: str) -> Digest:
        return cls("sha256:" + hexdigest)


def sha256_file(path: str | os.PathLike[str], *, chunk: int = HASH_CHUNK) -> tuple[Digest, int]:
    """Hash a file with a reused buffer (no per-chunk allocation); returns (digest, size)."""
    try:
        with open(path, "rb", buffering=0) as f:
            return sha256_fileobj(f, chunk=chunk)
    except OSError as exc:
        if exc.filename is not None:
            raise
        # a read error (EIO, a vanished network mount) carries no path: give it the file's
        raise OSError(exc.errno, exc.strerror or str(exc), os.fspath(path)) from exc


def sha256_fileobj(f: io.RawIOBase, *, chunk: int = HASH_CHUNK) -> tuple[Digest, int]:
    """Hash an open (unbuffered) binary file from its position to EOF; returns (digest, size).

    One reused buffer, ``readinto`` then ``update``: both release the GIL (hashlib above 2 KiB), so
    threads hash files in parallel at OpenSSL's speed. Not ``mmap``: a file truncated while
    mapped kills the process with SIGBUS where a read returns short and the caller can refuse.
    """
    h = hashlib.sha256()
    buf = bytearray(chunk)
    view = memoryview(buf)
    size = 0
    while True:
        n = f.readinto(buf)
        if not n:
            break
        h.update(view[:n])
        size += n
    return Digest.from_hex(h.hexdigest()), size


class HashingReader:
    """A stream passed through unchanged, hashed and counted on the way.

    For a digest known only once the last byte went by — a layer blob's digest and its diff_id
    while tarfile reads the decompressed stream. It checks nothing itself: the caller compares
    ``digest`` and ``size`` when done (``VerifyingReader`` is the one that knows what to expect).
    Subclasses override ``_read`` to translate a source's own errors. With ``hashing=False`` it
    only counts: hashing is the costliest step of a tar layer's extraction, and paid once more
    for nothing where no caller will compare the digest.
    """

    def __init__(self, raw: Any, *, hashing: bool = True) -> None:
        self.raw = raw
        self._h = hashlib.sha256() if hashing else None
        self.size = 0

    def _read(self, n: int) -> bytes:
        data: bytes = self.raw.read(n)
        return data

    def read(self, n: int = -1) -> bytes:
        data = self._read(n)
        if self._h is not None:
            self._h.update(data)
        self.size += len(data)
        return data

    def drain(self, chunk: int = HASH_CHUNK) -> None:
        """Read (and hash) the rest of the stream."""
        while self.read(chunk):
            pass

    @property
    def digest(self) -> Digest:
        if self._h is None:
            raise ValueError("this reader was opened without hashing")
        return Digest.from_hex(self._h.hexdigest())


class HashingWriter:
    """A sink that hashes and counts what is written through it (a tar's diff_id, the blob digest
    of what reaches the file), so the digest exists the moment the last byte is written."""

    def __init__(self, sink: Any) -> None:
        self.sink = sink
        self._h = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> int:
        self._h.update(data)
        self.size += len(data)
        self.sink.write(data)
        return len(data)

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        self.sink.flush()

    @property
    def digest(self) -> Digest:
        return Digest.from_hex(self._h.hexdigest())


class VerifyingReader:
    """Wraps a stream; hashes what passes through and checks size and digest at EOF.

    The check happens when the expected size is reached or the source ends, so a consumer that
    reads to the end can never finish with unverified bytes.
    """

    def __init__(self, raw: BinaryIO, digest: str, size: int | None, *, source: str = "") -> None:
        self._raw = raw
        self.digest = Digest(digest)
        self.size = size
        self.source = source
        self._h = hashlib.sha256()
        self._n = 0
        self._done = False

    def read(self, n: int = -1) -> bytes:
        if self._done:
            return b""
        if self.size is not None:
            remaining = self.size - self._n
            if n < 0 or n > remaining:
                n = remaining
            # read one byte past the declared size to detect an oversize stream
            data = self._raw.read(n) if n > 0 else b""
            if n == 0 or not data:
                extra = self._raw.read(1) if n == 0 else b""
                self._finish(overflow=bool(extra))
                return b""
        else:
            data = self._raw.read(n)
            if not data:
                self._finish()
                return b""
        self._h.update(data)
        self._n += len(data)
        return data

    def _finish(self, overflow: bool = False) -> None:
        self._done = True
        if overflow:
            raise SizeMismatchError(self.digest, self.size or 0, self._n + 1, source=self.source)
        if self.size is not None and self._n != self.size:
            raise SizeMismatchError(self.digest, self.size, self._n, source=self.source)
        actual = "sha256:" + self._h.hexdigest()
        if actual != self.digest:
            raise DigestMismatchError(self.digest, actual, what="blob", source=self.source)

    @property
    def bytes_read(self) -> int:
        return self._n

    def close(self) -> None:
        close = getattr(self._raw, "close", None)
        if close:
            close()


def verify_bytes(
    data: bytes, digest: str, size: int | None = None, *, what: str = "blob", source: str = ""
) -> None:
    if size is not None and len(data) != size:
        raise SizeMismatchError(digest, size, len(data), source=source)
    actual = "sha256:" + hashlib.sha256(data).hexdigest()
    if actual != digest:
        raise DigestMismatchError(digest, actual, what=what, source=source)
