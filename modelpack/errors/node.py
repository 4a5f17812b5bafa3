"""Errors of the node cache (mount), its peers' endpoint and the Kubernetes integrations."""

from __future__ import annotations

from modelpack.errors.base import ModelpackError
from modelpack.exit_codes import ExitCode


class LockTimeoutError(ModelpackError):
    """A lock could not be taken in time; names the lock file and its last holder."""


class StoreError(ModelpackError):
    """The cache store is damaged or cannot be written."""


class CacheServeError(ModelpackError):
    """``cache serve`` cannot start: TLS files that do not load, an address that cannot be bound."""

    exit_code = ExitCode.USAGE


class SnapshotError(ModelpackError):
    """A snapshot cannot be built, published or used."""


class SnapshotInUseError(SnapshotError):
    """A reader holds the snapshot's lease; it cannot be removed now."""


class CacheError(ModelpackError):
    """A node-cache operation that cannot proceed; the message names the cache, reference or digest."""


class EventLogError(ModelpackError):
    """An event log file that cannot take events: a symlink, another user's file, a read-only or
    special file, a write that failed. Names the file."""


class InsufficientSpaceError(CacheError):
    """Not enough free space on the cache filesystem for the blobs still to download."""

    def __init__(self, root: str, needed: int, available: int, reserve: int) -> None:
        super().__init__(
            f"{root}: {needed} bytes to download but only {available} bytes free"
            + (f" ({reserve} reserved)" if reserve else "")
            + "; free space or run 'modelpack cache gc'"
        )
        self.needed = needed
        self.available = available


class QuotaExceededError(CacheError):
    def __init__(self, root: str, needed: int, used: int, quota: int) -> None:
        super().__init__(
            f"{root}: pulling needs {needed} more bytes; cache holds {used} of a {quota}-byte quota "
            "(--max-cache-bytes); run 'modelpack cache gc --max-bytes …' or raise the quota"
        )
        self.needed = needed
        self.used = used
        self.quota = quota


class K8sError(ModelpackError):
    """A Kubernetes object cannot be generated from the given inputs."""


class StorageInitializerError(ModelpackError):
    """KServe's storage initializer was started with argv pairs or settings it cannot use (an odd
    argument count, a setting that does not parse, a policy or docker config named but not
    mounted); names the argument or environment variable."""

    exit_code = ExitCode.USAGE
