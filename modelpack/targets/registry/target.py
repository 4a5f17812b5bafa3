"""A registry repository as a Target (OCI distribution spec v1.1, tested on distribution 2.8).

``RegistryTarget`` puts the Target protocol over one repository; the work is done by
``blob_reads`` (streams and ranges, unverified: the consumer verifies, because a registry serves
a corrupted stored blob without noticing), ``upload`` (one PUT or resumable PATCH chunks, every
byte hashed locally before the commit) and ``manifests`` (bounded, verified reads; pushes;
referrers with the tag-schema fallback). Uploads HEAD first and skip what exists, and mount
blobs across repositories of the same registry instead of re-sending them.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any, BinaryIO, TypeVar
from urllib.parse import urlencode, urljoin, urlsplit

from modelpack import boundedjson
from modelpack.errors import (
    DocumentError,
    ListingCutError,
    ModelpackError,
    NotFoundError,
    RegistryConnectionError,
    RegistryError,
    SizeMismatchError,
    TransferInterrupted,
    UploadError,
)
from modelpack.events import EventLog
from modelpack.oci.descriptor import Descriptor
from modelpack.oci.reference import Reference
from modelpack.targets.base import BlobSource, ChunkBounds, ChunkTableLike, RangeCheck
from modelpack.targets.options import TargetOptions
from modelpack.targets.ranges import bands, fill_views, plan_runs
from modelpack.targets.registry.auth import resolve_credentials
from modelpack.targets.registry.blob_reads import open_blob, read_range, read_range_into
from modelpack.targets.registry.client import BodyTooLarge, RegistryClient
from modelpack.targets.registry.manifests import MANIFEST_ACCEPT, MANIFEST_TYPES, ManifestStore
from modelpack.targets.registry.mirrors import MirroredBlobs, configured_mirrors, mirror_limits
from modelpack.targets.registry.multi_range_reads import read_ranges_into
from modelpack.targets.registry.peer_referrers import ListingClock, mirror_referrers
from modelpack.targets.registry.repository import RepositoryAPI
from modelpack.targets.registry.source_events import emit, origin_url
from modelpack.targets.registry.upload import DEFAULT_CHUNK_SIZE, DEFAULT_MONOLITHIC_MAX, BlobUploader
from modelpack.targets.retry import DEFAULT_RETRY_FOR

log = logging.getLogger("modelpack.targets.registry")
T = TypeVar("T")

MAX_TAGS_PAGE_BYTES = 16 * 1024 * 1024
#: pages of one tag or catalog listing followed at most (``Link: rel=next``); past it, the listing
#: raises ``ListingCutError`` (an endless chain of pages, empty or not, is not a listing)
MAX_LIST_PAGES = 2_000
_LINK_RE = re.compile(r"<([^>]+)>\s*;\s*rel=\"?next\"?")
#: with mirrors configured, an unreachable origin's referrers are given up after this long (the
#: mirrors' listings are verified entry by entry like the origin's)
ORIGIN_FALLTHROUGH_S = 3.0


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
        self._repo = RepositoryAPI(client, repository, for_write=for_write)
        self.name = self._repo.name
        self.stats = self._repo.stats  # one dict: uploads and mounts count into it
        self._manifests = ManifestStore(self._repo)
        self._uploads = BlobUploader(
            self._repo,
            chunk_size=chunk_size,
            monolithic_max=monolithic_max,
            upload_state_dir=upload_state_dir,
        )
        #: blob reads through mirrors first (``modelpack.targets.registry.mirrors``), when configured
        self.mirrors: MirroredBlobs | None = None
        self._mirror_manifests: list[tuple[str, ManifestStore]] = []
        #: the JSON event log the source events go to (``TargetOptions.events``)
        self.events: EventLog | None = None
        self._origin_unreachable: RegistryConnectionError | None = None
        #: the origin's referrers with a short retry budget, when mirrors can answer instead
        self._origin_referrers: ManifestStore | None = None
        #: the time left for peer referrer listings (``peer_referrers.LISTING_BUDGET_S``)
        self._listing_clock = ListingClock()

    @property
    def chunk_size(self) -> int:
        return self._uploads.chunk_size

    @property
    def monolithic_max(self) -> int:
        return self._uploads.monolithic_max

    @classmethod
    def from_reference(
        cls, ref: Reference, options: TargetOptions | None = None, *, for_write: bool = False
    ) -> RegistryTarget:
        """Open ``ref``'s repository. ``options`` is a ``TargetOptions`` (connection, credentials;
        ``chunk_size``, mirrors and their thresholds, the event log)."""
        if ref.scheme != "registry":
            raise RegistryError(f"{ref} is not a registry reference")
        opts = options if isinstance(options, TargetOptions) else TargetOptions.from_environ()
        creds = resolve_credentials(ref.location, opts)
        client = RegistryClient(
            ref.location,
            plain_http=opts.plain_http,
            ca_file=opts.ca_file,
            insecure_skip_verify=opts.insecure_skip_verify,
            credentials=creds,
            retry_for=opts.retry_for,
            timeout=opts.timeout,
        )
        chunk_size = opts.chunk_size or DEFAULT_CHUNK_SIZE
        if chunk_size <= 0:
            raise UploadError(f"chunk size must be positive, got {chunk_size}")
        target = cls(
            client,
            ref.repository,
            for_write=for_write,
            chunk_size=chunk_size,
            # an explicit chunk size also lowers the single-PUT limit: larger blobs are chunked
            monolithic_max=min(DEFAULT_MONOLITHIC_MAX, chunk_size),
        )
        target.events = opts.events
        if not for_write:
            endpoints = configured_mirrors(
                ref.location, opts.mirrors, opts.hosts_dir, peer_token=opts.peer_token
            )
            if endpoints:
                stall, floor = mirror_limits(opts.mirror_thresholds)
                target.mirrors = MirroredBlobs(
                    target._repo,
                    endpoints,
                    retry_for=opts.retry_for,
                    stall_s=stall,
                    floor=floor,
                    events=opts.events,
                )
                target._mirror_manifests = [(m.name, ManifestStore(m.repo)) for m in target.mirrors.mirrors]
                # referrers are asked of the origin first: with mirrors to fall back to, an origin
                # that cannot be reached gets a short budget, not the whole --retry-for
                budget = DEFAULT_RETRY_FOR if opts.retry_for is None else opts.retry_for
                quick = client.with_retry_for(min(budget, ORIGIN_FALLTHROUGH_S))
                target._origin_referrers = ManifestStore(RepositoryAPI(quick, ref.repository))
        return target

    # ------------------------------------------------------------------ manifests (read)
    def _by_digest(self, reference: str, op: Callable[[ManifestStore], T]) -> T:
        """A manifest by digest from the mirrors first (verified against the digest by the
        store), then the origin; a tag only ever at the origin: a mirror never picks a version."""
        if (
            reference.startswith("sha256:")
            and self.mirrors is not None
            and self._manifests.cached(reference) is None
        ):
            for name, store in self._mirror_manifests:
                if not self.mirrors.usable(name):
                    continue
                again = store.cached(reference) is not None  # a resolve then a fetch: one event
                try:
                    got = op(store)
                except TransferInterrupted:
                    raise
                except ModelpackError as exc:
                    self.mirrors.manifest_abandoned(name, reference, exc)
                    continue
                if not again:
                    self._manifest_event(reference, got, self.mirrors.url_of(name), "mirror")
                return got
        store = self._manifests
        if self._origin_unreachable is not None and self._origin_referrers is not None:
            # the origin could not be reached this run (its referrers fell through to the peers):
            # each digest no peer had (a listed junk referrer) costs the short budget, not --retry-for
            store = self._origin_referrers
        fresh = store.cached(reference) is None if reference.startswith("sha256:") else True
        got = op(store)
        if fresh:
            self._manifest_event(reference, got, origin_url(self.client), "origin")
        return got

    def _manifest_event(self, reference: str, got: Any, source: str, kind: str) -> None:
        size = got.size if isinstance(got, Descriptor) else len(got[0])
        emit(
            self.events, "registry.manifest_fetched", source=source, kind=kind, manifest=reference, bytes=size
        )

    def resolve(self, reference: str) -> Descriptor:
        return self._by_digest(reference, lambda store: store.resolve(reference))

    def fetch_manifest(self, reference: str) -> tuple[bytes, str]:
        raw, media_type, _ = self._by_digest(reference, lambda store: store.get(reference))
        if self.mirrors is not None:  # blob order: this manifest's owners, balanced (``owners``)
            self.mirrors.plan_manifest(raw, media_type)
        return raw, media_type

    # ------------------------------------------------------------------ blobs (read)
    def fetch_blob(self, descriptor: Descriptor, offset: int = 0) -> BinaryIO:
        if self.mirrors is not None:
            return self.mirrors.open_blob(descriptor, offset)
        return open_blob(self._repo, descriptor, offset)

    def fetch_blob_spooled(self, descriptor: Descriptor) -> BinaryIO | None:
        """The whole blob from the mirrors, verified (``VerifiedSpooler``); None without mirrors
        or when the origin must serve it."""
        return self.mirrors.spool_verified(descriptor) if self.mirrors is not None else None

    def use_chunk_table(self, table: ChunkTableLike) -> None:
        """Check the mirrors' whole-blob spools of ``table``'s layers chunk by chunk against it
        (a table the caller verified; ``ChunkCheckedSpools``): a liar is dropped at its first
        wrong chunk, the next source continues from the last good one."""
        if self.mirrors is None:
            return
        for layer in table.layers:
            self.mirrors.check_chunks(str(layer), _bounds(table, str(layer)), table.range_check(str(layer)))

    def fetch_range(self, descriptor: Descriptor, offset: int, length: int) -> bytes:
        if self.mirrors is not None:
            return self.mirrors.read_range(descriptor, offset, length)
        return read_range(self._repo, descriptor, offset, length)

    def fetch_range_checked(
        self, descriptor: Descriptor, offset: int, length: int, check: RangeCheck
    ) -> bytes:
        """``fetch_range``, with the chunks a mirror got wrong (``check``) fetched again from the
        next source and the origin."""
        if self.mirrors is not None:
            return self.mirrors.read_range(descriptor, offset, length, check)
        return read_range(self._repo, descriptor, offset, length)

    def fetch_range_into(
        self,
        descriptor: Descriptor,
        offset: int,
        views: Sequence[memoryview],
        check: RangeCheck | None = None,
    ) -> None:
        """``fetch_range(_checked)`` into caller memory: the range fills ``views`` in order,
        received straight into them from the origin (through mirrors: read, then copied)."""
        if self.mirrors is not None:
            length = sum(len(v) for v in views)
            data = memoryview(self.mirrors.read_range(descriptor, offset, length, check))
            if len(data) != length:
                raise SizeMismatchError(
                    descriptor.digest, length, len(data), source=f"{self.name} range {offset}"
                )
            pos = 0
            for v in views:
                v[:] = data[pos : pos + len(v)]
                pos += len(v)
            return
        read_range_into(self._repo, descriptor, offset, views)

    @property
    def multi_range(self) -> bool:
        """Whether ``fetch_ranges_into`` asks the origin for many ranges per request: only
        without mirrors (``MultiRangeFetcher``)."""
        return self.mirrors is None

    def fetch_ranges_into(
        self, descriptor: Descriptor, ranges: Sequence[tuple[int, int]], views: Sequence[memoryview]
    ) -> int:
        """Fill ``views[i]`` with the ``ranges[i]`` bytes of the blob: multi-range requests to the
        origin (``multi_range_reads.read_ranges_into``), or, through mirrors, covering bands read from the
        first source that serves them and copied out (a mirror's wrong bytes are for the caller's
        check to find; ``multi_range`` is False). Returns the bytes fetched."""
        if self.mirrors is None:
            return read_ranges_into(self._repo, descriptor, ranges, views)
        fetched = 0
        for band in bands(plan_runs(descriptor, ranges, views, source=self.name)):
            data = self.mirrors.read_range(descriptor, band.offset, band.length)
            if len(data) != band.length:
                raise SizeMismatchError(
                    descriptor.digest, band.length, len(data), source=f"{self.name} range {band.offset}"
                )
            fill_views(band.views, data)
            fetched += band.length
        return fetched

    def bytes_by_source(self) -> dict[str, int]:
        """Blob bytes delivered per source host (mirrors and origin; empty without mirrors)."""
        return dict(self.mirrors.bytes_by_source) if self.mirrors is not None else {}

    def exists(self, descriptor: Descriptor) -> bool:
        kind = "manifests" if descriptor.media_type in MANIFEST_TYPES else "blobs"
        resp = self.client.request(
            "HEAD",
            self._repo.path(kind, descriptor.digest),
            scopes=self._repo.scopes(),
            headers={"Accept": MANIFEST_ACCEPT} if kind == "manifests" else None,
            allow=(404,),
            what=f"check {descriptor.digest} in {self.name}",
        )
        resp.close()
        if resp.status_code == 404:
            return False
        length = resp.headers.get("Content-Length")
        return length is None or not length.isdigit() or int(length) == descriptor.size

    # ------------------------------------------------------------------ listing
    def _paginate(
        self, path: str, params: dict[str, str], key: str, scopes: tuple[str, ...]
    ) -> Iterator[str]:
        url: str | None = self.client.url(path) + ("?" + urlencode(params) if params else "")
        seen_pages = listed = 0
        while url:
            if seen_pages >= MAX_LIST_PAGES:
                raise ListingCutError(
                    f"{key} list: the registry links to more than {MAX_LIST_PAGES} pages "
                    f"(Link: rel=next); stopped after {listed} {key}",
                    target=self.name,
                    listed=listed,
                )
            what = f"{key} list of {self.name}"
            try:
                page = self.client.fetch_document(
                    url, scopes=scopes, max_bytes=MAX_TAGS_PAGE_BYTES, what=what
                )
            except BodyTooLarge:
                raise RegistryError(f"{key} page larger than 16 MiB", target=self.name) from None
            link = page.headers.get("Link", "")
            try:
                doc = boundedjson.loads(page.body, what=what, max_bytes=MAX_TAGS_PAGE_BYTES)
            except DocumentError as exc:
                raise RegistryError(f"{key} list unusable: {exc.reason}", target=self.name) from None
            items = doc.get(key) if isinstance(doc, dict) else None
            for item in items if isinstance(items, list) else []:
                if isinstance(item, str):
                    listed += 1
                    yield item
            m = _LINK_RE.search(link)
            seen_pages += 1
            url = urljoin(self.client.base_url + "/", m.group(1)) if m else None
            if url and urlsplit(url).netloc != self.client.api_host:
                raise RegistryError("pagination link points to another host; refusing", target=self.name)

    def list_tags(self) -> Iterator[str]:
        """All tags (follows ``Link`` pages; 2.8 ignores ``n``/``last`` and returns one page)."""
        yield from self._paginate(self._repo.path("tags", "list"), {"n": "1000"}, "tags", self._repo.scopes())

    def catalog(self, page_size: int = 1000) -> Iterator[str]:
        """Repositories on the registry (``_catalog`` with ``n``/``last`` pages)."""
        yield from self._paginate(
            "/v2/_catalog", {"n": str(page_size)}, "repositories", ("registry:catalog:*",)
        )

    # ------------------------------------------------------------------ referrers
    def referrers(self, subject: Descriptor, artifact_type: str | None = None) -> list[Descriptor]:
        """Referrers of ``subject``: the API when served, else the ``sha256-<hex>`` fallback tag.
        Asked of the origin; of every usable mirror only when the origin cannot be reached (within
        ``ORIGIN_FALLTHROUGH_S``, not the whole ``--retry-for``: a pinned start under a policy
        with the origin down waited 60 s before asking its peers; then for the rest of this
        target's life), merged by
        ``peer_referrers`` (a listing cannot be verified, but every entry is a digest whose
        manifest and signature are checked: a mirror can withhold a signature, never forge one)."""
        if self._origin_unreachable is None or self.mirrors is None:
            try:
                got = (self._origin_referrers or self._manifests).referrers(subject, artifact_type)
            except RegistryConnectionError as exc:
                if self.mirrors is None:
                    raise
                self._origin_unreachable = exc  # one retry budget per run, not one per listing
            else:
                emit(
                    self.events,
                    "registry.referrers_listed",
                    source=origin_url(self.client),
                    kind="origin",
                    subject=str(subject.digest),
                    artifact_type=artifact_type,
                    referrers=len(got),
                )
                return got
        return mirror_referrers(
            self.mirrors,
            self._mirror_manifests,
            subject,
            artifact_type,
            self._origin_unreachable,
            self.events,
            self._listing_clock,
        )

    @staticmethod
    def fallback_tag(digest: str) -> str:
        """The tag-schema referrers tag of ``digest`` (``sha256-<hex>``)."""
        return ManifestStore.fallback_tag(digest)

    # ------------------------------------------------------------------ blobs (write)
    def push_blob(self, source: BlobSource) -> None:
        desc = source.descriptor
        if self.exists(desc):
            self._repo.count("skipped")
            return
        self._uploads.upload(source)
        self._repo.count("uploaded")

    @property
    def registry_host(self) -> str:
        """The registry's API host: where a blob of another repository can be mounted from."""
        return self.client.api_host

    def try_mount(self, descriptor: Descriptor, src: object) -> bool:
        """Cross-repository mount when ``src`` is another repository of the same registry."""
        if not isinstance(src, RegistryTarget) or src.client.api_host != self.client.api_host:
            return False
        return self.try_mount_from(descriptor, src.repository)

    def try_mount_from(self, descriptor: Descriptor, repository: str) -> bool:
        """Mount ``descriptor`` from ``repository`` of this registry; False when the registry
        opened a normal upload instead (it does not hold the blob there, or will not say)."""
        if repository == self.repository:
            return False
        scopes = (*self._repo.scopes(push=True), f"repository:{repository}:pull")
        resp = self.client.request(
            "POST",
            self._repo.path("blobs/uploads"),
            scopes=scopes,
            params={"mount": str(descriptor.digest), "from": repository},
            ok=(201,),
            allow=(202,),
            idempotent=True,  # mounting twice is harmless; an unknown 202 session only lingers
            what=f"mount {descriptor.digest} from {repository}",
        )
        if resp.status_code == 201:
            got = resp.headers.get("Docker-Content-Digest")
            if got and got != descriptor.digest:
                raise UploadError(
                    f"mount of {descriptor.digest} answered with {got}", status=201, target=self.name
                )
            log.debug("mounted %s from %s into %s", descriptor.digest, repository, self.repository)
            self._repo.count("mounted")
            return True
        # 202: the registry opened a normal upload instead; cancel it and upload normally
        location = resp.headers.get("Location")
        if location:
            with contextlib.suppress(RegistryError):
                self.client.request(
                    "DELETE",
                    self.client.resolve_location(location),
                    scopes=self._repo.scopes(push=True),
                    ok=(204, 200),
                    allow=(404,),
                )
        return False

    def upload_status(self, location: str) -> tuple[str, int] | None:
        """Ask the registry how much of an upload session it holds: (location, next offset)."""
        return self._uploads.upload_status(location)

    # ------------------------------------------------------------------ manifests (write)
    def push_manifest(self, raw: bytes, media_type: str, tag: str | None = None) -> Descriptor:
        return self._manifests.push(raw, media_type, tag)

    def tag(self, descriptor: Descriptor, tag: str) -> None:
        self._manifests.tag(descriptor, tag)

    def close(self) -> None:
        if self.mirrors is not None:
            self.mirrors.close()
        self.client.close()


__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "DEFAULT_MONOLITHIC_MAX",
    "MANIFEST_ACCEPT",
    "NotFoundError",
    "RegistryTarget",
]


def _bounds(table: ChunkTableLike, layer: str) -> ChunkBounds:
    """Where the chunk of ``table``'s ``layer`` holding an offset lies."""

    def at(offset: int) -> tuple[int, int]:
        return table.chunk_at(layer, offset)

    return at
