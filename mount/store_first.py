"""A readable target whose blobs land in the node cache's store before anyone reads them.

For a transfer that writes somewhere else but should leave the node cache warmer (the KServe
storage initializer's file-filtered download into DEST, which cannot publish a snapshot of a
partial model): each blob asked for is ingested first (``BlobIngest.ingest``: the digest lock,
the resumable ``ingest/<hex>.partial``, the one blob writer's size and sha256 check, the atomic
commit; a blob already committed, or committed by a waiter's holder, is not fetched), then
served from the committed file. One registry read serves the destination and the cache; the
snapshot is left to a full pull, which finds these blobs committed.

Use it inside ``PullLeases.hold`` for the manifest's digests, so GC leaves the fresh blobs alone
until the caller is done.
"""

from __future__ import annotations

import os
from typing import Any, BinaryIO

from modelpack.mount.ingest import BlobIngest
from modelpack.mount.store import Store

from modelpack.errors import StoreError
from modelpack.oci.descriptor import Descriptor
from modelpack.targets.base import ReadableTarget


class StoreFirstTarget:
    """``inner`` for everything but blobs; a blob is committed to ``store`` first, then read."""

    def __init__(self, inner: ReadableTarget, store: Store, blobs: BlobIngest) -> None:
        self._inner = inner
        self.store = store
        self.blobs = blobs
        self.name = inner.name
        #: digest → bytes fetched from ``inner`` by this target (0: it was committed already)
        self.ingested: dict[str, int] = {}

    def _committed(self, descriptor: Descriptor) -> BinaryIO:
        result = self.blobs.ingest(descriptor, self._inner)
        self.ingested[str(descriptor.digest)] = result.downloaded
        path = self.store.blob_path(descriptor.digest)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise StoreError(
                f"{path}: committed blob {descriptor.digest} cannot be opened: {exc.strerror}"
            ) from exc
        return os.fdopen(fd, "rb")

    def fetch_blob(self, descriptor: Descriptor, offset: int = 0) -> BinaryIO:
        f = self._committed(descriptor)
        if offset:
            f.seek(offset)
        return f

    def fetch_range(self, descriptor: Descriptor, offset: int, length: int) -> bytes:
        with self._committed(descriptor) as f:
            f.seek(offset)
            return f.read(length)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


__all__ = ["StoreFirstTarget"]
