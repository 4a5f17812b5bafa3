"""Download one raw layer to its file: resumable, verified, renamed into place only when whole.

The bytes go to a locked ``.partial`` next to the final path (``staging.partial_path``). When
the disk fills up or the source goes away, the partial is kept and the error says where: the
next pull re-hashes it and asks the source only for the rest (a Range request). Every other
way out (a digest mismatch, a signal, a closed output, a cancelled sibling) removes it. Nothing
unverified is ever at a final path.

Durability is ordered, not per step: the write-back of the partial starts while it is written
(``Writeback``), the partial is fsynced once verified, then renamed; the directory fsync is left
to the caller's ``DirSyncs`` (one per directory after all renames) when it passes one.
"""

from __future__ import annotations

import hashlib
import os
import threading
from dataclasses import dataclass
from typing import Any

from modelpack.errors import (
    DigestMismatchError,
    DiskFullError,
    FileWriteError,
    RegistryConnectionError,
    RegistryError,
    SizeMismatchError,
    TransferCancelled,
    TransferInterrupted,
)
from modelpack.files import DirSyncs, Writeback, fsync_dir, write_error
from modelpack.oci.descriptor import Descriptor
from modelpack.oci.digest import HASH_CHUNK
from modelpack.progress import TransferBar
from modelpack.targets.base import ReadableTarget
from modelpack.transfer.staging import PARTIAL_SUFFIX, open_partial

READ_CHUNK = 1024 * 1024


class Cancel:
    """Set once by the thread that saw the first failure (or a signal); every worker checks it
    between reads, so siblings stop within one chunk and clean up after themselves."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def set(self) -> None:
        self._event.set()

    def check(self) -> None:
        if self._event.is_set():
            raise TransferCancelled("cancelled: another part of this transfer failed or was interrupted")


class CancellableReader:
    """A stream that stops with ``TransferInterrupted`` once ``cancel`` is set and reports progress."""

    def __init__(self, raw: Any, cancel: Cancel, bar: TransferBar | None = None) -> None:
        self._raw = raw
        self._cancel = cancel
        self._bar = bar

    def read(self, n: int = -1) -> bytes:
        self._cancel.check()
        data: bytes = self._raw.read(n)
        if self._bar is not None and data:
            self._bar.update(len(data))
        return data

    def readinto(self, buf: Any) -> int:
        view = memoryview(buf).cast("B")
        data = self.read(len(view))
        view[: len(data)] = data
        return len(data)

    def close(self) -> None:
        close = getattr(self._raw, "close", None)
        if close is not None:
            close()


@dataclass
class Downloaded:
    fetched: int = 0  # bytes asked of the source by this pull
    resumed: int = 0  # bytes of a kept partial that were re-hashed instead


def keeps_partial(exc: BaseException) -> bool:
    """A partial is worth keeping when its bytes were right and only the disk or the source failed."""
    if isinstance(exc, DiskFullError):
        return True
    if isinstance(exc, (TransferInterrupted, DigestMismatchError, SizeMismatchError, FileWriteError)):
        return False
    if isinstance(exc, RegistryConnectionError):
        return True
    if isinstance(exc, RegistryError):
        return exc.status is None or exc.status >= 500
    return isinstance(exc, (OSError, EOFError)) or type(exc).__module__.split(".")[0] in (
        "urllib3",
        "requests",
    )


def _rehash(fd: int, size: int, h: Any) -> int:
    """Feed the kept prefix into ``h``; returns its length (0: start over)."""
    have = os.fstat(fd).st_size
    if have == 0 or have > size:
        return 0
    n = 0
    while n < have:
        chunk = os.pread(fd, min(HASH_CHUNK, have - n), n)
        if not chunk:
            break
        h.update(chunk)
        n += len(chunk)
    return n


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def download_raw(
    target: ReadableTarget,
    desc: Descriptor,
    final: str,
    partial: str,
    *,
    cancel: Cancel,
    bar: TransferBar | None = None,
    dirs: DirSyncs | None = None,
    root: str | None = None,
) -> Downloaded:
    """Fetch ``desc`` from ``target`` into ``final`` by way of ``partial`` (resumed when present).

    The verified partial is fsynced, then renamed to ``final``; its directory is fsynced here,
    or added to ``dirs`` (with the directories up to ``root``: the pull may have created them)
    for the caller to fsync once after all its renames."""
    fd, partial = open_partial(partial)
    resumable = partial.endswith(PARTIAL_SUFFIX)  # else a private temp file: its name is not found again
    got = Downloaded()
    try:
        for attempt in (0, 1):
            h = hashlib.sha256()
            offset = _rehash(fd, desc.size, h) if attempt == 0 else 0
            got.resumed = offset
            os.ftruncate(fd, offset)
            if bar is not None and offset:
                bar.update(offset)
            n = _fetch_rest(
                target, desc, fd, offset, h, final, partial if resumable else "", cancel, bar, got
            )
            actual = "sha256:" + h.hexdigest()
            if n == desc.size and actual == desc.digest:
                break
            if offset and attempt == 0:
                continue  # the kept prefix may be what is wrong (torn write): once more from zero
            if n != desc.size:
                raise SizeMismatchError(desc.digest, desc.size, n, source=target.name)
            raise DigestMismatchError(desc.digest, actual, what=f"blob for {final}", source=target.name)
        try:
            os.fsync(fd)
            os.fchmod(fd, 0o644)
            os.replace(partial, final)
            if dirs is None:
                fsync_dir(os.path.dirname(final))
            else:
                dirs.add(os.path.dirname(final), root=root)
        except OSError as exc:
            raise write_error(final, exc, kept=f"the verified download is kept in {partial}") from exc
    except BaseException as exc:
        if not (resumable and keeps_partial(exc)):
            try:
                os.unlink(partial)
            except FileNotFoundError:
                pass
        raise
    finally:
        os.close(fd)
    return got


def _fetch_rest(
    target: ReadableTarget,
    desc: Descriptor,
    fd: int,
    offset: int,
    h: Any,
    final: str,
    partial: str,
    cancel: Cancel,
    bar: TransferBar | None,
    got: Downloaded,
) -> int:
    """Append the blob from ``offset`` to the partial; returns its length (one byte past the
    declared size counts: a source that sends more is lying about the size). ``partial`` is
    named in a full-disk error only when it is kept for a resume."""
    n = offset
    if n >= desc.size:
        return n
    os.lseek(fd, offset, os.SEEK_SET)
    writeback = Writeback(fd, offset)
    stream = CancellableReader(target.fetch_blob(desc, offset), cancel, bar)
    try:
        while n <= desc.size:
            chunk = stream.read(min(READ_CHUNK, desc.size - n + 1))
            if not chunk:
                break
            if n + len(chunk) > desc.size:
                return n + len(chunk)
            try:
                _write_all(fd, chunk)
            except OSError as exc:
                kept = "nothing was written at the final path"
                if partial:
                    have = os.fstat(fd).st_size
                    kept = f"the {have} bytes downloaded so far are kept in {partial}; free space and pull again to resume"
                raise write_error(final, exc, kept=kept) from exc
            writeback.wrote(len(chunk))
            h.update(chunk)
            n += len(chunk)
            got.fetched += len(chunk)
    finally:
        stream.close()
    return n


__all__ = ["Cancel", "CancellableReader", "Downloaded", "download_raw", "keeps_partial"]
