"""Where a resumable blob upload stands, saved between runs: one small JSON file per blob.

After each acknowledged chunk the uploader records the session's location and offset, so a push
killed midway resumes there. The files live under ``MODELPACK_UPLOAD_STATE_DIR`` (else the user's
cache dir), one folder per repository (hashed name), mode 0600: a location can carry a session
secret. A state file is data from disk: read bounded, and anything malformed means "no saved
session", never an error.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
from collections.abc import Iterator

from modelpack import boundedjson, settings
from modelpack.errors import DocumentError
from modelpack.files import atomic_write_bytes
from modelpack.oci.digest import Digest


def upload_state_root() -> str:
    explicit = settings.UPLOAD_STATE_DIR.get()
    if explicit:
        return explicit
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "modelpack", "uploads")


class UploadState:
    """The saved sessions of one repository's uploads."""

    def __init__(self, repository: str, root: str | None = None) -> None:
        self.repository = repository
        self.directory = os.path.join(
            root or upload_state_root(), hashlib.sha256(repository.encode()).hexdigest()[:32]
        )

    def path(self, digest: str) -> str:
        return os.path.join(self.directory, Digest(digest).hex + ".json")

    def save(self, digest: str, location: str, offset: int) -> None:
        os.makedirs(self.directory, exist_ok=True)
        doc = {"location": location, "offset": offset, "repository": self.repository}
        atomic_write_bytes(self.path(digest), json.dumps(doc).encode(), mode=0o600)

    def drop(self, digest: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path(digest))

    def load(self, digest: str) -> tuple[str, int] | None:
        path = self.path(digest)
        try:
            with open(path, "rb") as f:
                doc = boundedjson.loads_object(f.read(64 * 1024 + 1), what=path, max_bytes=64 * 1024)
            location, offset = doc["location"], doc["offset"]
            if not isinstance(location, str) or not isinstance(offset, int) or offset < 0:
                return None
            return location, offset
        except (OSError, DocumentError, KeyError):
            return None

    @contextlib.contextmanager
    def lock(self, digest: str) -> Iterator[bool]:
        """Own the saved state of ``digest`` for this upload; False when another process (a
        concurrent push of the same blob) holds it: then upload without saving or resuming."""
        try:
            os.makedirs(self.directory, exist_ok=True)
            fd = os.open(self.path(digest) + ".lock", os.O_CREAT | os.O_RDWR, 0o600)
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
                os.unlink(self.path(digest) + ".lock")
        finally:
            os.close(fd)
