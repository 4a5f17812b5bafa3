"""The one abstraction for every place an artifact lives (after oras-go's ``Target``).

A ``ReadableTarget`` resolves tags, hands out exact manifest bytes and streams blobs; a
``Target`` can also take blobs and manifests. Backings: OCI layout directory
(``modelpack.targets.layout``), registry (``modelpack.targets.registry``), S3 (``modelpack.targets.s3``), and the in-memory
view of a checkpoint being packed (``modelpack.packing.packer``). Targets never verify on behalf of the
caller except where noted: the copy engine wraps every read in a ``VerifyingReader``.

What only some backings can do is a named capability Protocol, checked with ``isinstance`` (as
oras-go's ``content.Fetcher``/``registry.ReferrerLister`` and go-containerregistry's
``remote.Mountable``), never probed by attribute name: mypy sees the call, and a backing that
loses a method loses the capability in ``tests/targets/test_capabilities.py``, not silently at run time.
A wrapper target (``CountingTarget``) declares the capabilities it forwards as methods: Python
3.12 checks Protocols with ``inspect.getattr_static``, which does not see ``__getattr__``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO, Protocol, runtime_checkable

from modelpack.oci.descriptor import Descriptor


@dataclass(frozen=True)
class BlobSource:
    """Where the bytes of a blob being pushed come from.

    ``open(offset)`` returns a fresh stream positioned at ``offset`` (resumable uploads need it).
    ``local_path``, when set, is a local file whose whole content is the blob. ``verified`` says
    this process hashed that very file to ``descriptor`` (the packer does); only then may a writer
    reflink/hard-link it instead of streaming it through a digest check.
    """

    descriptor: Descriptor
    opener: Callable[[int], BinaryIO]
    local_path: str | None = None
    verified: bool = False
    #: raises if ``local_path`` is no longer the file that was hashed; a writer that links or
    #: copies it calls this once the copy is in place, before publishing it
    recheck: Callable[[], None] | None = None
    #: an open descriptor of the file that was hashed (a pack input): a writer links or copies
    #: from it (``files.link_or_copy_fd``), never from ``local_path``, a name that may have moved
    fileno: int | None = None

    def open(self, offset: int = 0) -> BinaryIO:
        return self.opener(offset)


def file_blob_source(
    descriptor: Descriptor,
    path: str | os.PathLike[str],
    *,
    verified: bool = False,
    recheck: Callable[[], None] | None = None,
) -> BlobSource:
    p = os.fspath(path)

    def opener(offset: int) -> BinaryIO:
        f = open(p, "rb")
        if offset:
            f.seek(offset)
        return f

    return BlobSource(descriptor=descriptor, opener=opener, local_path=p, verified=verified, recheck=recheck)


def bytes_blob_source(descriptor: Descriptor, data: bytes) -> BlobSource:
    import io

    return BlobSource(descriptor=descriptor, opener=lambda offset: io.BytesIO(data[offset:]))


@runtime_checkable
class ReadableTarget(Protocol):
    """Read side of a target. ``name`` identifies it in errors and events (never with credentials)."""

    name: str

    def resolve(self, reference: str) -> Descriptor:
        """Tag or ``sha256:`` digest → the manifest's descriptor. Raises NotFoundError."""
        ...

    def fetch_manifest(self, reference: str) -> tuple[bytes, str]:
        """Exact manifest (or index) bytes and media type, by tag or digest. Digest refs are verified."""
        ...

    def fetch_blob(self, descriptor: Descriptor, offset: int = 0) -> BinaryIO:
        """A stream of the blob from ``offset``; the caller verifies (see ``VerifyingReader``)."""
        ...

    def fetch_range(self, descriptor: Descriptor, offset: int, length: int) -> bytes:
        """Exactly ``length`` bytes at ``offset`` (unverified: ranges cannot be checked alone)."""
        ...

    def exists(self, descriptor: Descriptor) -> bool:
        """Whether the blob (or manifest, by digest) is present with that size."""
        ...

    def list_tags(self) -> Iterator[str]: ...

    def referrers(self, subject: Descriptor, artifact_type: str | None = None) -> list[Descriptor]:
        """Manifests whose ``subject`` is ``subject`` (OCI 1.1), optionally of one artifact type."""
        ...


@runtime_checkable
class Target(ReadableTarget, Protocol):
    def push_blob(self, source: BlobSource) -> None:
        """Store a blob, checking size and digest of the bytes as they stream (or trusting a
        ``verified`` local file); a failed check leaves nothing visible and raises."""
        ...

    def push_manifest(self, raw: bytes, media_type: str, tag: str | None = None) -> Descriptor:
        """Store exact manifest bytes (by digest) and, if given, point ``tag`` at them."""
        ...

    def tag(self, descriptor: Descriptor, tag: str) -> None: ...


