"""Blob uploads to a registry repository: one PUT when small, else resumable PATCH chunks.

Blobs up to ``monolithic_max`` go in one streamed PUT; larger ones in PATCH chunks of
``chunk_size`` with ``Content-Range``. After each acknowledged chunk the upload's location and
offset are saved (``upload_state_dir``), so a push killed midway asks the registry where the
session stands (GET upload status, ``Range`` header) and continues from there. The bytes already
sent are re-read and hashed locally (never re-sent), so the client still verifies every byte of
the blob it commits. A session the registry no longer knows (or that it cancelled: distribution
2.8 cancels one whose stored size disagrees with the last acknowledged offset, which happens when
a PATCH was cut mid-body) restarts that blob from zero.

Within one run the same holds for every interruption, none of which fails the push while the
retry budget (``--retry-for``, one per command) lasts:

- a POST, PATCH or PUT that dies with the connection, or is answered "not now" (408, 429 with its
  ``Retry-After`` honoured, 502/503/504, and a 500 up to four times per blob) is not blindly
  re-sent, since it is not idempotent: the uploader asks the registry whether the blob is already
  committed (the answer to a final PUT can be lost after it landed), else where the session
  stands, and continues from that offset;
- a session the registry lost between two requests (``404 BLOB_UPLOAD_UNKNOWN``: restarted with
  its ``_uploads`` purged; ``BLOB_UPLOAD_INVALID``: restarted with a new ``http.secret``, or a
  replica that does not share it) restarts that blob in a new session, at most
  ``MAX_SESSION_RESTARTS`` times, after which the error says why sessions keep vanishing.

Every acknowledged chunk is progress: it ends the outage on the budget's clock.
"""

from __future__ import annotations

import contextlib
import logging
import re
from dataclasses import dataclass
from urllib.parse import urlencode

import requests

from modelpack.errors import (
    DigestMismatchError,
    RegistryConnectionError,
    RegistryError,
    RegistryTLSError,
    SizeMismatchError,
    UploadError,
)
from modelpack.oci.descriptor import Descriptor
from modelpack.oci.digest import VerifyingReader
from modelpack.targets.base import BlobSource
from modelpack.targets.registry.client import MAX_500_RETRIES, RETRY_STATUSES, RegistryClient
from modelpack.targets.registry.repository import RepositoryAPI
from modelpack.targets.registry.upload_bodies import (
    BodySlice,
    SizeCheckedReader,
    UploadReader,
    reader_complete,
)
from modelpack.targets.registry.upload_state import UploadState
from modelpack.targets.retry import RetryBudget

log = logging.getLogger("modelpack.targets.registry")

DEFAULT_CHUNK_SIZE = 64 * 1024 * 1024
DEFAULT_MONOLITHIC_MAX = 64 * 1024 * 1024
_RANGE_RE = re.compile(r"^(?:bytes=)?0-(\d+)$")
#: the registry no longer knows the session (purged uploads, a new http.secret, another replica)
SESSION_LOST_CODES = frozenset({"BLOB_UPLOAD_UNKNOWN", "BLOB_UPLOAD_INVALID"})
#: new sessions one blob may start after losing one, within one run
MAX_SESSION_RESTARTS = 3
#: answers to upload requests this module reads itself (the client would raise on them)
_HANDLED_STATUSES = (400, 404, 408, 429, 500, 502, 503, 504)


@dataclass
class _Attempt:
    """Where one try at a blob stands: the session, the bytes the registry acknowledged, and
    whether the final PUT was sent (its answer may be lost while the blob is committed)."""

    location: str | None
    offset: int = 0
    committing: bool = False


class _Interrupted(Exception):
    """An upload request the registry answered with "not now" (``retry_after`` its hint) or with
    "no such session" (``lost``); ``error`` is what the command reports if the retries run out."""

    def __init__(self, error: RegistryError, *, lost: bool = False, retry_after: float | None = None) -> None:
        super().__init__(str(error))
        self.error = error
        self.lost = lost
        self.retry_after = retry_after


