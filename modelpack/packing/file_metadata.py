"""The per-file metadata a pack records: the real mode, a fixed owner and a reproducible mtime.

Clients that restore metadata from ``org.cncf.model.file.metadata+json`` or from tar headers
(modctl, kit, modelpack-client, containerd) apply what is written, so a script packed as 0755
must come back executable and a weight file must not come back 0600: the mode is the file's.
Owner and time are the spec's "known, constant values" (model-spec, Reproducibility): uid/gid 0
and, for the mtime, ``SOURCE_DATE_EPOCH`` (reproducible-builds.org) when it is set, else the
epoch — so the same directory packs to the same digest on every machine and in every checkout.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping

from modelpack.errors import PackError

#: files from places without POSIX modes (S3 objects) and the regenerated shard index
DEFAULT_MODE = 0o644
EPOCH_RFC3339 = "1970-01-01T00:00:00Z"


def file_mode(st_mode: int) -> int:
    """The permission bits worth recording: rwx for owner, group and others. setuid, setgid and
    sticky are dropped (no model file needs them, and a pull must never create them)."""
    return stat.S_IMODE(st_mode) & 0o777


def file_identity(st: os.stat_result) -> tuple[int, int, int, int, int]:
    """What says a file is still the one that was hashed: device, inode, size, mtime (ns) and mode.
    A file replaced by a new one (a new inode), rewritten in place (mtime), grown or chmod-ed (the
    mode is recorded) compares unequal. Not ctime: hard-linking the file into a layout changes it."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_mode)


def source_date_epoch(environ: Mapping[str, str] | None = None) -> int:
    """``SOURCE_DATE_EPOCH`` as seconds, 0 when unset; a value that is not a non-negative integer
    is refused (reproducible-builds.org says tools must not guess)."""
    env = os.environ if environ is None else environ
    text = env.get("SOURCE_DATE_EPOCH", "").strip()
    if not text:
        return 0
    if not text.isdigit() or int(text) > 253402300799:  # 9999-12-31T23:59:59Z
        raise PackError(
            f"SOURCE_DATE_EPOCH={text[:40]!r} is not a number of seconds since 1970-01-01 (UTC); "
            "set it to an integer such as $(git log -1 --format=%ct), or unset it"
        )
    return int(text)


__all__ = ["DEFAULT_MODE", "EPOCH_RFC3339", "file_identity", "file_mode", "source_date_epoch"]