#: ``check(offset, data)`` → the (offset, length) of each whole chunk in ``data`` that is wrong
#: (the signed chunk table's check, run on a range as it arrives)
RangeCheck = Callable[[int, bytes], list[tuple[int, int]]]
#: (offset, length) of the chunk of a signed chunk table holding a byte offset of one layer
ChunkBounds = Callable[[int], tuple[int, int]]


@runtime_checkable
class LocalBlobSource(Protocol):
    """Hands out a blob as a ``BlobSource`` with a local path (an OCI layout, a checkpoint being
    packed), so a writer on the same machine may link or copy the file instead of streaming it."""

    def blob_source(self, descriptor: Descriptor) -> BlobSource: ...


@runtime_checkable
class BlobFiles(Protocol):
    """Keeps every blob as a file on this machine at ``blob_path(digest)`` (an OCI layout, the
    node cache's store): a reader may map the file instead of fetching ranges."""

    def blob_path(self, digest: str) -> str: ...


@runtime_checkable
class BlobMounter(Protocol):
    """A registry repository that can take a blob by cross-repository mount instead of upload
    (OCI distribution ``POST /blobs/uploads/?mount=&from=``; go-containerregistry's ``Mountable``)."""

    repository: str

    @property
    def registry_host(self) -> str:
        """The API host: only repositories on the same host can be mounted from."""
        ...

    def try_mount(self, descriptor: Descriptor, src: object) -> bool:
        """Mount from ``src`` when it is a repository of the same registry; False otherwise."""
        ...

    def try_mount_from(self, descriptor: Descriptor, repository: str) -> bool:
        """Mount from ``repository`` of this registry; False when the registry will not."""
        ...


@runtime_checkable
class SourceAccounting(Protocol):
    """Counts the blob bytes each source (mirror or origin host) delivered."""

    def bytes_by_source(self) -> dict[str, int]: ...


@runtime_checkable
class CheckedRangeFetcher(Protocol):
    """Fetches a range with ``check`` run on it, refetching the chunks a mirror got wrong from the
    next source (a plain ``fetch_range`` cannot tell which source was wrong)."""

    def fetch_range_checked(
        self, descriptor: Descriptor, offset: int, length: int, check: RangeCheck
    ) -> bytes: ...


@runtime_checkable
class VerifiedSpooler(Protocol):
    """Hands out a whole blob only once its bytes matched the digest, asked of its mirrors first
    (a liar's bytes sent to the next source, then the origin): what a reader needs that cannot
    check a range on its own (no chunk table) and must not read a range from a source that may
    lie. None: no mirror could serve it, so the origin is read by ranges as usual."""

    def fetch_blob_spooled(self, descriptor: Descriptor) -> BinaryIO | None: ...


class ChunkTableLike(Protocol):
    """What a blob reader needs of a verified signed chunk table (``signing.chunks.ChunkTable``)."""

    @property
    def chunk_size(self) -> int: ...

    @property
    def layers(self) -> Mapping[str, Any]: ...

    def range_check(self, layer_digest: str) -> RangeCheck: ...

    def chunk_at(self, layer_digest: str, offset: int) -> tuple[int, int]: ...


@runtime_checkable
class ChunkCheckedSpools(Protocol):
    """Checks the whole-blob spools its mirrors serve chunk by chunk against a chunk table the
    caller verified (a liar is dropped at its first wrong chunk, not at the blob's last byte)."""

    def use_chunk_table(self, table: ChunkTableLike) -> None: ...


@runtime_checkable
class RangeIntoFetcher(Protocol):
    """Receives a range straight into caller memory (``views`` filled in order), with no copy."""

    def fetch_range_into(
        self,
        descriptor: Descriptor,
        offset: int,
        views: Sequence[memoryview],
        check: RangeCheck | None = None,
    ) -> None: ...


@runtime_checkable
class MultiRangeFetcher(Protocol):
    """A target that fills many disjoint ranges of one blob in few requests (a column-split share's rows)."""

    @property
    def multi_range(self) -> bool:
        """Whether ``fetch_ranges_into`` reads the ranges from the one source it names (False where reads go
        through mirrors or peers, whose wrong bytes must be refetched from the next source, which only the
        contiguous chunk-checked path does)."""
        ...

    def fetch_ranges_into(
        self, descriptor: Descriptor, ranges: Sequence[tuple[int, int]], views: Sequence[memoryview]
    ) -> int:
        """Fill ``views[i]`` with the ``ranges[i] = (offset, length)`` bytes of the blob (ascending,
        non-overlapping, ``len(views[i]) == length``). Returns the bytes fetched from the source: the sum of
        the lengths, or more where the source ignored a multi-range request and covering ranges were read."""
        ...


@runtime_checkable
class Catalog(Protocol):
    """Lists the repositories of a whole registry (``/v2/_catalog``; go-containerregistry's
    ``remote.Catalog``)."""

    def catalog(self, page_size: int = 1000) -> Iterator[str]: ...


@runtime_checkable
class Closable(Protocol):
    """Holds something (connections, a paged listing) that ``close()`` releases early."""

    def close(self) -> None: ...
