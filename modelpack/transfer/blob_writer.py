"""The one writer for every verified blob download, in containerd's content-store shape.

Open a writer on a partial (``PartialSlot``: where it lives and how it is locked is the caller's
strategy: beside the final path for a directory pull, ``ingest/`` under the digest lock for the
node cache) → ``resume`` (re-hash the bytes already on disk: the hash state cannot be saved, and
disk content after a crash is not to be trusted blindly) → ``write`` the rest (asked of the source
with a Range request) → ``commit`` (size and sha256 checked, fsync, mode set, atomic rename, the
directory fsynced or handed to a ``DirSyncs``). Nothing unverified is ever at a final path.

Bytes once written to a partial never change: a writer that throws bytes away (a resumed prefix
that failed the check, a partial longer than the blob) starts a new file instead of rewriting the
old one. A stream-through load (``loader.stream_through``) reads a partial while it grows and
trusts what it read once the cache verified the blob, telling the verified file apart by inode
(``WriteHooks.on_verified``); a rewrite in place would pass bytes it never checked.

Every way out of an uncommitted writer either keeps a resumable partial (the disk filled up, the
source went away or dropped the connection) or leaves nothing (a size or digest mismatch, a
cancel or signal, an output that refused the write). Liveness of a partial comes from the lock
its writer holds (``flock``, dropped by the kernel when the writer dies), never from its mtime.

``fetch_verified`` is the download loop every caller uses: resume, fetch the rest, and when a
resumed blob fails the final check, throw the kept prefix away (a torn write, bit rot) and fetch
once more from zero.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from modelpack.errors import (
    DigestMismatchError,
    DiskFullError,
    FileWriteError,
    RegistryError,
    SizeMismatchError,
    TransferInterrupted,
)
from modelpack.files import TEMP_PREFIX, DirSyncs, Writeback, fsync_dir, write_error
from modelpack.oci.descriptor import Descriptor
from modelpack.oci.digest import HASH_CHUNK, Digest
from modelpack.targets.base import ReadableTarget
from modelpack.transfer.cancel import Cancel

#: bytes asked of the source per read: small enough that a partial grows steadily (what a resume
#: reuses after a crash) and a cancel is seen quickly, large enough to keep per-call overhead low
READ_CHUNK = 1024 * 1024


@dataclass
class Partial:
    """An open, locked partial: ``resumable`` when a later writer finds it again by its name (a
    private temp file is not: it is removed on every failure)."""

    fd: int
    path: str
    resumable: bool


class PartialSlot(Protocol):
    """Where a blob's partial lives and how it is locked (the caller's strategy)."""

    def open(self) -> Partial:
        """Open (creating) the partial, locked against other writers of the same ref."""
        ...


class PrivateTemp:
    """A ``PartialSlot`` for a writer whose partial nobody finds again: a fresh private file in
    ``directory`` (a temp name, created exclusively, ``0600``), removed on every failure."""

    def __init__(self, directory: str, digest: Digest, *, tag: str = "") -> None:
        self.directory = directory
        self.digest = digest
        self.tag = tag

    def open(self) -> Partial:
        name = f"{TEMP_PREFIX}{self.tag}{self.digest.hex[:16]}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        path = os.path.join(self.directory, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise write_error(path, exc) from exc
        return Partial(fd, path, resumable=False)


@dataclass(frozen=True)
class Landing:
    """Where a verified blob is committed and how.

    ``dirs``: the directory fsync is left to the caller (once per directory after all renames),
    with the directories up to ``root`` (the caller may have created them); else it is done here.
    ``what`` names the blob in a digest mismatch; a refused write (a full disk) names the final
    path (the file a person asked for), or with ``name_partial`` the partial (a store whose final
    paths are its own business), says what was kept and ends with ``full_disk_hint``."""

    final: str
    mode: int = 0o644
    dirs: DirSyncs | None = None
    root: str | None = None
    what: str = "blob"
    full_disk_hint: str = "free space and pull again"
    name_partial: bool = False


@dataclass
class Downloaded:
    fetched: int = 0  # bytes asked of the source by this writer
    resumed: int = 0  # bytes of a kept partial that were re-hashed instead


@dataclass
class WriteHooks:
    """What a caller hears while a blob is written (all optional)."""

    cancel: Cancel | None = None  # checked before every read of the source
    on_bytes: Callable[[int], None] | None = None  # bytes fetched and written (progress, heartbeat)
    on_resume: Callable[[int], None] | None = None  # a kept prefix of this many bytes is reused
    on_discard: Callable[[int], None] | None = None  # the reused prefix failed the check: refetched
    # the bytes written match the digest and size (before the fsync and rename): the stat of the
    # file holding them, whose inode the committed blob keeps
    on_verified: Callable[[os.stat_result], None] | None = None
    # start the partial's disk writes as it grows, so the fsync before the rename has only the
    # tail left; False leaves them to the kernel, so bytes a follower waits for (a stream-through
    # load) land at the network's pace, not the disk's, and the commit's fsync writes them all
    writeback: bool = True


def keeps_partial(exc: BaseException) -> bool:
    """Whether a failure leaves the partial for a resume: kept when its bytes were right and only
    the disk, the source or the person stopped it (a full disk, a cut connection, a 5xx, Ctrl-C,
    SIGTERM, a sibling's failure): a rerun re-hashes the kept prefix before it appends, so keeping
    costs nothing but disk. Removed on a digest or size mismatch, an output that refused the write,
    or a source that said the blob is not there for us (an HTTP 4xx)."""
    if isinstance(exc, (DiskFullError, TransferInterrupted, KeyboardInterrupt)):
        return True
    if not isinstance(exc, Exception):
        return False
    if isinstance(exc, (DigestMismatchError, SizeMismatchError, FileWriteError)):
        return False
    if isinstance(exc, RegistryError):
        return exc.status is None or exc.status >= 500
    return True


class BlobWriter:
    """An open writer of one blob (containerd's ``content.Writer``); a context manager whose exit
    commits nothing and keeps or removes the partial as ``keeps_partial`` says."""

    def __init__(self, slot: PartialSlot, desc: Descriptor, *, writeback: bool = True) -> None:
        self.desc = desc
        self._slot = slot
        self._eager = writeback
        partial = slot.open()
        self.fd = partial.fd
        self.path = partial.path
        self.resumable = partial.resumable
        self.offset = 0
        self._hash = hashlib.sha256()
        self._writeback = Writeback(self.fd, 0) if writeback else None
        self._committed = False

    # ------------------------------------------------------------------ writing
    def resume(self) -> int:
        """Re-hash the bytes already in the partial and continue after them; returns how many
        (0: nothing usable, started over: empty, or longer than the blob)."""
        have = os.fstat(self.fd).st_size
        self._hash = hashlib.sha256()
        n = 0
        if 0 < have <= self.desc.size:
            while n < have:
                chunk = os.pread(self.fd, min(HASH_CHUNK, have - n), n)
                if not chunk:
                    break
                self._hash.update(chunk)
                n += len(chunk)
        if n != have:  # longer than the blob, or unreadable: nothing is reused
            self.restart()
            return 0
        self._seek(n)
        return n

    def restart(self) -> None:
        """Throw away what was written and start from zero, in a new file (module docstring: the
        old bytes are never rewritten in place)."""
        self._new_file()
        self._hash = hashlib.sha256()
        self._seek(0)

    def _new_file(self) -> None:
        """Unlink this writer's partial and open a fresh one from the slot (the caller's lock on
        the digest, or the temp file's own, stays what guards it)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        os.close(self.fd)
        self.fd = -1
        partial = self._slot.open()
        self.fd, self.path, self.resumable = partial.fd, partial.path, partial.resumable

    def _seek(self, offset: int) -> None:
        os.ftruncate(self.fd, offset)
        os.lseek(self.fd, offset, os.SEEK_SET)
        self.offset = offset
        self._writeback = Writeback(self.fd, offset) if self._eager else None

    def write(self, data: bytes | memoryview, landing: Landing) -> None:
        """Append ``data``; a refused write (a full disk) names the path ``landing`` asks for and
        says what is kept."""
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self.fd, view) :]
        except OSError as exc:
            kept = f"nothing was kept; {landing.full_disk_hint}"
            have = os.fstat(self.fd).st_size
            if self.resumable and have > 0:  # an empty partial is not kept (``close``)
                kept = (
                    f"the {have} bytes downloaded so far are kept in {self.path} for the next pull "
                    f"to resume; {landing.full_disk_hint}"
                )
            raise write_error(self.path if landing.name_partial else landing.final, exc, kept=kept) from exc
        if self._writeback is not None:
            self._writeback.wrote(len(data))
        self._hash.update(data)
        self.offset += len(data)

    def digest(self) -> str:
        return "sha256:" + self._hash.hexdigest()

    def verified(self) -> bool:
        return self.offset == self.desc.size and self.digest() == self.desc.digest

    # ------------------------------------------------------------------ committing
    def commit(self, expected_size: int, expected_digest: str, landing: Landing, *, source: str = "") -> None:
        """Check size and sha256, fsync, set the mode, rename to ``landing.final``, sync the
        directory (or hand it to ``landing.dirs``). Raises the mismatch otherwise."""
        if self.offset != expected_size:
            raise SizeMismatchError(expected_digest, expected_size, self.offset, source=source)
        actual = self.digest()
        if actual != expected_digest:
            raise DigestMismatchError(expected_digest, actual, what=landing.what, source=source)
        try:
            os.fsync(self.fd)
            os.fchmod(self.fd, landing.mode)
            os.replace(self.path, landing.final)
            self._committed = True
            if landing.dirs is None:
                fsync_dir(os.path.dirname(landing.final))
            else:
                landing.dirs.add(os.path.dirname(landing.final), root=landing.root)
        except OSError as exc:
            raise write_error(landing.final, exc) from exc

    def close(self, exc: BaseException | None = None) -> None:
        """Drop the lock; an uncommitted partial is kept only when resumable, ``exc`` allows and
        it holds bytes (an empty one resumes nothing)."""
        if self.fd < 0:
            return
        try:
            keep = self.resumable and exc is not None and keeps_partial(exc) and os.fstat(self.fd).st_size > 0
            if not self._committed and not keep:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path)
        finally:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> BlobWriter:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        self.close(exc)