def _transient(exc: RegistryError) -> bool:
    """A cut or a "not now" from the registry (worth asking where the upload stands), as opposed
    to a refusal (bad digest, denied, TLS)."""
    if isinstance(exc, RegistryTLSError):
        return False
    if isinstance(exc, RegistryConnectionError):
        return True
    return type(exc) is RegistryError and exc.status in RETRY_STATUSES


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
        self._state = UploadState(repo.name, upload_state_dir)

    def start(self) -> str:
        """Open an upload session (a POST, never retried); its absolute location."""
        resp = self._request(
            "POST",
            self._repo.path("blobs/uploads"),
            ok=(202,),
            what=f"start upload to {self._repo.name}",
            in_session=False,
        )
        location = resp.headers.get("Location")
        if not location:
            raise UploadError("upload started without a Location", status=202, target=self._repo.name)
        return self._repo.client.resolve_location(location)

    def upload_status(self, location: str, budget: RetryBudget | None = None) -> tuple[str, int] | None:
        """Ask the registry how much of an upload session it holds: (location, next offset);
        None when it no longer knows the session."""
        resp = self._repo.client.request(
            "GET",
            location,
            scopes=self._repo.scopes(push=True),
            ok=(204,),
            allow=(200, 400, 404, 416),
            what="upload status",
            budget=budget,
        )
        resp.close()
        if resp.status_code not in (200, 204):
            return None
        m = _RANGE_RE.match(resp.headers.get("Range", "").strip())
        # distribution writes "0-0" for an empty session (and for one byte): read it as empty
        offset = int(m.group(1)) + 1 if m and int(m.group(1)) > 0 else 0
        new_location = resp.headers.get("Location")
        return (self._repo.client.resolve_location(new_location) if new_location else location), offset

    def upload(self, source: BlobSource) -> None:
        """Store ``source``'s blob, resuming a saved session of it when there is one."""
        if (
            source.descriptor.size <= self.monolithic_max
            and self._state.load(source.descriptor.digest) is None
        ):
            self._upload_retrying(source, persist=False)  # one PUT: nothing to save for later
            return
        with self._state.lock(source.descriptor.digest) as owned:
            self._upload_retrying(source, owned)

    def _upload_retrying(self, source: BlobSource, persist: bool) -> None:
        """Send the blob; after a cut (a registry restart, a dropped connection, a proxy's 503)
        ask the registry where the session stands and continue from there, or restart only this
        blob when the session is gone, until the retry budget is spent."""
        desc = source.descriptor
        session = self._saved_session(desc) if persist else None
        budget = self._repo.client.budget()
        restarts = errors_500 = 0
        while True:
            attempt = _Attempt(*(session or (None, 0)))
            lost = False
            try:
                self._send(source, attempt, persist, budget)
                return
            except _Interrupted as exc:
                if exc.lost:
                    lost = True
                    restarts += 1
                    if restarts > MAX_SESSION_RESTARTS:
                        raise self._sessions_vanish(desc, restarts, exc.error) from None
                else:
                    errors_500 += exc.error.status == 500
                    if errors_500 > MAX_500_RETRIES or not budget.wait(exc.retry_after):
                        raise self._gave_up(exc.error, budget) from None
            except RegistryError as exc:
                if not _transient(exc) or not budget.wait():
                    raise
            self._repo.count("upload_retries")
            self._repo.client.count_retry()
            log.debug(
                "upload of %s cut at byte %d (%s); asking the registry where it stands",
                desc.digest,
                attempt.offset,
                "committing" if attempt.committing else "sending",
            )
            if self._committed(desc, budget):
                self._state.drop(desc.digest)
                return  # the commit landed; only its answer was lost
            if lost:
                log.debug("registry lost the upload session of %s; restarting that blob", desc.digest)
                self._state.drop(desc.digest)
                session = None
                continue
            session = self.upload_status(attempt.location, budget) if attempt.location else None
            if session is not None and session[1] > desc.size:
                session = None
            if session is None:
                log.debug("upload session of %s is gone; restarting that blob", desc.digest)

    def _gave_up(self, error: RegistryError, budget: RetryBudget) -> RegistryError:
        """``error`` saying how long it was retried (a status the budget ran out on)."""
        if not (budget.retries or budget.exhausted):
            return error
        spent = type(error)(f"{error} (retried for {budget.spent_s:.0f} s; --retry-for sets how long)")
        spent.status, spent.code, spent.target = error.status, error.code, error.target
        return spent

    def _sessions_vanish(self, desc: Descriptor, restarts: int, error: RegistryError) -> UploadError:
        return UploadError(
            f"the registry lost the upload session of {desc.digest} {restarts} times in this push "
            f"({error}); a registry restarted with its uploads purged, or replicas behind one "
            "address that do not share http.secret or storage",
            target=self._repo.name,
        )

    def _request(
        self,
        method: str,
        url: str,
        *,
        ok: tuple[int, ...],
        what: str,
        headers: dict[str, str] | None = None,
        body: object = None,
        in_session: bool = True,
    ) -> requests.Response:
        """One upload request; a "not now" or a lost session is raised as ``_Interrupted`` (the
        retry loop decides), any other refusal as the client's typed error."""
        resp = self._repo.client.request(
            method,
            url,
            scopes=self._repo.scopes(push=True),
            headers=headers,
            body=body,
            ok=ok,
            allow=tuple(s for s in _HANDLED_STATUSES if s not in ok),
            what=what,
        )
        if resp.status_code in ok:
            return resp
        retry_after = RegistryClient._retry_after(resp)
        error = self._repo.client.error_for(resp, what)
        if in_session and (resp.status_code == 404 or error.code in SESSION_LOST_CODES):
            raise _Interrupted(error, lost=True)
        if resp.status_code in RETRY_STATUSES or resp.status_code == 500:
            raise _Interrupted(error, retry_after=retry_after)
        raise error

    def _saved_session(self, desc: Descriptor) -> tuple[str, int] | None:
        """The session a killed push saved for this blob, if the registry still holds exactly the
        bytes it acknowledged (anything else restarts the blob)."""
        saved = self._state.load(desc.digest)
        if saved is None:
            return None
        status = self.upload_status(saved[0])
        self._state.drop(desc.digest)
        if status is not None and status[1] == saved[1] and status[1] <= desc.size:
            log.debug("resuming upload of %s at offset %d", desc.digest, status[1])
            self._repo.count("resumed")
            return status
        log.debug("saved upload of %s is gone or inconsistent; restarting it", desc.digest)
        return None

    def _committed(self, desc: Descriptor, budget: RetryBudget) -> bool:
        """Whether the registry has the whole blob (a HEAD, retried within ``budget``)."""
        try:
            resp = self._repo.client.request(
                "HEAD",
                self._repo.path("blobs", desc.digest),
                scopes=self._repo.scopes(push=True),
                allow=(404,),
                what=f"check {desc.digest} in {self._repo.name}",
                budget=budget,
            )
        except RegistryError as exc:
            if _transient(exc):
                return False
            raise
        resp.close()
        length = resp.headers.get("Content-Length", "")
        return resp.status_code == 200 and (not length.isdigit() or int(length) == desc.size)

    def _send(self, source: BlobSource, attempt: _Attempt, persist: bool, budget: RetryBudget) -> None:
        """One try at the blob from ``attempt``'s session and offset (a new session when it has
        none); ``attempt`` follows the location and offset the registry acknowledged."""
        desc = source.descriptor
        if attempt.location is None:
            attempt.location = self.start()
            attempt.offset = 0
        location: str = attempt.location
        offset = attempt.offset
        chunked = offset > 0 or desc.size > self.monolithic_max
        reader: UploadReader
        if source.verified and source.local_path:
            # the packer hashed this very file moments ago: check sizes, skip a second hash pass
            # (the registry hashes what it receives and refuses a commit that does not match)
            reader = SizeCheckedReader(source.open(offset), desc, offset, source.local_path)
        else:
            reader = VerifyingReader(
                source.open(0), desc.digest, desc.size, source=source.local_path or "upload source"
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
                attempt.committing = True
                self._put_monolithic(location, reader, desc)
                return
            while offset < desc.size:
                n = min(self.chunk_size, desc.size - offset)
                location = self._patch(location, reader, offset, n, desc)
                budget.progressed()  # an acknowledged chunk ends the outage on the clock
                offset += n
                attempt.location, attempt.offset = location, offset
                if persist:
                    self._state.save(desc.digest, location, offset)
            reader.read(1)  # end of stream: raises unless size and digest matched
            attempt.committing = True
            self._commit(location, desc)
            self._state.drop(desc.digest)
        except (SizeMismatchError, DigestMismatchError):
            # the source is not what the descriptor says: cancel the session, never commit
            self._state.drop(desc.digest)
            with contextlib.suppress(RegistryError):
                self._repo.client.request(
                    "DELETE", location, scopes=self._repo.scopes(push=True), ok=(204, 200), allow=(404,)
                )
            raise
        finally:
            reader.close()

    def _put_monolithic(self, location: str, reader: UploadReader, desc: Descriptor) -> None:
        url = _with_query(location, {"digest": str(desc.digest)})
        try:
            resp = self._request(
                "PUT",
                url,
                headers={"Content-Type": "application/octet-stream"},
                body=BodySlice(reader, desc.size, desc) if desc.size else b"",
                ok=(201,),
                what=f"upload {desc.digest} to {self._repo.name}",
            )
        except (RegistryError, _Interrupted):
            # the registry refuses bytes that do not hash to the digest (DIGEST_INVALID); if that
            # was our source's fault, say so with the digest and the file at fault
            if reader_complete(reader, desc.size):
                reader.read(1)
            raise
        reader.read(1)  # raises if the stream did not hash to the digest (registry checks too)
        self._check_committed(resp, desc)
        self._repo.count("bytes_sent", desc.size)

    def _patch(self, location: str, reader: UploadReader, offset: int, n: int, desc: Descriptor) -> str:
        resp = self._request(
            "PATCH",
            location,
            headers={
                "Content-Type": "application/octet-stream",
                "Content-Range": f"{offset}-{offset + n - 1}",
            },
            body=BodySlice(reader, n, desc),
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
        resp = self._request(
            "PUT",
            _with_query(location, {"digest": str(desc.digest)}),
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


def _with_query(url: str, params: dict[str, str]) -> str:
    sep = "&" if "?" in url else "?"
    return url + sep + urlencode(params)
