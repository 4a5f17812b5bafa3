"""One repository's API on one registry: its URL paths, the token scopes a call needs, counters.

Shared by the target's blob reads, uploads and manifest calls, so that the first write upgrades
the scope of every later call (one ``pull,push`` token serves the whole push) and all of them
count into one ``stats``.
"""

from __future__ import annotations

import threading

from modelpack.targets.registry.client import RegistryClient


class RepositoryAPI:
    """``name`` is ``host/repository``: what errors and logs show (never credentials)."""

    def __init__(self, client: RegistryClient, repository: str, *, for_write: bool = False) -> None:
        self.client = client
        self.repository = repository
        self.name = f"{client.host}/{repository}"
        self._write = for_write
        self.stats = {
            "uploaded": 0,
            "mounted": 0,
            "skipped": 0,
            "resumed": 0,
            "bytes_sent": 0,
            "read_resumes": 0,
            "upload_retries": 0,
        }
        self._stats_lock = threading.Lock()

    def scopes(self, *, push: bool = False) -> tuple[str, ...]:
        """``pull`` until the first write (or when opened for writing), then ``pull,push`` for
        everything, so one token serves the whole push and a pull-only token gets upgraded."""
        if push:
            self._write = True
        actions = "pull,push" if self._write else "pull"
        return (f"repository:{self.repository}:{actions}",)

    def path(self, kind: str, ref: str = "") -> str:
        return f"/v2/{self.repository}/{kind}/{ref}" if ref else f"/v2/{self.repository}/{kind}/"

    def count(self, key: str, n: int = 1) -> None:
        with self._stats_lock:
            self.stats[key] += n
