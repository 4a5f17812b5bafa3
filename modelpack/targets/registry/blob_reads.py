"""Blob downloads from a registry repository: a stream from an offset, or an exact range, each
resumed from the byte it reached when the connection is cut.

Neither is verified here: the consumer (copy engine, pull, node cache, loader) does, because a
registry serves a corrupted stored blob without noticing. What is checked is that the bytes
start where asked (a 206's ``Content-Range``), and that a registry without range support has its
prefix skipped here, so a resumed read never splices in the wrong bytes.

A cut (registry restarted, proxy or load balancer dropping the connection) is resumed with a
``Range`` request from the byte reached, within the client's retry budget, which starts afresh
whenever bytes flow again; so the consumer sees one uninterrupted stream and every byte crosses
the wire once. When the budget is spent, the consumer gets a ``RegistryConnectionError`` naming
the registry, the blob and the byte reached, never a urllib3 traceback.

A connection that goes silent mid-body (a hung load balancer, a half-dead peer) is a cut too,
detected after ``silence_limit()`` seconds, not after the socket's read timeout (``--timeout``,
300 s by default): the limit follows the retry settings, half the retry budget, between 1 s and
30 s (and never more than ``--timeout``), so ``--retry-for 4s`` resumes a stalled blob after
2 s; with ``--retry-for 0`` there is no resume and the read timeout applies.

A read given a ``Floor`` (mirrors and peers) must also keep up a throughput: fewer than
``min_bps × window_s`` bytes in any window of ``window_s`` seconds is ``MirrorTooSlowError``, so a
source that trickles one byte a second (never silent long enough to be a stall) is abandoned
too. Such reads take what each ``recv`` delivers (``read1``) so the floor is checked as bytes
arrive. Every open response shuts its socket down on a stop request (``stopping``: SIGTERM in the
CLI), so no worker stays blocked in a read after the command was interrupted.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
import socket
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO

import requests

from modelpack import stopping
from modelpack.errors import MirrorTooSlowError, RegistryError, SizeMismatchError
from modelpack.oci.descriptor import Descriptor
from modelpack.targets.registry.bodies import TRANSPORT_ERRORS, is_transport_error
from modelpack.targets.registry.client import RegistryClient
from modelpack.targets.registry.repository import RepositoryAPI
from modelpack.targets.retry import DEFAULT_RETRY_FOR, RetryBudget

log = logging.getLogger("modelpack.targets.registry")

#: clean ends of stream (no error, no bytes) in a row before a short blob is called short
MAX_EMPTY_RESUMES = 3
_SKIP_CHUNK = 1 << 20
#: the longest a blob body may stay silent before it is resumed like a cut connection
MAX_SILENCE_S = 30.0


def silence_limit(client: RegistryClient) -> float:
    """Seconds without a byte after which a blob read is treated as cut (see the module doc)."""
    retry_for = DEFAULT_RETRY_FOR if client.retry_for is None else client.retry_for
    if retry_for <= 0:
        return client.timeout
    return min(client.timeout, MAX_SILENCE_S, max(1.0, retry_for / 2))


@dataclass(frozen=True)
class Floor:
    """The least a mirror must deliver: ``min_bps`` bytes per second over each ``window_s``."""

    min_bps: float
    window_s: float


class _Pace:
    """Counts bytes per window and raises once a whole window fell below the floor."""

    def __init__(self, floor: Floor, what: str) -> None:
        self.floor = floor
        self.what = what
        self.start = time.monotonic()
        self.got = 0

    def note(self, n: int, pos: int) -> None:
        self.got += n
        now = time.monotonic()
        elapsed = now - self.start
        if elapsed < self.floor.window_s:
            return
        if self.got < self.floor.min_bps * self.floor.window_s:
            raise MirrorTooSlowError(
                f"{self.what}: too slow, {self.got} bytes in {elapsed:.1f} s (floor "
                f"{self.floor.min_bps:.0f} B/s over {self.floor.window_s:g} s), at byte {pos}"
            )
        self.start, self.got = now, 0


def socket_of(resp: requests.Response) -> socket.socket | None:
    # the response's own socket (http.client keeps it on the body's reader; the connection
    # object lets go of it once the headers are read)
    reader = getattr(getattr(resp.raw, "_fp", None), "fp", None)
    sock = getattr(getattr(reader, "raw", None), "_sock", None)
    if sock is None:
        sock = getattr(getattr(resp.raw, "connection", None), "sock", None)
    return sock if isinstance(sock, socket.socket) else None


def shutdown_socket(sock: socket.socket | None) -> None:
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


def bound_silence(repo: RepositoryAPI, resp: requests.Response) -> requests.Response:
    """Make a streamed body's reads give up after ``silence_limit`` (a socket timeout, which the
    callers' transport-error handling resumes from the byte reached)."""
    sock = socket_of(resp)
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.settimeout(silence_limit(repo.client))
    return resp


