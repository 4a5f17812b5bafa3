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
import itertools
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
from modelpack.targets.ranges import COVERING_BAND, Run, bands, plan_runs
from modelpack.targets.registry.bodies import TRANSPORT_ERRORS, is_transport_error
from modelpack.targets.registry.byteranges import (
    BodyEnded,
    FramingError,
    PartReader,
    content_range,
    multipart_boundary,
)
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


def _socket_of(resp: requests.Response) -> socket.socket | None:
    # the response's own socket (http.client keeps it on the body's reader; the connection
    # object lets go of it once the headers are read)
    reader = getattr(getattr(resp.raw, "_fp", None), "fp", None)
    sock = getattr(getattr(reader, "raw", None), "_sock", None)
    if sock is None:
        sock = getattr(getattr(resp.raw, "connection", None), "sock", None)
    return sock if isinstance(sock, socket.socket) else None


def _shutdown(sock: socket.socket | None) -> None:
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


def _bound_silence(repo: RepositoryAPI, resp: requests.Response) -> requests.Response:
    """Make a streamed body's reads give up after ``silence_limit`` (a socket timeout, which the
    callers' transport-error handling resumes from the byte reached)."""
    sock = _socket_of(resp)
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.settimeout(silence_limit(repo.client))
    return resp


def _read(resp: requests.Response, n: int | None, paced: bool) -> bytes:
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
        sock = _socket_of(resp)
        self._stop_hook.enter_context(stopping.abort_on_stop(functools.partial(_shutdown, sock)))
        return resp

    def read(self, n: int = -1) -> bytes:
        want = None if n is None or n < 0 else n
        if want == 0:
            return b""
        while True:
            if self._resp is None:
                self._resp = self._open()
            try:
                data = _read(self._resp, want, self._pace is not None)
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
        _bound_silence(repo, resp)
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
            data = _read(resp, self.length - self.have, self.pace is not None)
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
        the connection goes back to the pool (``_keep_alive``)."""
        for view in _remaining(self.views, self.have):
            got = 0
            while got < len(view):
                n = _readinto(resp, view[got:])
                if not n:
                    break
                got += n
                self.have += n
            if got < len(view):
                break
        if self.have == self.length:
            _keep_alive(resp)


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
        _bound_silence(repo, resp)
        sock = _socket_of(resp)
        try:
            with resp, stopping.abort_on_stop(functools.partial(_shutdown, sock)):
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


def _keep_alive(resp: requests.Response) -> None:
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


def _readinto(resp: requests.Response, view: memoryview) -> int:
    """Receive body bytes straight into ``view`` (http.client's ``readinto`` under urllib3: the
    socket's ``recv_into``); a response without that reader is read and copied."""
    fp = getattr(resp.raw, "_fp", None)
    readinto = getattr(fp, "readinto", None)
    if readinto is not None and not getattr(resp.raw, "_has_decoded_content", False):
        n = readinto(view)
        return int(n or 0)
    data = _read(resp, len(view), False)
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


# ---------------------------------------------------------------------- many ranges of one blob
#: the most ranges one multi-range request asks for
MAX_RANGES_PER_REQUEST = 1000
#: the most bytes of one request's ``Range`` header value (``bytes=a-b,c-d,...``): a proxy in
#: front of a registry refuses longer header lines (nginx: 8 KiB by default). Measured on loopback
#: against distribution 2.8 (16,384 ranges of 256 B, one per 4 KiB row of a 64 MiB blob): 12.0 s
#: with 1 KiB headers, 8.1-9.4 s from 4 KiB to 400 KiB (a single request), 160 s one range per
#: request; past a few KiB the registry's time per range dominates, not the requests
MAX_RANGE_HEADER_BYTES = 7 * 1024
#: bytes received into scratch memory per read when a covering answer's gaps are read past
_GAP_CHUNK = 1 << 20


def read_ranges_into(
    repo: RepositoryAPI,
    descriptor: Descriptor,
    ranges: Sequence[tuple[int, int]],
    views: Sequence[memoryview],
) -> int:
    """Fill ``views[i]`` with the ``ranges[i] = (offset, length)`` bytes of the blob, in few
    requests (``MultiRangeFetcher``). Adjacent ranges are joined; the rest are asked for in
    batches (``MAX_RANGES_PER_REQUEST``, ``MAX_RANGE_HEADER_BYTES``) with one multi-range
    ``Range`` header each, and each part of the ``206 multipart/byteranges`` answer is received
    straight into its views (``byteranges``: bounded framing, every part exactly the next range
    asked for, else ``RegistryError`` naming the blob and the range). A single-part ``206``
    covering the batch (a registry may coalesce) is read past its gaps; a ``200`` (the ``Range``
    ignored) is closed unread and the ranges are read as covering bands of at most
    ``ranges.COVERING_BAND`` bytes with ``read_range_into``. A cut resumes the ranges not yet
    complete, from the byte reached, within the client's retry budget. Unverified, like every
    range: the caller checks the bytes. Returns the bytes fetched: the ranges' lengths, plus
    whatever gaps a covering answer or band held."""
    runs = plan_runs(descriptor, ranges, views, source=repo.name)
    return _MultiRangeRead(repo, descriptor, runs).run()


class _Ended(Exception):
    """A multi-range answer's body ended early and was cut (resumed like a transport error)."""


def _next_batch(pending: Sequence[Run]) -> tuple[list[Run], str]:
    """The first runs of ``pending`` that fit one request, and its ``Range`` header value."""
    specs: list[str] = []
    size = len("bytes=")
    for run in pending:
        spec = f"{run.pos}-{run.end - 1}"
        if specs and (len(specs) >= MAX_RANGES_PER_REQUEST or size + 1 + len(spec) > MAX_RANGE_HEADER_BYTES):
            break
        specs.append(spec)
        size += len(spec) + 1
    return list(pending[: len(specs)]), "bytes=" + ",".join(specs)


class _Body:
    """A response body as ``byteranges`` reads its framing: bounded lines (http.client's own
    ``readline``, which keeps its count of the declared length)."""

    def __init__(self, resp: requests.Response) -> None:
        self._resp = resp
        fp = getattr(resp.raw, "_fp", None)
        self._readline = getattr(fp, "readline", None)

    def readline(self, limit: int) -> bytes:
        if self._readline is not None:
            return bytes(self._readline(limit))
        out = bytearray()
        while len(out) < limit:
            b = _read(self._resp, 1, False)
            if not b:
                break
            out += b
            if b == b"\n":
                break
        return bytes(out)


def _answer_ended_early(resp: requests.Response) -> bool:
    """Whether a body that ended (no transport error) was cut: its declared length not reached,
    or no declared end at all (close-delimited: a cut nobody can tell from the end). A chunked
    body's last chunk or a reached ``Content-Length`` is the registry's whole answer."""
    fp = getattr(resp.raw, "_fp", None)
    remaining = getattr(fp, "length", None)
    if isinstance(remaining, int) and remaining > 0:
        return True
    if getattr(fp, "chunked", False):
        return False
    return "Content-Length" not in resp.headers


class _MultiRangeRead:
    """One ``read_ranges_into``: the runs, the retry budget they share, the bytes fetched."""

    def __init__(self, repo: RepositoryAPI, descriptor: Descriptor, runs: list[Run]) -> None:
        self.repo = repo
        self.desc = descriptor
        self.runs = runs
        self.budget = repo.client.budget()
        self.fetched = 0
        #: the registry answered a multi-range request with the whole blob: bands from now on
        self.bands_only = False
        self.what = f"{len(runs)} ranges of blob {descriptor.digest} from {repo.name}"
        self._empty = 0

    def run(self) -> int:
        while True:
            pending = [r for r in self.runs if not r.done]
            if not pending:
                return self.fetched
            stopping.check()
            if self.bands_only:
                self._read_bands(pending)
                continue
            batch, header = _next_batch(pending)
            before = self.fetched
            try:
                self._request(batch, header)
            except TRANSPORT_ERRORS as exc:
                if not is_transport_error(exc):
                    raise
                self._cut(batch, exc, self.fetched > before)
            except _Ended:
                self._cut(batch, None, self.fetched > before)
            else:
                if self.fetched > before:
                    self.budget.progressed()

    def _cut(self, batch: Sequence[Run], exc: BaseException | None, progressed: bool) -> None:
        """Wait for the next attempt at the runs still incomplete (raise when out of budget)."""
        at = next((r for r in batch if not r.done), batch[0])
        if progressed:
            self.budget.progressed()
            self._empty = 0
        elif exc is None:
            self._empty += 1
            if self._empty > MAX_EMPTY_RESUMES:
                raise RegistryError(
                    f"{self._range(at)}: the registry's answers end before it, {self._empty} times",
                    status=206,
                    target=self.repo.name,
                )
        reason = type(exc).__name__ if exc is not None else "end of body"
        log.debug("%s: cut at byte %d (%s); resuming", self.what, at.pos, reason)
        stopping.check()
        if not self.budget.wait():
            raise self.repo.client.connection_error(
                f"{self.what} at byte {at.pos} of {self.desc.size}", exc, self.budget
            )
        self.repo.client.count_retry()
        self.repo.count("read_resumes")

    def _range(self, run: Run) -> str:
        return f"blob {self.desc.digest}: range {run.pos}-{run.end - 1}"

    def _request(self, batch: list[Run], header: str) -> None:
        resp = self.repo.client.request(
            "GET",
            self.repo.path("blobs", self.desc.digest),
            scopes=self.repo.scopes(),
            headers={"Range": header, "Accept-Encoding": "identity"},
            stream=True,
            ok=(206,),
            allow=(200, 416),
            what=self.what,
            budget=self.budget,
        )
        _bound_silence(self.repo, resp)
        sock = _socket_of(resp)
        with resp, stopping.abort_on_stop(functools.partial(_shutdown, sock)):
            if resp.status_code == 416:
                # distribution 2.8's 416 carries a wrong Content-Length: never read its body
                raise RegistryError(f"{self.what} not satisfiable", status=416, target=self.repo.name)
            if resp.status_code == 200:
                # the Range ignored: the whole blob follows; closed unread, read as bands instead
                log.debug("%s: the registry ignored a multi-range request; reading bands", self.what)
                self.bands_only = True
                return
            encoding = resp.headers.get("Content-Encoding", "").strip().lower()
            if encoding not in ("", "identity"):
                raise RegistryError(
                    f"{self._range(batch[0])}: a 206 encoded {encoding[:40]!r} (identity was asked for)",
                    status=206,
                    target=self.repo.name,
                )
            try:
                boundary = multipart_boundary(resp.headers.get("Content-Type", ""))
            except FramingError as exc:
                raise self._framing_error(batch[0], 0, len(batch), exc) from None
            if boundary is None:
                self._single_part(resp, batch)
            else:
                self._multipart(resp, batch, boundary)

    def _framing_error(self, run: Run, index: int, parts: int, exc: BaseException) -> RegistryError:
        return RegistryError(
            f"{self._range(run)} (part {index + 1} of {parts} asked for): the multipart answer has {exc}",
            status=206,
            target=self.repo.name,
        )

    def _ended(self, resp: requests.Response, run: Run, index: int, parts: int) -> Exception:
        """A body that ended where more was due: a cut (``_Ended``, resumed) or the registry's
        whole answer, short (``RegistryError``)."""
        if _answer_ended_early(resp):
            return _Ended()
        return RegistryError(
            f"{self._range(run)} (part {index + 1} of {parts} asked for): the registry's answer "
            "ends before it is complete",
            status=206,
            target=self.repo.name,
        )

    def _receive(self, resp: requests.Response, run: Run, index: int, parts: int) -> None:
        """Receive the rest of ``run`` straight into its views."""
        for view in run.pending_views():
            got = 0
            while got < len(view):
                n = _readinto(resp, view[got:])
                if not n:
                    raise self._ended(resp, run, index, parts)
                got += n
                run.have += n
                self.fetched += n

    def _multipart(self, resp: requests.Response, batch: list[Run], boundary: bytes) -> None:
        reader = PartReader(_Body(resp), boundary)
        for i, run in enumerate(batch):
            try:
                got = reader.next_part()
            except FramingError as exc:
                raise self._framing_error(run, i, len(batch), exc) from None
            except BodyEnded:
                raise self._ended(resp, run, i, len(batch)) from None
            want = (run.pos, run.end - 1, self.desc.size)
            if got != want:
                raise RegistryError(
                    f"{self._range(run)} (part {i + 1} of {len(batch)} asked for): the multipart "
                    f"answer's part is bytes {got[0]}-{got[1]}/{got[2]}, where bytes "
                    f"{want[0]}-{want[1]}/{want[2]} was due",
                    status=206,
                    target=self.repo.name,
                )
            self._receive(resp, run, i, len(batch))
        try:
            reader.end()
        except FramingError as exc:
            raise self._framing_error(batch[-1], len(batch) - 1, len(batch), exc) from None
        except BodyEnded:
            if not _answer_ended_early(resp):
                raise RegistryError(
                    f"{self._range(batch[-1])}: the multipart answer ends without its close delimiter",
                    status=206,
                    target=self.repo.name,
                ) from None
            return  # cut after the last part's bytes: every range asked for is in
        _keep_alive(resp)

    def _single_part(self, resp: requests.Response, batch: list[Run]) -> None:
        """A one-part 206: it must cover the whole batch (a registry may coalesce ranges); the
        gaps are read past into scratch memory, the ranges received into their views."""
        header = resp.headers.get("Content-Range", "")
        got = content_range(header)
        first, last = batch[0], batch[-1]
        if got is None or got[2] != self.desc.size or got[0] > first.pos or got[1] < last.end - 1:
            raise RegistryError(
                f"{self._range(first)}: asked for {len(batch)} ranges from byte {first.pos} to "
                f"{last.end - 1} of {self.desc.size}, got Content-Range {header[:100]!r}",
                status=206,
                target=self.repo.name,
            )
        if first.pos - got[0] > COVERING_BAND:
            log.debug("%s: a 206 from byte %d, far before the ranges; reading bands", self.what, got[0])
            self.bands_only = True
            return
        cursor = got[0]
        widest = max(b.pos - a.end for a, b in itertools.pairwise([Run(got[0], 0), *batch]))
        scratch = memoryview(bytearray(min(_GAP_CHUNK, widest)))
        for i, run in enumerate(batch):
            while cursor < run.pos:
                n = _readinto(resp, scratch[: run.pos - cursor])
                if not n:
                    raise self._ended(resp, run, i, len(batch))
                cursor += n
                self.fetched += n
            self._receive(resp, run, i, len(batch))
            cursor = run.end
        if got[1] == last.end - 1:
            _keep_alive(resp)

    def _read_bands(self, pending: Sequence[Run]) -> None:
        """The pending runs as covering contiguous reads (each resumed on its own)."""
        for band in bands(pending):
            stopping.check()
            read_range_into(self.repo, self.desc, band.offset, band.views)
            for run in band.runs:
                run.have = run.length
            self.fetched += band.length
