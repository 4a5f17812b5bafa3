"""Manifests in one registry repository: bounded, verified reads, pushes, tags and referrers.

Manifests are fetched with an ``Accept`` that names OCI and Docker types (distribution 2.8 refuses
OCI manifests otherwise), capped at 4 MiB and verified against the digest they resolved to; the
ones read or written recently are kept (16 × 4 MiB at most), so a resolve followed by a fetch
costs one request.

Referrers: the referrers API when the registry has it, else the ``sha256-<hex>`` tag-schema index,
which ``push`` maintains for manifests that carry a ``subject`` (as oras and cosign do; like
them, two concurrent writers of the same index can lose an entry).

A manifest PUT is idempotent (the same bytes to the same name) and retried like a GET. One more
answer is retried: distribution 2.8 refuses some of several concurrent identical PUTs with
``400 DIGEST_INVALID`` while another writer is linking the same blobs (1 to 4 of 10 concurrent
pushes of one model failed so); since the digest is computed here from the bytes sent, that
answer cannot be this client's fault, and the PUT is sent again (``MAX_DIGEST_INVALID_RETRIES``
times, within the retry budget).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import requests

from modelpack import boundedjson
from modelpack.errors import (
    DocumentError,
    ManifestError,
    ManifestTooLargeError,
    RegistryError,
    RegistryNotFoundError,
    UploadError,
)
from modelpack.mediatypes import (
    MEDIA_TYPE_DOCKER_MANIFEST,
    MEDIA_TYPE_DOCKER_MANIFEST_LIST,
    MEDIA_TYPE_OCI_INDEX,
    MEDIA_TYPE_OCI_MANIFEST,
)
from modelpack.oci.descriptor import MAX_MANIFEST_BYTES, Descriptor, Index, Manifest, parse_manifest_or_index
from modelpack.oci.digest import Digest, verify_bytes
from modelpack.oci.reference import validate_tag
from modelpack.targets.registry.client import BodyTooLarge
from modelpack.targets.registry.repository import RepositoryAPI

MANIFEST_ACCEPT = ", ".join(
    [
        MEDIA_TYPE_OCI_MANIFEST,
        MEDIA_TYPE_OCI_INDEX,
        MEDIA_TYPE_DOCKER_MANIFEST,
        MEDIA_TYPE_DOCKER_MANIFEST_LIST,
    ]
)
MANIFEST_TYPES = frozenset(MANIFEST_ACCEPT.split(", "))
#: concurrent identical manifest PUTs that distribution 2.8 refused with DIGEST_INVALID, re-sent
MAX_DIGEST_INVALID_RETRIES = 4


class ManifestStore:
    """The manifests of one repository, with a small cache of recent ones by digest."""

    def __init__(self, repo: RepositoryAPI) -> None:
        self._repo = repo
        self._manifest_cache: OrderedDict[str, tuple[bytes, str]] = OrderedDict()
        self._cache_lock = threading.Lock()
        self._referrers_api: bool | None = None

    def _cache_put(self, digest: str, raw: bytes, media_type: str) -> None:
        with self._cache_lock:
            self._manifest_cache[digest] = (raw, media_type)
            self._manifest_cache.move_to_end(digest)
            while sum(len(v[0]) for v in self._manifest_cache.values()) > 16 * MAX_MANIFEST_BYTES:
                self._manifest_cache.popitem(last=False)

    def _cache_get(self, digest: str) -> tuple[bytes, str] | None:
        with self._cache_lock:
            return self._manifest_cache.get(digest)

    def cached(self, digest: str) -> tuple[bytes, str] | None:
        """The manifest ``digest`` when read or written recently (verified then), else None."""
        return self._cache_get(digest)

    def get(self, reference: str) -> tuple[bytes, str, Digest]:
        """GET a manifest by tag or digest; bounded, and verified when addressed by digest."""
        is_digest = reference.startswith("sha256:")
        if is_digest:
            Digest(reference)
            cached = self._cache_get(reference)
            if cached is not None:
                return cached[0], cached[1], Digest(reference)
        else:
            validate_tag(reference)
        what = (
            f"manifest {self._repo.name}:{reference}"
            if not is_digest
            else f"manifest {self._repo.name}@{reference}"
        )
        try:
            doc = self._repo.client.fetch_document(
                self._repo.path("manifests", reference),
                scopes=self._repo.scopes(),
                headers={"Accept": MANIFEST_ACCEPT},
                max_bytes=MAX_MANIFEST_BYTES,
                what=what,
            )
        except BodyTooLarge as exc:
            raise ManifestError(
                f"{self._repo.name} {reference}: manifest is {exc.declared} bytes; the limit is 4 MiB"
            ) from None
        raw = doc.body
        media_type = (doc.headers.get("Content-Type") or "").split(";")[0].strip()
        header_digest = doc.headers.get("Docker-Content-Digest")
        if len(raw) > MAX_MANIFEST_BYTES:
            raise ManifestError(f"{self._repo.name} {reference}: manifest larger than 4 MiB")
        actual = Digest.from_bytes(raw)
        if is_digest:
            verify_bytes(raw, reference, None, what="manifest", source=self._repo.name)
        elif header_digest and header_digest != actual:
            raise ManifestError(
                f"{self._repo.name}:{reference}: registry says {header_digest} but the bytes hash to {actual}"
            )
        if media_type not in MANIFEST_TYPES:
            try:
                parsed = boundedjson.loads_object(raw, what=what, max_bytes=MAX_MANIFEST_BYTES)
                declared_type = parsed.get("mediaType")
                media_type = declared_type if isinstance(declared_type, str) else ""
            except DocumentError:
                media_type = ""
            if media_type not in MANIFEST_TYPES:
                media_type = MEDIA_TYPE_OCI_MANIFEST
        self._cache_put(actual, raw, media_type)
        return raw, media_type, actual

    def resolve(self, reference: str) -> Descriptor:
        raw, media_type, digest = self.get(reference)
        parsed = parse_manifest_or_index(raw, media_type)
        artifact_type = parsed.artifact_type
        if artifact_type is None and isinstance(parsed, Manifest):
            artifact_type = parsed.config.media_type
        return Descriptor(media_type, digest, len(raw), artifact_type=artifact_type)

    def referrers(self, subject: Descriptor, artifact_type: str | None = None) -> list[Descriptor]:
        """Referrers of ``subject``: the API when served, else the ``sha256-<hex>`` fallback tag."""
        entries: list[Descriptor] | None = None
        if self._referrers_api is not False:
            params = {"artifactType": artifact_type} if artifact_type else None
            try:
                doc = self._repo.client.fetch_document(
                    self._repo.path("referrers", subject.digest),
                    scopes=self._repo.scopes(),
                    params=params,
                    headers={"Accept": MEDIA_TYPE_OCI_INDEX},
                    max_bytes=MAX_MANIFEST_BYTES,
                    allow=(404, 400, 405),
                    what=f"referrers of {subject.digest}",
                )
            except BodyTooLarge as exc:
                raise ManifestError(
                    f"{self._repo.name}: referrers index of {subject.digest} is {exc.declared} bytes; "
                    "the limit is 4 MiB"
                ) from None
            ctype = (doc.headers.get("Content-Type") or "").split(";")[0].strip()
            if doc.status == 200 and ctype == MEDIA_TYPE_OCI_INDEX:
                self._referrers_api = True
                entries = list(Index.parse(doc.body).manifests)
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
            raw, media_type, _ = self.get(self.fallback_tag(subject_digest))
        except RegistryNotFoundError:
            return None, ()
        parsed = parse_manifest_or_index(raw, media_type)
        if not isinstance(parsed, Index):
            raise ManifestError(
                f"{self._repo.name}: fallback referrers tag for {subject_digest} is not an index"
            )
        return raw, parsed.manifests

    def _add_fallback_referrer(self, subject: Descriptor, referrer: Descriptor) -> None:
        _, existing = self._fallback_index(subject.digest)
        if any(e.digest == referrer.digest for e in existing):
            return
        index = Index.build([*existing, referrer])
        self.put(index.raw, MEDIA_TYPE_OCI_INDEX, self.fallback_tag(subject.digest))

    def put(self, raw: bytes, media_type: str, reference: str) -> requests.Response:
        if len(raw) > MAX_MANIFEST_BYTES:
            raise ManifestTooLargeError(
                f"manifest is {len(raw)} bytes; registries accept at most 4 MiB", target=self._repo.name
            )
        digest = Digest.from_bytes(raw)
        budget = self._repo.client.budget()
        refused = 0
        while True:
            try:
                resp = self._repo.client.request(
                    "PUT",
                    self._repo.path("manifests", reference),
                    scopes=self._repo.scopes(push=True),
                    headers={"Content-Type": media_type},
                    body=raw,
                    ok=(201, 200),
                    idempotent=True,  # same bytes to the same name: safe to repeat
                    what=f"push manifest {self._repo.name}:{reference}",
                    budget=budget,
                )
                break
            except RegistryError as exc:
                # a concurrent writer of the same manifest (the digest is ours: not a real mismatch)
                if exc.status != 400 or exc.code != "DIGEST_INVALID" or refused >= MAX_DIGEST_INVALID_RETRIES:
                    raise
                refused += 1
                if not budget.wait():
                    raise
                self._repo.client.count_retry()
        got = resp.headers.get("Docker-Content-Digest")
        if got and got != digest:
            raise UploadError(f"registry stored manifest as {got}, expected {digest}", target=self._repo.name)
        self._cache_put(digest, raw, media_type)
        return resp

    def push(self, raw: bytes, media_type: str, tag: str | None = None) -> Descriptor:
        if tag:
            validate_tag(tag)
        if len(raw) > MAX_MANIFEST_BYTES:
            raise ManifestTooLargeError(
                f"manifest is {len(raw)} bytes; registries accept at most 4 MiB", target=self._repo.name
            )
        parsed = parse_manifest_or_index(raw, media_type)
        digest = Digest.from_bytes(raw)
        resp = self.put(raw, media_type, digest)
        if tag:
            self.put(raw, media_type, tag)
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
        raw, media_type, _ = self.get(str(descriptor.digest))
        self.put(raw, media_type, tag)