def read_body(resp: requests.Response, n: int | None, paced: bool) -> bytes:
    """Up to ``n`` bytes of the body: all of them, or (paced) what the next ``recv`` brings."""
    if paced:
        data: bytes = resp.raw.read1(n, decode_content=False)
    else:
        data = resp.raw.read(n, decode_content=False)
    return data


class ResumingBlobStream:
    """A blob download as a binary stream that resumes itself after a cut; closing it releases
    the connection. ``resumes`` counts the ranged requests that continued it."""

    def __init__(
        self, repo: RepositoryAPI, descriptor: Descriptor, offset: int = 0, *, floor: Floor | None = None
    ) -> None:
        self._repo = repo
        self._desc = descriptor
        self._pos = offset
        self._budget = repo.client.budget()
        self._resp: requests.Response | None = None
        self._stop_hook: contextlib.ExitStack | None = None
        self._empty = 0
        self.resumes = 0
        self._pace = _Pace(floor, self._what()) if floor is not None else None
        self._resp = self._open()

    @property
    def position(self) -> int:
        return self._pos

    def _what(self) -> str:
        return f"blob {self._desc.digest} from {self._repo.name}"

    def _open(self) -> requests.Response:
        stopping.check()
        try:
            resp = _open_at(self._repo, self._desc, self._pos, self._budget)
        except RegistryError as exc:
            if exc.status == 416 and self._pos:  # nothing after the byte reached: a short blob
                raise SizeMismatchError(
                    self._desc.digest, self._desc.size, self._pos, source=self._repo.name
                ) from None
            raise
        self._stop_hook = contextlib.ExitStack()
        sock = socket_of(resp)
        self._stop_hook.enter_context(stopping.abort_on_stop(functools.partial(shutdown_socket, sock)))
        return resp

    def read(self, n: int = -1) -> bytes:
        want = None if n is None or n < 0 else n
        if want == 0:
            return b""
        while True:
            if self._resp is None:
                self._resp = self._open()
            try:
                data = read_body(self._resp, want, self._pace is not None)
            except TRANSPORT_ERRORS as exc:
                if not is_transport_error(exc):
                    raise
                self._cut(exc)
                continue
            if self._pace is not None:
                self._pace.note(len(data), self._pos + len(data))
            if data:
                self._pos += len(data)
                self._empty = 0
                self._budget.progressed()
                return data
            if self._pos >= self._desc.size or "Content-Length" in self._resp.headers:
                # the end, or all the registry says there is (a body that ends before its
                # declared length raises instead): the consumer's size check reports a short blob
                return b""
            # a close-delimited body that ended early: a cut nobody could tell from the end
            self._empty += 1
            if self._empty > MAX_EMPTY_RESUMES:
                raise SizeMismatchError(self._desc.digest, self._desc.size, self._pos, source=self._repo.name)
            self._cut(None)

    def _cut(self, exc: BaseException | None) -> None:
        """Drop the broken response and wait for the next attempt (raise when out of budget)."""
        self._release()
        stopping.check()
        reason = type(exc).__name__ if exc is not None else "end of stream"
        log.debug("%s: cut at byte %d (%s); resuming", self._what(), self._pos, reason)
        if not self._budget.wait():
            raise self._repo.client.connection_error(
                f"{self._what()} at byte {self._pos} of {self._desc.size}", exc, self._budget
            )
        self._repo.client.count_retry()
        self._repo.count("read_resumes")
        self.resumes += 1

    def readinto(self, buf: Any) -> int:
        view = memoryview(buf).cast("B")
        data = self.read(len(view))
        view[: len(data)] = data
        return len(data)

    def readable(self) -> bool:
        return True

    def _release(self) -> None:
        if self._stop_hook is not None:
            self._stop_hook.close()
            self._stop_hook = None
        if self._resp is not None:
            try:
                self._resp.close()
            except Exception:
                pass
            self._resp = None

    def close(self) -> None:
        self._release()

    def __enter__(self) -> ResumingBlobStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _open_at(
    repo: RepositoryAPI, descriptor: Descriptor, offset: int, budget: RetryBudget
) -> requests.Response:
    """A response whose body starts at ``offset`` (a 206 checked, or a 200 with the prefix read
    past); connection failures while skipping count as cuts of the caller's budget."""
    while True:
        headers = {"Range": f"bytes={offset}-"} if offset else {}
        resp = repo.client.request(
            "GET",
            repo.path("blobs", descriptor.digest),
            scopes=repo.scopes(),
            headers=headers,
            stream=True,
            ok=(200, 206),
            what=f"blob {descriptor.digest} from {repo.name}",
            budget=budget,
        )
        bound_silence(repo, resp)
        if resp.status_code == 206:
            _check_content_range(repo, resp, descriptor, offset)
            return resp
        if not offset:
            return resp
        # no range support: skip the prefix ourselves (bounded reads)
        left = offset
        try:
            while left:
                data = resp.raw.read(min(left, _SKIP_CHUNK), decode_content=False)
                if not data:
                    resp.close()
                    raise SizeMismatchError(
                        descriptor.digest, descriptor.size, offset - left, source=repo.name
                    )
                left -= len(data)
        except TRANSPORT_ERRORS as exc:
            resp.close()
            if not is_transport_error(exc):
                raise
            if not budget.wait():
                raise repo.client.connection_error(
                    f"blob {descriptor.digest} from {repo.name} at byte {offset}", exc, budget
                ) from None
            continue
        return resp


