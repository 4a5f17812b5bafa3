"""A registry repository as a Target (OCI distribution spec v1.1, tested on distribution 2.8).

Uploads: HEAD first (skip what exists); blobs up to ``monolithic_max`` go in one streamed PUT;
larger ones in PATCH chunks of ``chunk_size`` with ``Content-Range``. After each acknowledged chunk
the upload's location and offset are saved (``upload_state_dir``), so a push killed midway asks
the registry where the session stands (GET upload status, ``Range`` header) and continues from
there. The bytes already sent are re-read and hashed locally (never re-sent), so the client still
verifies every byte of the blob it commits. A session the registry no longer knows (or that it
cancelled: distribution 2.8 cancels one whose stored size disagrees with the last acknowledged
offset, which happens when a PATCH was cut mid-body) restarts that blob from zero.

Reads: manifests are fetched with an ``Accept`` that names OCI and Docker types (2.8 refuses
OCI manifests otherwise), capped at 4 MiB and verified against the digest they resolved to.
Blob streams and ranges are *not* verified here: the consumer (copy engine, pull, loader) does,
because a registry serves a corrupted stored blob without noticing.

Referrers: the referrers API when the registry has it, else the ``sha256-<hex>`` tag-schema index,
which ``push_manifest`` maintains for manifests that carry a ``subject`` (as oras and cosign do;
like them, two concurrent writers of the same index can lose an entry).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any, BinaryIO
from urllib.parse import urlencode, urljoin, urlsplit

import requests

from modelpack.errors import (
    DigestMismatchError,
    ManifestError,
    ManifestTooLargeError,
    NotFoundError,
    RegistryError,
    RegistryNotFoundError,
    SizeMismatchError,
    UploadError,
)
from modelpack.files import atomic_write_bytes
from modelpack.mediatypes import (
    MEDIA_TYPE_DOCKER_MANIFEST,
    MEDIA_TYPE_DOCKER_MANIFEST_LIST,
    MEDIA_TYPE_OCI_INDEX,
    MEDIA_TYPE_OCI_MANIFEST,
)
from modelpack.oci.descriptor import MAX_MANIFEST_BYTES, Descriptor, Index, Manifest, parse_manifest_or_index
from modelpack.oci.digest import Digest, VerifyingReader, verify_bytes
from modelpack.oci.reference import Reference, validate_tag
from modelpack.targets.base import BlobSource
from modelpack.targets.registry.auth import resolve_credentials
from modelpack.targets.registry.client import RegistryClient

log = logging.getLogger("modelpack.targets.registry")

MANIFEST_ACCEPT = ", ".join(
    [
        MEDIA_TYPE_OCI_MANIFEST,
        MEDIA_TYPE_OCI_INDEX,
        MEDIA_TYPE_DOCKER_MANIFEST,
        MEDIA_TYPE_DOCKER_MANIFEST_LIST,
    ]
)
MANIFEST_TYPES = frozenset(MANIFEST_ACCEPT.split(", "))
DEFAULT_CHUNK_SIZE = 64 * 1024 * 1024
DEFAULT_MONOLITHIC_MAX = 64 * 1024 * 1024
MAX_TAGS_PAGE_BYTES = 16 * 1024 * 1024
_LINK_RE = re.compile(r"<([^>]+)>\s*;\s*rel=\"?next\"?")
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


class _ResponseStream:
    """A blob download as a binary stream; closing it releases the connection."""

    def __init__(self, response: requests.Response) -> None:
        self._resp = response
        self._raw = response.raw

    def read(self, n: int = -1) -> bytes:
        data: bytes = self._raw.read(None if n is None or n < 0 else n, decode_content=False)
        return data

    def readinto(self, buf: Any) -> int:
        data = self.read(len(buf))
        buf[: len(data)] = data
        return len(data)

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        self._resp.close()

    def __enter__(self) -> _ResponseStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RegistryTarget:
    """One repository on one registry. ``name`` is ``host/repository`` (never credentials)."""

    def __init__(
        self,
        client: RegistryClient,
        repository: str,
        *,
        for_write: bool = False,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        monolithic_max: int = DEFAULT_MONOLITHIC_MAX,
        upload_state_dir: str | None = None,
    ) -> None:
        self.client = client
        self.repository = repository
        self.name = f"{client.host}/{repository}"
        self.chunk_size = chunk_size
        self.monolithic_max = monolithic_max
        self._write = for_write
        self._state_dir = os.path.join(
            upload_state_dir or _upload_state_root(),
            hashlib.sha256(self.name.encode()).hexdigest()[:32],
        )
        self._manifest_cache: OrderedDict[str, tuple[bytes, str]] = OrderedDict()
        self._cache_lock = threading.Lock()
        self._referrers_api: bool | None = None
        self.stats = {"uploaded": 0, "mounted": 0, "skipped": 0, "resumed": 0, "bytes_sent": 0}
        self._stats_lock = threading.Lock()

    @classmethod
    def from_reference(
        cls, ref: Reference, options: Any = None, *, for_write: bool = False
    ) -> RegistryTarget:
        """Open ``ref``'s repository. ``options`` is a ``TargetOptions`` (connection, credentials;
        ``extra`` may set ``chunk_size``, ``monolithic_max``, ``upload_state_dir``)."""
        if ref.scheme != "registry":
            raise RegistryError(f"{ref} is not a registry reference")
        opts = options
        username = getattr(opts, "username", None)
        password = getattr(opts, "password", None)
        creds = resolve_credentials(ref.location, username, password)
        client = RegistryClient(
            ref.location,
            plain_http=bool(getattr(opts, "plain_http", False)),
            ca_file=getattr(opts, "ca_file", None),
            insecure_skip_verify=bool(getattr(opts, "insecure_skip_verify", False)),
            credentials=creds,
        )
        extra = dict(getattr(opts, "extra", None) or {})
        chunk_size = int(extra.get("chunk_size") or DEFAULT_CHUNK_SIZE)
        if chunk_size <= 0:
            raise UploadError(f"chunk size must be positive, got {chunk_size}")
        return cls(
            client,
            ref.repository,
            for_write=for_write or bool(extra.get("for_write", False)),
            chunk_size=chunk_size,
            # an explicit chunk size also lowers the single-PUT limit: larger blobs are chunked
            monolithic_max=int(extra.get("monolithic_max") or min(DEFAULT_MONOLITHIC_MAX, chunk_size)),
            upload_state_dir=extra.get("upload_state_dir"),
        )

    # ------------------------------------------------------------------ scopes
    def _scopes(self, *, push: bool = False) -> tuple[str, ...]:
        """``pull`` until the first write (or when opened for writing), then ``pull,push`` for
        everything, so one token serves the whole push and a pull-only token gets upgraded."""
        if push:
            self._write = True
        actions = "pull,push" if self._write else "pull"
        return (f"repository:{self.repository}:{actions}",)

    def _path(self, kind: str, ref: str = "") -> str:
        return f"/v2/{self.repository}/{kind}/{ref}" if ref else f"/v2/{self.repository}/{kind}/"

    def _count(self, key: str, n: int = 1) -> None:
        with self._stats_lock:
            self.stats[key] += n

    # ------------------------------------------------------------------ manifests (read)
    def _cache_put(self, digest: str, raw: bytes, media_type: str) -> None:
        with self._cache_lock:
            self._manifest_cache[digest] = (raw, media_type)
            self._manifest_cache.move_to_end(digest)
            while sum(len(v[0]) for v in self._manifest_cache.values()) > 16 * MAX_MANIFEST_BYTES:
                self._manifest_cache.popitem(last=False)

    def _cache_get(self, digest: str) -> tuple[bytes, str] | None:
        with self._cache_lock:
            return self._manifest_cache.get(digest)

    def _get_manifest(self, reference: str) -> tuple[bytes, str, Digest]:
        """GET a manifest by tag or digest; bounded, and verified when addressed by digest."""
        is_digest = reference.startswith("sha256:")
        if is_digest:
            Digest(reference)
            cached = self._cache_get(reference)
            if cached is not None:
                return cached[0], cached[1], Digest(reference)
        else:
            validate_tag(reference)
        resp = self.client.request(
            "GET",
            self._path("manifests", reference),
            scopes=self._scopes(),
            headers={"Accept": MANIFEST_ACCEPT},
            stream=True,
            what=f"manifest {self.name}:{reference}"
            if not is_digest
            else f"manifest {self.name}@{reference}",
        )
        with resp:
            declared = resp.headers.get("Content-Length")
            if declared and declared.isdigit() and int(declared) > MAX_MANIFEST_BYTES:
                raise ManifestError(
                    f"{self.name} {reference}: manifest is {declared} bytes; the limit is 4 MiB"
                )
            raw = resp.raw.read(MAX_MANIFEST_BYTES + 1, decode_content=True)
            media_type = (resp.headers.get("Content-Type") or "").split(";")[0].strip()
            header_digest = resp.headers.get("Docker-Content-Digest")
        if len(raw) > MAX_MANIFEST_BYTES:
            raise ManifestError(f"{self.name} {reference}: manifest larger than 4 MiB")
        actual = Digest.from_bytes(raw)
        if is_digest:
            verify_bytes(raw, reference, None, what="manifest", source=self.name)
        elif header_digest and header_digest != actual:
            raise ManifestError(
                f"{self.name}:{reference}: registry says {header_digest} but the bytes hash to {actual}"
            )
        if media_type not in MANIFEST_TYPES:
            try:
                doc = json.loads(raw)
                media_type = doc.get("mediaType") or ""
            except ValueError:
                media_type = ""
            if media_type not in MANIFEST_TYPES:
                media_type = MEDIA_TYPE_OCI_MANIFEST
        self._cache_put(actual, raw, media_type)
        return raw, media_type, actual

    def resolve(self, reference: str) -> Descriptor:
        raw, media_type, digest = self._get_manifest(reference)
        parsed = parse_manifest_or_index(raw, media_type)
        artifact_type = parsed.artifact_type
        if artifact_type is None and isinstance(parsed, Manifest):
            artifact_type = parsed.config.media_type
        return Descriptor(media_type, digest, len(raw), artifact_type=artifact_type)

    def fetch_manifest(self, reference: str) -> tuple[bytes, str]:
        raw, media_type, _ = self._get_manifest(reference)
        return raw, media_type

    # ------------------------------------------------------------------ blobs (read)
    def fetch_blob(self, descriptor: Descriptor, offset: int = 0) -> BinaryIO:
        headers = {"Range": f"bytes={offset}-"} if offset else {}
        resp = self.client.request(
            "GET",
            self._path("blobs", descriptor.digest),
            scopes=self._scopes(),
            headers=headers,
            stream=True,
            ok=(200, 206),
            what=f"blob {descriptor.digest} from {self.name}",
        )
        if resp.status_code == 206:
            self._check_content_range(resp, descriptor, offset)
        if offset and resp.status_code == 200:
            # no range support: skip the prefix ourselves (bounded reads)
            left = offset
            while left:
                data = resp.raw.read(min(left, 1 << 20), decode_content=False)
                if not data:
                    resp.close()
                    raise SizeMismatchError(
                        descriptor.digest, descriptor.size, offset - left, source=self.name
                    )
                left -= len(data)
        return _ResponseStream(resp)  # type: ignore[return-value]

    def fetch_range(self, descriptor: Descriptor, offset: int, length: int) -> bytes:
        if length <= 0:
            return b""
        if offset < 0 or offset + length > descriptor.size:
            raise SizeMismatchError(descriptor.digest, descriptor.size, offset + length, source=self.name)
        resp = self.client.request(
            "GET",
            self._path("blobs", descriptor.digest),
            scopes=self._scopes(),
            headers={"Range": f"bytes={offset}-{offset + length - 1}"},
            stream=True,
            ok=(206,),
            allow=(200, 416),
            what=f"range of blob {descriptor.digest} from {self.name}",
        )
        with resp:
            if resp.status_code == 416:
                # distribution 2.8's 416 carries a wrong Content-Length: never read its body
                raise RegistryError(
                    f"range {offset}+{length} of blob {descriptor.digest} not satisfiable",
                    status=416,
                    target=self.name,
                )
            if resp.status_code == 206:
                self._check_content_range(resp, descriptor, offset)
            if resp.status_code == 200:
                left = offset
                while left:
                    chunk = resp.raw.read(min(left, 1 << 20), decode_content=False)
                    if not chunk:
                        break
                    left -= len(chunk)
            data = resp.raw.read(length + 1 if resp.status_code == 206 else length, decode_content=False)
        if len(data) != length:
            raise SizeMismatchError(
                descriptor.digest, length, len(data), source=f"{self.name} range {offset}"
            )
        return bytes(data)

    def _check_content_range(self, resp: requests.Response, descriptor: Descriptor, offset: int) -> None:
        """A 206 must start where we asked; anything else would splice the wrong bytes in."""
        m = re.match(r"^bytes (\d+)-(\d+)/(\d+|\*)$", resp.headers.get("Content-Range", "").strip())
        if not m or int(m.group(1)) != offset:
            resp.close()
            raise RegistryError(
                f"blob {descriptor.digest}: asked for bytes from {offset}, got Content-Range "
                f"{resp.headers.get('Content-Range')!r}",
                status=206,
                target=self.name,
            )

    def exists(self, descriptor: Descriptor) -> bool:
        kind = "manifests" if descriptor.media_type in MANIFEST_TYPES else "blobs"
        resp = self.client.request(
            "HEAD",
            self._path(kind, descriptor.digest),
            scopes=self._scopes(),
            headers={"Accept": MANIFEST_ACCEPT} if kind == "manifests" else None,
            allow=(404,),
            what=f"check {descriptor.digest} in {self.name}",
        )
        resp.close()
        if resp.status_code == 404:
            return False
        length = resp.headers.get("Content-Length")
        return length is None or int(length) == descriptor.size

    # ------------------------------------------------------------------ listing
    def _paginate(
        self, path: str, params: dict[str, str], key: str, scopes: tuple[str, ...]
    ) -> Iterator[str]:
        url: str | None = self.client.url(path) + ("?" + urlencode(params) if params else "")
        seen_pages = 0
        while url:
            resp = self.client.request("GET", url, scopes=scopes, stream=True, what=f"list {self.name}")
            with resp:
                raw = resp.raw.read(MAX_TAGS_PAGE_BYTES + 1, decode_content=True)
                link = resp.headers.get("Link", "")
            if len(raw) > MAX_TAGS_PAGE_BYTES:
                raise RegistryError(f"{key} page larger than 16 MiB", target=self.name)
            try:
                doc = json.loads(raw)
            except ValueError:
                raise RegistryError(f"{key} list is not JSON", target=self.name) from None
            items = doc.get(key) if isinstance(doc, dict) else None
            for item in items or []:
                if isinstance(item, str):
                    yield item
            m = _LINK_RE.search(link)
            seen_pages += 1
            url = urljoin(self.client.base_url + "/", m.group(1)) if m and seen_pages < 100_000 else None
            if url and urlsplit(url).netloc != self.client.api_host:
                raise RegistryError("pagination link points to another host; refusing", target=self.name)

    def list_tags(self) -> Iterator[str]:
        """All tags (follows ``Link`` pages; 2.8 ignores ``n``/``last`` and returns one page)."""
        yield from self._paginate(self._path("tags", "list"), {"n": "1000"}, "tags", self._scopes())

    def catalog(self, page_size: int = 1000) -> Iterator[str]:
        """Repositories on the registry (``_catalog`` with ``n``/``last`` pages)."""
        yield from self._paginate(
            "/v2/_catalog", {"n": str(page_size)}, "repositories", ("registry:catalog:*",)
        )

    # ------------------------------------------------------------------ referrers
    def referrers(self, subject: Descriptor, artifact_type: str | None = None) -> list[Descriptor]:
        """Referrers of ``subject``: the API when served, else the ``sha256-<hex>`` fallback tag."""
        entries: list[Descriptor] | None = None
        if self._referrers_api is not False:
            params = {"artifactType": artifact_type} if artifact_type else None
            resp = self.client.request(
                "GET",
                self._path("referrers", subject.digest),
                scopes=self._scopes(),
                params=params,
                headers={"Accept": MEDIA_TYPE_OCI_INDEX},
                stream=True,
                allow=(404, 400, 405),
                what=f"referrers of {subject.digest}",
            )
            with resp:
                ctype = (resp.headers.get("Content-Type") or "").split(";")[0].strip()
                if resp.status_code == 200 and ctype == MEDIA_TYPE_OCI_INDEX:
                    raw = resp.raw.read(MAX_MANIFEST_BYTES + 1, decode_content=True)
                    self._referrers_api = True
                    entries = list(Index.parse(raw).manifests)
                else:
                    self._referrers_api = False
        if entries is None:
            entries = list(self._fallback_index(subject.digest)[1])
        if artifact_type:
            entries = [e for e in entries if e.artifact_type == artifact_type]
        return entries

    @staticmethod
    def fallback_tag(digest: str) -> str:
        return Digest(digest).replace(":", "-")

    def _fallback_index(self, subject_digest: str) -> tuple[bytes | None, tuple[Descriptor, ...]]:
        try:
            raw, media_type, _ = self._get_manifest(self.fallback_tag(subject_digest))
        except RegistryNotFoundError:
            return None, ()
        parsed = parse_manifest_or_index(raw, media_type)
        if not isinstance(parsed, Index):
            raise ManifestError(f"{self.name}: fallback referrers tag for {subject_digest} is not an index")
        return raw, parsed.manifests

    def _add_fallback_referrer(self, subject: Descriptor, referrer: Descriptor) -> None:
        _, existing = self._fallback_index(subject.digest)
        if any(e.digest == referrer.digest for e in existing):
            return
        index = Index.build([*existing, referrer])
        self._put_manifest(index.raw, MEDIA_TYPE_OCI_INDEX, self.fallback_tag(subject.digest))

    # ------------------------------------------------------------------ blobs (write)
    def push_blob(self, source: BlobSource) -> None:
        desc = source.descriptor
        if self.exists(desc):
            self._count("skipped")
            return
        self._upload(source)
        self._count("uploaded")

    def try_mount(self, descriptor: Descriptor, src: object) -> bool:
        """Cross-repository mount when ``src`` is another repository of the same registry."""
        if not isinstance(src, RegistryTarget) or src.client.api_host != self.client.api_host:
            return False
        if src.repository == self.repository:
            return False
        scopes = (*self._scopes(push=True), f"repository:{src.repository}:pull")
        resp = self.client.request(
            "POST",
            self._path("blobs/uploads"),
            scopes=scopes,
            params={"mount": str(descriptor.digest), "from": src.repository},
            ok=(201,),
            allow=(202,),
            what=f"mount {descriptor.digest} from {src.repository}",
        )
        if resp.status_code == 201:
            got = resp.headers.get("Docker-Content-Digest")
            if got and got != descriptor.digest:
                raise UploadError(
                    f"mount of {descriptor.digest} answered with {got}", status=201, target=self.name
                )
            log.debug("mounted %s from %s into %s", descriptor.digest, src.repository, self.repository)
            self._count("mounted")
            return True
        # 202: the registry opened a normal upload instead; cancel it and upload normally
        location = resp.headers.get("Location")
        if location:
            with contextlib.suppress(RegistryError):
                self.client.request(
                    "DELETE",
                    self.client.resolve_location(location),
                    scopes=self._scopes(push=True),
                    ok=(204, 200),
                    allow=(404,),
                )
        return False

    def _state_path(self, digest: str) -> str:
        return os.path.join(self._state_dir, Digest(digest).hex + ".json")

    def _save_state(self, digest: str, location: str, offset: int) -> None:
        os.makedirs(self._state_dir, exist_ok=True)
        doc = {"location": location, "offset": offset, "repository": self.name}
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

    def _start_upload(self) -> str:
        resp = self.client.request(
            "POST",
            self._path("blobs/uploads"),
            scopes=self._scopes(push=True),
            ok=(202,),
            what=f"start upload to {self.name}",
        )
        location = resp.headers.get("Location")
        if not location:
            raise UploadError("upload started without a Location", status=202, target=self.name)
        return self.client.resolve_location(location)

    def upload_status(self, location: str) -> tuple[str, int] | None:
        """Ask the registry how much of an upload session it holds: (location, next offset)."""
        resp = self.client.request(
            "GET",
            location,
            scopes=self._scopes(push=True),
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
        return (self.client.resolve_location(new_location) if new_location else location), offset

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

    def _upload(self, source: BlobSource) -> None:
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
                self._count("resumed")
            else:
                log.debug("saved upload of %s is gone or inconsistent; restarting it", desc.digest)
            self._drop_state(desc.digest)
        if location is None:
            location = self._start_upload()
            offset = 0
        chunked = offset > 0 or desc.size > self.monolithic_max
        reader: VerifyingReader | _SizeCheckedReader
        if source.verified and source.local_path:
            # the packer hashed this very file moments ago: check sizes, skip a second hash pass
            # (the registry hashes what it receives and refuses a commit that does not match)
            reader = _SizeCheckedReader(source.open(offset), desc, offset)
        else:
            reader = VerifyingReader(
                source.open(0), desc.digest, desc.size, source=source.local_path or self.name
            )
        try:
            if offset and isinstance(reader, VerifyingReader):
                # re-hash what the registry already holds (read, not re-sent): the commit below
                # still covers every byte with our own digest check
                left = offset
                while left:
                    data = reader.read(min(left, 4 << 20))
                    if not data:
                        raise SizeMismatchError(desc.digest, desc.size, offset - left, source=self.name)
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
                self.client.request(
                    "DELETE", location, scopes=self._scopes(push=True), ok=(204, 200), allow=(404,)
                )
            raise
        finally:
            reader.close()

    def _put_monolithic(self, location: str, reader: _Reader, desc: Descriptor) -> None:
        url = _with_query(location, {"digest": str(desc.digest)})
        try:
            resp = self.client.request(
                "PUT",
                url,
                scopes=self._scopes(push=True),
                headers={"Content-Type": "application/octet-stream"},
                body=_Slice(reader, desc.size) if desc.size else b"",
                ok=(201,),
                what=f"upload {desc.digest} to {self.name}",
            )
        except RegistryError:
            # the registry refuses bytes that do not hash to the digest (DIGEST_INVALID); if that
            # was our source's fault, say so with the digest and the file at fault
            if _reader_complete(reader, desc.size):
                reader.read(1)
            raise
        reader.read(1)  # raises if the stream did not hash to the digest (registry checks too)
        self._check_committed(resp, desc)
        self._count("bytes_sent", desc.size)

    def _patch(self, location: str, reader: _Reader, offset: int, n: int, desc: Descriptor) -> str:
        resp = self.client.request(
            "PATCH",
            location,
            scopes=self._scopes(push=True),
            headers={
                "Content-Type": "application/octet-stream",
                "Content-Range": f"{offset}-{offset + n - 1}",
            },
            body=_Slice(reader, n),
            ok=(202,),
            what=f"upload chunk {offset}+{n} of {desc.digest} to {self.name}",
        )
        self._count("bytes_sent", n)
        rng = resp.headers.get("Range", "")
        m = _RANGE_RE.match(rng.strip())
        if m and int(m.group(1)) != offset + n - 1:
            raise UploadError(
                f"registry holds {int(m.group(1)) + 1} bytes of {desc.digest}, expected {offset + n}",
                status=202,
                target=self.name,
            )
        new_location = resp.headers.get("Location")
        return self.client.resolve_location(new_location) if new_location else location

    def _commit(self, location: str, desc: Descriptor) -> None:
        resp = self.client.request(
            "PUT",
            _with_query(location, {"digest": str(desc.digest)}),
            scopes=self._scopes(push=True),
            headers={"Content-Type": "application/octet-stream"},
            body=b"",
            ok=(201,),
            what=f"commit {desc.digest} to {self.name}",
        )
        self._check_committed(resp, desc)

    def _check_committed(self, resp: requests.Response, desc: Descriptor) -> None:
        got = resp.headers.get("Docker-Content-Digest")
        if got and got != desc.digest:
            raise UploadError(
                f"registry committed {got}, expected {desc.digest}", status=201, target=self.name
            )

    # ------------------------------------------------------------------ manifests (write)
    def _put_manifest(self, raw: bytes, media_type: str, reference: str) -> requests.Response:
        if len(raw) > MAX_MANIFEST_BYTES:
            raise ManifestTooLargeError(
                f"manifest is {len(raw)} bytes; registries accept at most 4 MiB", target=self.name
            )
        resp = self.client.request(
            "PUT",
            self._path("manifests", reference),
            scopes=self._scopes(push=True),
            headers={"Content-Type": media_type},
            body=raw,
            ok=(201, 200),
            idempotent=True,  # same bytes to the same name: safe to repeat
            what=f"push manifest {self.name}:{reference}",
        )
        got = resp.headers.get("Docker-Content-Digest")
        digest = Digest.from_bytes(raw)
        if got and got != digest:
            raise UploadError(f"registry stored manifest as {got}, expected {digest}", target=self.name)
        self._cache_put(digest, raw, media_type)
        return resp

    def push_manifest(self, raw: bytes, media_type: str, tag: str | None = None) -> Descriptor:
        if tag:
            validate_tag(tag)
        if len(raw) > MAX_MANIFEST_BYTES:
            raise ManifestTooLargeError(
                f"manifest is {len(raw)} bytes; registries accept at most 4 MiB", target=self.name
            )
        parsed = parse_manifest_or_index(raw, media_type)
        digest = Digest.from_bytes(raw)
        resp = self._put_manifest(raw, media_type, digest)
        if tag:
            self._put_manifest(raw, media_type, tag)
        artifact_type = parsed.artifact_type
        if artifact_type is None and isinstance(parsed, Manifest):
            artifact_type = parsed.config.media_type
        desc = Descriptor(media_type, digest, len(raw), artifact_type=artifact_type)
        subject = parsed.subject
        if subject is not None and not resp.headers.get("OCI-Subject"):
            entry = Descriptor(
                media_type, digest, len(raw), annotations=parsed.annotations, artifact_type=artifact_type
            )
            self._add_fallback_referrer(subject, entry)
        return desc

    def tag(self, descriptor: Descriptor, tag: str) -> None:
        validate_tag(tag)
        raw, media_type, _ = self._get_manifest(str(descriptor.digest))
        self._put_manifest(raw, media_type, tag)

    def delete_manifest(self, digest: str) -> None:
        """Delete a manifest by digest (the registry must allow deletes)."""
        self.client.request(
            "DELETE",
            self._path("manifests", Digest(digest)),
            scopes=(f"repository:{self.repository}:delete",),
            ok=(202, 200),
            idempotent=True,
            what=f"delete {digest} from {self.name}",
        )

    def close(self) -> None:
        self.client.close()


def _reader_complete(reader: _Reader, size: int) -> bool:
    """Whether every byte of the blob went through ``reader`` (so its end check can run)."""
    if isinstance(reader, VerifyingReader):
        return reader.bytes_read == size
    return False


def _with_query(url: str, params: dict[str, str]) -> str:
    sep = "&" if "?" in url else "?"
    return url + sep + urlencode(params)


__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "DEFAULT_MONOLITHIC_MAX",
    "MANIFEST_ACCEPT",
    "NotFoundError",
    "RegistryTarget",
]
