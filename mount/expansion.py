"""The budget a snapshot's tar layers expand into, and the refusal when one crosses it.

Tar layers expand when the snapshot is built, by an amount only their headers tell (a hostile
layer can claim little and write much). ``expansion_room`` gives extraction what is left of the
quota and the free space as one budget; ``expansion_refused`` turns crossing it into the same
typed refusal (``QuotaExceededError`` / ``InsufficientSpaceError``) as a download that would not
fit. Split from ``mount.pull``, which calls both around ``Snapshots.build``.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from modelpack.errors import CacheError, ExpansionLimitError, InsufficientSpaceError, QuotaExceededError
from modelpack.oci.descriptor import Manifest
from modelpack.transfer.layer_formats import has_tar_layers

#: (bytes left, "quota" | "disk_full", used or free, limit or reserve)
Room = tuple[int, str, int, int]


def expansion_room(
    manifest: Manifest,
    root: str,
    *,
    reserve_bytes: int,
    max_cache_bytes: int | None,
    usage: Callable[[], int],
) -> Room | None:
    """What tar layers may still write: (bytes, "quota"|"disk_full", used or free, limit or
    reserve) for the tighter of the quota and the free space; None without tar layers."""
    if not has_tar_layers(manifest):
        return None
    st = os.statvfs(root)
    free = st.f_bavail * st.f_frsize
    rooms = [(max(0, free - reserve_bytes), "disk_full", free, reserve_bytes)]
    if max_cache_bytes is not None:
        used = usage()
        rooms.append((max(0, max_cache_bytes - used), "quota", used, max_cache_bytes))
    return min(rooms)


def expansion_refused(
    exc: ExpansionLimitError,
    room: Room | None,
    ev: Callable[..., None],
    digest: str,
    root: str,
) -> CacheError:
    """A tar layer expanding past the quota or the free space: the typed refusal, as if the
    expanded size had been known before the download."""
    if room is None:  # pragma: no cover - a cap is always given when tar layers are present
        return CacheError(str(exc))
    left, reason, have, limit = room
    needed = left - exc.left + exc.declared  # expanded so far + the member that did not fit
    quota = reason == "quota"
    room_fields = {"used": have, "quota": limit} if quota else {"available": have, "reserve": limit}
    ev("cache.refused", digest=digest, reason=reason, bytes=needed, **room_fields, detail=str(exc))
    cls = QuotaExceededError if quota else InsufficientSpaceError
    return cls(root, needed, have, limit)


def describe_room(room: Room | None, root: str) -> str:
    """The limit a refused expansion names: the quota or the free space, with the numbers."""
    if room is None:
        return "the limit"
    if room[1] == "quota":
        return f"the node cache quota (--max-cache-bytes {room[3]}, {room[2]} bytes used)"
    return f"the free space on {root} ({room[2]} bytes free, {room[3]} reserved)"
