"""Blob uploads to a registry repository: one PUT when small, else resumable PATCH chunks.

Blobs up to ``monolithic_max`` go in one streamed PUT; larger ones in PATCH chunks of
``chunk_size`` with ``Content-Range``. After each acknowledged chunk the upload's location and
offset are saved (``upload_state_dir``), so a push killed midway asks the registry where the
session stands (GET upload status, ``Range`` header) and continues from there. The bytes already
sent are re-read and hashed locally (never re-sent), so the client still verifies every byte of
the blob it commits. A session the registry no longer knows (or that it cancelled: distribution
2.8 cancels one whose stored size disagrees with the last acknowledged offset, which happens when
a PATCH was cut mid-body) restarts that blob from zero.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
from collections.abc import Iterator
from typing import Any, BinaryIO
from urllib.parse import urlencode

import requests

from modelpack.errors import DigestMismatchError, RegistryError, SizeMismatchError, UploadError
from modelpack.files import atomic_write_bytes
from modelpack.oci.descriptor import Descriptor
from modelpack.oci.digest import Digest, VerifyingReader
from modelpack.targets.base import BlobSource
from modelpack.targets.registry.repository import RepositoryAPI

log = logging.getLogger("modelpack.targets.registry")

DEFAULT_CHUNK_SIZE = 64 * 1024 * 1024
DEFAULT_MONOLITHIC_MAX = 64 * 1024 * 1024
_RANGE_RE = re.compile(r"^(?:bytes=)?0-(\d+)$")


def _upload_state_root() -> str:
    env = os.environ.get("MODELPACK_UPLOAD_STATE_DIR")
    if env:
        return env
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "modelpack", "uploads")


class _Slice:
    """At most ``n`` bytes of ``reader``; has ``__len__`` so requests sends a Content-Length."""

    def __init__(self, reader: Any, n: int) -> None:
        self._reader = reader
        self._left = n
        self._n = n

    def __len__(self) -> int:
        return self._left

    def read(self, size: int = -1) -> bytes:
        if self._left <= 0:
            return b""
        if size < 0 or size > self._left:
            size = self._left
        data: bytes = self._reader.read(size)
        if not data:
            raise SizeMismatchError(
                getattr(self._reader, "digest", "?"), self._n, self._n - self._left, source="upload source"
            )
        self._left -= len(data)
        return data


class _SizeCheckedReader:
    """Reads a ``verified`` local file from ``offset``; fails if it is shorter or longer than the
    descriptor says (a file edited since it was hashed)."""

    def __init__(self, raw: BinaryIO, desc: Descriptor, offset: int) -> None:
        self._raw = raw
        self._desc = desc
        self._pos = offset

    def read(self, n: int = -1) -> bytes:
        left = self._desc.size - self._pos
        if left <= 0:
            if self._raw.read(1):
                raise SizeMismatchError(
                    self._desc.digest, self._desc.size, self._pos + 1, source="upload source"
                )
            return b""
        data = self._raw.read(left if n < 0 or n > left else n)
        if not data:
            raise SizeMismatchError(self._desc.digest, self._desc.size, self._pos, source="upload source")
        self._pos += len(data)
        return data

    def close(self) -> None:
        self._raw.close()


_Reader = VerifyingReader | _SizeCheckedReader


class BlobUploader:
    """Uploads into one repository; each blob's resumable session is saved under ``upload_state_dir``."""

    def __init__(
        self,
        repo: RepositoryAPI,
        *,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        monolithic_max: int = DEFAULT_MONOLITHIC_MAX,
        upload_state_dir: str | None = None,
    ) -> None:
        self._repo = repo
        self.chunk_size = chunk_size
        self.monolithic_max = monolithic_max
        self._state_dir = os.path.join(
            upload_state_dir or _upload_state_root(),
            hashlib.sha256(repo.name.encode()).hexdigest()[:32],
        )

    def _state_path(self, digest: str) -> str:
        return os.path.join(self._state_dir, Digest(digest).hex + ".json")

    def _save_state(self, digest: str, location: str, offset: int) -> None:
        os.makedirs(self._state_dir, exist_ok=True)
        doc = {"location": location, "offset": offset, "repository": self._repo.name}
        atomic_write_bytes(self._state_path(digest), json.dumps(doc).encode(), mode=0o600)

    def _drop_state(self, digest: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._state_path(digest))

    def _load_state(self, digest: str) -> tuple[str, int] | None:
        try:
            with open(self._state_path(digest), "rb") as f:
                doc = json.loads(f.read(64 * 1024))
            location, offset = doc["location"], int(doc["offset"])
            if not isinstance(location, str) or offset < 0:
                return None
            return location, offset
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def start(self) -> str:
        """Open an upload session (a POST, never retried); its absolute location."""
        resp = self._repo.client.request(
            "POST",
            self._repo.path("blobs/uploads"),
            scopes=self._repo.scopes(push=True),
            ok=(202,),
            what=f"start upload to {self._repo.name}",
        )
        location = resp.headers.get("Location")
        if not location:
            raise UploadError("upload started without a Location", status=202, target=self._repo.name)
        return self._repo.client.resolve_location(location)

    def upload_status(self, location: str) -> tuple[str, int] | None:
        """Ask the registry how much of an upload session it holds: (location, next offset)."""
        resp = self._repo.client.request(
            "GET",
            location,
            scopes=self._repo.scopes(push=True),
            ok=(204,),
            allow=(200, 400, 404, 416),
            what="upload status",
        )
        resp.close()
        if resp.status_code not in (200, 204):
            return None
        m = _RANGE_RE.match(resp.headers.get("Range", "").strip())
        # distribution writes "0-0" for an empty session (and for one byte): read it as empty
        offset = int(m.group(1)) + 1 if m and int(m.group(1)) > 0 else 0
        new_location = resp.headers.get("Location")
        return (self._repo.client.resolve_location(new_location) if new_location else location), offset

    @contextlib.contextmanager
    def _state_lock(self, digest: str) -> Iterator[bool]:
        """Own the saved state of ``digest`` for this upload; False when another process (a
        concurrent push of the same blob) holds it: then upload without saving or resuming."""
        try:
            os.makedirs(self._state_dir, exist_ok=True)
            fd = os.open(self._state_path(digest) + ".lock", os.O_CREAT | os.O_RDWR, 0o600)
        except OSError:
            yield False
            return
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                yield False
                return
            yield True
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._state_path(digest) + ".lock")
        finally:
            os.close(fd)

    def upload(self, source: BlobSource) -> None:
        """Store ``source``'s blob, resuming a saved session of it when there is one."""
        if (
            source.descriptor.size <= self.monolithic_max
            and self._load_state(source.descriptor.digest) is None
        ):
            self._upload_locked(source, persist=False)  # one PUT: nothing to resume
            return
        with self._state_lock(source.descriptor.digest) as owned:
            self._upload_locked(source, owned)

    def _upload_locked(self, source: BlobSource, persist: bool) -> None:
        desc = source.descriptor
        location: str | None = None
        offset = 0
        saved = self._load_state(desc.digest) if persist else None
        if saved is not None:
            status = self.upload_status(saved[0])
            if status is not None and status[1] == saved[1] and status[1] <= desc.size:
                location, offset = status
                log.debug("resuming upload of %s at offset %d", desc.digest, offset)
                self._repo.count("resumed")
            else:
                log.debug("saved upload of %s is gone or inconsistent; restarting it", desc.digest)
            self._drop_state(desc.digest)
        if location is None:
            location = self.start()
            offset = 0
        chunked = offset > 0 or desc.size > self.monolithic_max
        reader: VerifyingReader | _SizeCheckedReader
        if source.verified and source.local_path:
            # the packer hashed this very file moments ago: check sizes, skip a second hash pass
            # (the registry hashes what it receives and refuses a commit that does not match)
            reader = _SizeCheckedReader(source.open(offset), desc, offset)
        else:
            reader = VerifyingReader(
                source.open(0), desc.digest, desc.size, source=source.local_path or self._repo.name
            )
        try:
            if offset and isinstance(reader, VerifyingReader):
                # re-hash what the registry already holds (read, not re-sent): the commit below
                # still covers every byte with our own digest check
                left = offset
                while left:
                    data = reader.read(min(left, 4 << 20))
                    if not data:
                        raise SizeMismatchError(desc.digest, desc.size, offset - left, source=self._repo.name)
                    left -= len(data)
            if not chunked:
                self._put_monolithic(location, reader, desc)
                return
            while offset < desc.size:
                n = min(self.chunk_size, desc.size - offset)
                location = self._patch(location, reader, offset, n, desc)
                offset += n
                if persist:
                    self._save_state(desc.digest, location, offset)
            reader.read(1)  # end of stream: raises unless size and digest matched
            self._commit(location, desc)
            self._drop_state(desc.digest)
        except (SizeMismatchError, DigestMismatchError):
            # the source is not what the descriptor says: cancel the session, never commit
            self._drop_state(desc.digest)
            with contextlib.suppress(RegistryError):
                self._repo.client.request(
                    "DELETE", location, scopes=self._repo.scopes(push=True), ok=(204, 200), allow=(404,)
                )
            raise
        finally:
            reader.close()

    def _put_monolithic(self, location: str, reader: _Reader, desc: Descriptor) -> None:
        url = _with_query(location, {"digest": str(desc.digest)})
        try:
            resp = self._repo.client.request(
                "PUT",
                url,
                scopes=self._repo.scopes(push=True),
                headers={"Content-Type": "application/octet-stream"},
                body=_Slice(reader, desc.size) if desc.size else b"",
                ok=(201,),
                what=f"upload {desc.digest} to {self._repo.name}",
            )
        except RegistryError:
            # the registry refuses bytes that do not hash to the digest (DIGEST_INVALID); if that
            # was our source's fault, say so with the digest and the file at fault
            if _reader_complete(reader, desc.size):
                reader.read(1)
            raise
        reader.read(1)  # raises if the stream did not hash to the digest (registry checks too)
        self._check_committed(resp, desc)
        self._repo.count("bytes_sent", desc.size)

    def _patch(self, location: str, reader: _Reader, offset: int, n: int, desc: Descriptor) -> str:
        resp = self._repo.client.request(
            "PATCH",
            location,
            scopes=self._repo.scopes(push=True),
            headers={
                "Content-Type": "application/octet-stream",
                "Content-Range": f"{offset}-{offset + n - 1}",
            },
            body=_Slice(reader, n),
            ok=(202,),
            what=f"upload chunk {offset}+{n} of {desc.digest} to {self._repo.name}",
        )
        self._repo.count("bytes_sent", n)
        rng = resp.headers.get("Range", "")
        m = _RANGE_RE.match(rng.strip())
        if m and int(m.group(1)) != offset + n - 1:
            raise UploadError(
                f"registry holds {int(m.group(1)) + 1} bytes of {desc.digest}, expected {offset + n}",
                status=202,
                target=self._repo.name,
            )
        new_location = resp.headers.get("Location")
        return self._repo.client.resolve_location(new_location) if new_location else location

    def _commit(self, location: str, desc: Descriptor) -> None:
        resp = self._repo.client.request(
            "PUT",
            _with_query(location, {"digest": str(desc.digest)}),
            scopes=self._repo.scopes(push=True),
            headers={"Content-Type": "application/octet-stream"},
            body=b"",
            ok=(201,),
            what=f"commit {desc.digest} to {self._repo.name}",
        )
        self._check_committed(resp, desc)

    def _check_committed(self, resp: requests.Response, desc: Descriptor) -> None:
        got = resp.headers.get("Docker-Content-Digest")
        if got and got != desc.digest:
            raise UploadError(
                f"registry committed {got}, expected {desc.digest}", status=201, target=self._repo.name
            )


def _reader_complete(reader: _Reader, size: int) -> bool:
    """Whether every byte of the blob went through ``reader`` (so its end check can run)."""
    if isinstance(reader, VerifyingReader):
        return reader.bytes_read == size
    return False


def _with_query(url: str, params: dict[str, str]) -> str:
    sep = "&" if "?" in url else "?"
    return url + sep + urlencode(params)