def open_blob(repo: RepositoryAPI, descriptor: Descriptor, offset: int = 0) -> BinaryIO:
    """The blob from ``offset`` as a stream that resumes after a cut; closing it releases the
    connection."""
    return ResumingBlobStream(repo, descriptor, offset)  # type: ignore[return-value]


def read_range(
    repo: RepositoryAPI, descriptor: Descriptor, offset: int, length: int, *, floor: Floor | None = None
) -> bytes:
    """Exactly ``length`` bytes at ``offset`` (a registry that ignores ``Range`` is skipped
    through); a cut range is continued from the byte it reached. With a ``floor``, a source that
    delivers less than it is ``MirrorTooSlowError``."""
    pace = _Pace(floor, _range_what(repo, descriptor, offset, length)) if floor is not None else None
    sink = _BytesSink(offset, length, pace)
    _fetch_range(repo, descriptor, offset, length, sink)
    return sink.result()


def read_range_into(
    repo: RepositoryAPI, descriptor: Descriptor, offset: int, views: Sequence[memoryview]
) -> None:
    """``read_range`` into caller memory: the range at ``offset`` fills ``views`` one after the
    other (their lengths add up to the range), received straight into them, no intermediate
    ``bytes``. A cut range is continued from the byte it reached, as ``read_range`` does."""
    _fetch_range(repo, descriptor, offset, sum(len(v) for v in views), _ViewSink(views))


def _range_what(repo: RepositoryAPI, descriptor: Descriptor, offset: int, length: int) -> str:
    return f"range {offset}+{length} of blob {descriptor.digest} from {repo.name}"


class _BytesSink:
    """``read_range``'s destination: the body's bytes as they come (one part unless the range
    was cut: then joined once at the end), each read paced when a floor was given."""

    def __init__(self, offset: int, length: int, pace: _Pace | None) -> None:
        self.offset = offset
        self.length = length
        self.pace = pace
        self.parts: list[bytes] = []
        self.have = 0

    def fill(self, resp: requests.Response) -> None:
        """Read until the range is complete or the body ends; a cut raises after ``have``
        counted what arrived first."""
        while self.have < self.length:
            data = read_body(resp, self.length - self.have, self.pace is not None)
            if self.pace is not None:
                self.pace.note(len(data), self.offset + self.have + len(data))
            if not data:
                break
            self.parts.append(data)
            self.have += len(data)

    def result(self) -> bytes:
        return self.parts[0] if len(self.parts) == 1 else b"".join(self.parts)


class _ViewSink:
    """``read_range_into``'s destination: caller memory, received into straight from the socket."""

    def __init__(self, views: Sequence[memoryview]) -> None:
        self.views = views
        self.length = sum(len(v) for v in views)
        self.have = 0

    def fill(self, resp: requests.Response) -> None:
        """Fill the views from byte ``have`` on until they are full or the body ends; once full,
        the connection goes back to the pool (``keep_alive``)."""
        for view in _remaining(self.views, self.have):
            got = 0
            while got < len(view):
                n = readinto_body(resp, view[got:])
                if not n:
                    break
                got += n
                self.have += n
            if got < len(view):
                break
        if self.have == self.length:
            keep_alive(resp)


