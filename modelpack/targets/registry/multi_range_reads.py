"""Many disjoint ranges of one registry blob in few requests (``MultiRangeFetcher``): the rows
of a column-split tensor-parallel share, one ``Range`` header of many ranges per request.

Unverified, like every range (``blob_reads``): the caller checks the bytes against the signed
column blocks. What is checked here is the framing of the ``206 multipart/byteranges`` answer
(``byteranges``: bounded, every part exactly the next range asked for), so one range's bytes never
land in another's place; a registry that ignores or coalesces the ranges is read correctly, and a
cut resumes from the byte reached with the same retry budget and silence bound as ``blob_reads``.
"""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Sequence

import requests

from modelpack import stopping
from modelpack.errors import RegistryError
from modelpack.oci.descriptor import Descriptor
from modelpack.targets.ranges import COVERING_BAND, Run, bands, plan_runs
from modelpack.targets.registry.blob_reads import (
    MAX_EMPTY_RESUMES,
    bound_silence,
    keep_alive,
    read_body,
    read_range_into,
    readinto_body,
    shutdown_socket,
    socket_of,
)
from modelpack.targets.registry.bodies import TRANSPORT_ERRORS, is_transport_error
from modelpack.targets.registry.byteranges import (
    BodyEnded,
    FramingError,
    PartReader,
    content_range,
    multipart_boundary,
)
from modelpack.targets.registry.repository import RepositoryAPI

log = logging.getLogger("modelpack.targets.registry")

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
            b = read_body(self._resp, 1, False)
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
        bound_silence(self.repo, resp)
        sock = socket_of(resp)
        with resp, stopping.abort_on_stop(functools.partial(shutdown_socket, sock)):
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
                n = readinto_body(resp, view[got:])
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
        keep_alive(resp)

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
                n = readinto_body(resp, scratch[: run.pos - cursor])
                if not n:
                    raise self._ended(resp, run, i, len(batch))
                cursor += n
                self.fetched += n
            self._receive(resp, run, i, len(batch))
            cursor = run.end
        if got[1] == last.end - 1:
            keep_alive(resp)

    def _read_bands(self, pending: Sequence[Run]) -> None:
        """The pending runs as covering contiguous reads (each resumed on its own)."""
        for band in bands(pending):
            stopping.check()
            read_range_into(self.repo, self.desc, band.offset, band.views)
            for run in band.runs:
                run.have = run.length
            self.fetched += band.length