def open_writer(slot: PartialSlot, desc: Descriptor, *, writeback: bool = True) -> BlobWriter:
    """A writer for ``desc`` on the partial ``slot`` opens and locks."""
    return BlobWriter(slot, desc, writeback=writeback)


def fetch_verified(
    source: ReadableTarget,
    desc: Descriptor,
    slot: PartialSlot,
    landing: Landing,
    hooks: WriteHooks | None = None,
    *,
    chunk: int = READ_CHUNK,
) -> Downloaded:
    """Fetch ``desc`` from ``source`` into ``landing.final`` by way of ``slot``'s partial
    (resumed when it holds a prefix), reading at most ``chunk`` bytes at a time; see the module
    docstring for what every failure leaves."""
    hooks = hooks or WriteHooks()
    got = Downloaded()
    with open_writer(slot, desc, writeback=hooks.writeback) as w:
        offset = w.resume()
        if offset and hooks.on_resume is not None:
            hooks.on_resume(offset)
        got.resumed = offset
        _fetch_rest(source, w, landing, hooks, got, chunk)
        if not w.verified() and offset:
            # The kept prefix may be what is wrong (a torn write, bit rot): once more from zero.
            if hooks.on_discard is not None:
                hooks.on_discard(offset)
            got.resumed = 0
            w.restart()
            _fetch_rest(source, w, landing, hooks, got, chunk)
        if hooks.on_verified is not None and w.verified():
            hooks.on_verified(os.fstat(w.fd))
        w.commit(desc.size, desc.digest, landing, source=source.name)
    return got


def _fetch_rest(
    source: ReadableTarget, w: BlobWriter, landing: Landing, hooks: WriteHooks, got: Downloaded, chunk: int
) -> None:
    """Append the blob from the writer's offset. One byte past the declared size is asked for
    (counted, never written): a source that sends more is lying about the size, and the commit
    says so."""
    size = w.desc.size
    if w.offset >= size:
        return  # a complete partial (killed before its rename) needs no fetch at all
    with source.fetch_blob(w.desc, w.offset) as stream:
        while w.offset <= size:
            if hooks.cancel is not None:
                hooks.cancel.check()
            data = stream.read(min(chunk, size - w.offset + 1))
            if not data:
                break
            if w.offset + len(data) > size:
                w.offset += len(data)  # counted, never written: the commit refuses the size
                break
            w.write(data, landing)
            got.fetched += len(data)
            if hooks.on_bytes is not None:
                hooks.on_bytes(len(data))


__all__ = [
    "READ_CHUNK",
    "BlobWriter",
    "Downloaded",
    "Landing",
    "Partial",
    "PartialSlot",
    "PrivateTemp",
    "WriteHooks",
    "fetch_verified",
    "keeps_partial",
    "open_writer",
]
