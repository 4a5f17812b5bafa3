"""Node cache: content-addressed store, verified ingest, locks, snapshots, GC, Kubernetes manifests.

Entry point: ``NodeCache(root).pull(reference, …) -> PullResult`` and ``NodeCache.open_snapshot``.
"""

from modelpack.mount.cache import GCResult, NodeCache, PullResult, default_cache_dir

from modelpack.errors import CacheError, InsufficientSpaceError, QuotaExceededError

__all__ = [
    "CacheError",
    "GCResult",
    "InsufficientSpaceError",
    "NodeCache",
    "PullResult",
    "QuotaExceededError",
    "default_cache_dir",
]