def _fetch_range(
    repo: RepositoryAPI,
    descriptor: Descriptor,
    offset: int,
    length: int,
    sink: _BytesSink | _ViewSink,
) -> None:
    """The one range loop under ``read_range`` and ``read_range_into``: request the rest of the
    range from the byte ``sink`` reached, check where the body starts (a 206's ``Content-Range``,
    a 200's prefix skipped), let ``sink`` take the bytes, and resume a cut within the client's
    retry budget, which starts afresh whenever bytes flowed. Exactly ``length`` bytes, else
    ``SizeMismatchError``."""
    if length <= 0:
        return
    if offset < 0 or offset + length > descriptor.size:
        raise SizeMismatchError(descriptor.digest, descriptor.size, offset + length, source=repo.name)
    budget = repo.client.budget()
    what = _range_what(repo, descriptor, offset, length)
    while sink.have < length:
        stopping.check()
        start = offset + sink.have
        resp = repo.client.request(
            "GET",
            repo.path("blobs", descriptor.digest),
            scopes=repo.scopes(),
            headers={"Range": f"bytes={start}-{offset + length - 1}"},
            stream=True,
            ok=(206,),
            allow=(200, 416),
            what=what,
            budget=budget,
        )
        bound_silence(repo, resp)
        sock = socket_of(resp)
        try:
            with resp, stopping.abort_on_stop(functools.partial(shutdown_socket, sock)):
                if resp.status_code == 416:
                    # distribution 2.8's 416 carries a wrong Content-Length: never read its body
                    raise RegistryError(f"{what} not satisfiable", status=416, target=repo.name)
                if resp.status_code == 206:
                    _check_content_range(repo, resp, descriptor, start)
                else:
                    _skip(resp, start)
                before = sink.have
                sink.fill(resp)  # a cut keeps what arrived first, then raises on the next read
                if sink.have == before:
                    break  # the registry has no more bytes: the size check below says so
                budget.progressed()
        except TRANSPORT_ERRORS as exc:
            if not is_transport_error(exc):
                raise
            log.debug("%s: cut at byte %d (%s); resuming", what, offset + sink.have, type(exc).__name__)
            stopping.check()
            if not budget.wait():
                raise repo.client.connection_error(what, exc, budget) from None
            repo.client.count_retry()
            repo.count("read_resumes")
    if sink.have != length:
        raise SizeMismatchError(descriptor.digest, length, sink.have, source=f"{repo.name} range {offset}")


def keep_alive(resp: requests.Response) -> None:
    """Hand the connection back to the pool once http.client has read the body to its end (the
    bytes went past urllib3, which would otherwise close it): the next range reuses it."""
    fp = getattr(resp.raw, "_fp", None)
    isclosed = getattr(fp, "isclosed", None)
    if isclosed is not None and isclosed():
        resp.raw.release_conn()


def _remaining(views: Sequence[memoryview], skip: int) -> Iterator[memoryview]:
    """``views`` past their first ``skip`` bytes (where a resumed range continues)."""
    for view in views:
        if skip >= len(view):
            skip -= len(view)
            continue
        yield view[skip:] if skip else view
        skip = 0


def readinto_body(resp: requests.Response, view: memoryview) -> int:
    """Receive body bytes straight into ``view`` (http.client's ``readinto`` under urllib3: the
    socket's ``recv_into``); a response without that reader is read and copied."""
    fp = getattr(resp.raw, "_fp", None)
    readinto = getattr(fp, "readinto", None)
    if readinto is not None and not getattr(resp.raw, "_has_decoded_content", False):
        n = readinto(view)
        return int(n or 0)
    data = read_body(resp, len(view), False)
    view[: len(data)] = data
    return len(data)


def _skip(resp: requests.Response, n: int) -> None:
    """Read past the first ``n`` bytes of a 200 (a registry that ignored ``Range``)."""
    left = n
    while left:
        chunk = resp.raw.read(min(left, _SKIP_CHUNK), decode_content=False)
        if not chunk:
            return
        left -= len(chunk)


def _check_content_range(
    repo: RepositoryAPI, resp: requests.Response, descriptor: Descriptor, offset: int
) -> None:
    """A 206 must start where we asked; anything else would splice the wrong bytes in."""
    m = re.match(r"^bytes (\d+)-(\d+)/(\d+|\*)$", resp.headers.get("Content-Range", "").strip())
    if not m or int(m.group(1)) != offset:
        resp.close()
        raise RegistryError(
            f"blob {descriptor.digest}: asked for bytes from {offset}, got Content-Range "
            f"{resp.headers.get('Content-Range')!r}",
            status=206,
            target=repo.name,
        )
