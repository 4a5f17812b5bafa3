"""Reader leases on the adapter snapshots a running engine serves.

A base model's snapshot is leased while the loader reads it; vLLM then holds the weights in
memory. A LoRA adapter is different: vLLM reads its files when it loads it and again whenever it
reloads it (its CPU cache holds ``--max-cpu-loras``), for as long as it serves it. So each
adapter path that is a node-cache snapshot holds that snapshot's reader lease (a shared flock on
``snapshots/<hex>.lease``, ``mount.snapshots``) from the moment the engine loads it until it
unloads it or the process ends (the kernel drops the flock with the process, so a killed engine
leaves nothing behind). ``cache gc`` and ``cache rm`` leave a leased snapshot alone.

A path that looks like a snapshot (``…/snapshots/<64 hex>``) but is not ready in its cache (gc
removed it after ``cache lora-args`` printed it) fails the load: an engine never serves an
adapter it could not lease. Any other directory (a plain PEFT directory) takes no lease.

The vLLM plugin (``serving.vllm_plugin``) calls ``ENGINE_ADAPTER_LEASES.take`` for each adapter
the OpenAI server loads (``--lora-modules`` at start and the load endpoint), ``keep_only`` once
vLLM serves it (a reload from another snapshot releases the old one only then), and ``release``
when it unloads one.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from typing import Any

from modelpack.errors import NotFoundError

_HEX = re.compile(r"[0-9a-f]{64}")


def snapshot_digest_of(path: str) -> tuple[str, str] | None:
    """``(cache root, manifest digest)`` when ``path`` (symlinks resolved) is a node-cache
    snapshot path ``ROOT/snapshots/<hex>``, else None."""
    real = os.path.realpath(path)
    parent = os.path.dirname(real)
    if not _HEX.fullmatch(os.path.basename(real)) or os.path.basename(parent) != "snapshots":
        return None
    return os.path.dirname(parent), "sha256:" + os.path.basename(real)


class AdapterLeases:
    """The leases one serving process holds, by the name it serves each adapter under (a name
    may briefly hold two snapshots: the one it serves and the one it is reloading from)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[str, dict[str, contextlib.AbstractContextManager[Any]]] = {}

    def take(self, name: str, path: str) -> str | None:
        """Lease the snapshot at ``path`` for ``name``; returns its digest, or None when ``path``
        is not a node-cache snapshot. A snapshot that is not ready (removed, never published) is
        ``NotFoundError`` naming the path. Leases ``name`` already holds stay (``keep_only``
        drops them once the engine serves the new one)."""
        found = snapshot_digest_of(path)
        if found is None:
            return None
        root, digest = found
        with self._lock:
            if digest in self._held.get(name, {}):
                return digest
        from modelpack.mount.snapshots import Snapshots
        from modelpack.mount.store import Store

        try:
            lease = Snapshots(Store(root, create=False)).lease(digest)
            lease.__enter__()
        except NotFoundError as exc:
            raise NotFoundError(
                f"adapter {name}: {path} is not ready in its node cache ({exc}); it was removed after "
                f"its path was printed, or never pulled: pull it again with 'modelpack pull --cache {root} "
                f"BASE --adapter REF@{digest} --hold 10m'"
            ) from None
        with self._lock:
            self._held.setdefault(name, {})[digest] = lease
        return digest

    def keep_only(self, name: str, digest: str | None) -> None:
        """``name`` is served from ``digest`` now (None: from a directory that is no snapshot):
        release its other leases."""
        with self._lock:
            mine = self._held.get(name, {})
            gone = [mine.pop(d) for d in list(mine) if d != digest]
            if not mine:
                self._held.pop(name, None)
        for lease in gone:
            lease.__exit__(None, None, None)

    def release(self, name: str, digest: str | None = None) -> bool:
        """End the lease ``name`` holds on ``digest`` (None: every lease of ``name``); True if
        there was one."""
        with self._lock:
            mine = self._held.get(name, {})
            gone = [mine.pop(d) for d in list(mine) if digest is None or d == digest]
            if not mine:
                self._held.pop(name, None)
        for lease in gone:
            lease.__exit__(None, None, None)
        return bool(gone)

    def held(self) -> dict[str, list[str]]:
        """Name → the digests leased for it now."""
        with self._lock:
            return {name: sorted(mine) for name, mine in self._held.items()}


#: the serving process's leases (the vLLM plugin's)
ENGINE_ADAPTER_LEASES = AdapterLeases()

__all__ = ["ENGINE_ADAPTER_LEASES", "AdapterLeases", "snapshot_digest_of"]
