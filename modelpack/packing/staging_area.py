"""Where packing writes what it makes on the way (re-sharded files, image-variant tars), and how
what a killed run left there is swept.

A pack or push that re-shards (``--max-file-size``) or builds the image-shaped variant
(``--format image``) writes model-sized files before it uploads them. Each run's files live in a
staging directory of its own, ``.modelpack-<kind>-XXXX``, under one root: the OCI layout being
packed into, else ``$MODELPACK_STAGING_DIR``, else ``$TMPDIR/modelpack-staging-<uid>`` (0700).
Its owner holds an ``flock`` on the directory for as long as it lives; the lock dies with the
process, ``kill -9`` included. Every run first sweeps the staging directories under its root
that nobody holds (and are older than a minute, so a directory is never taken from a run that
has just made it), so SIGKILL leftovers go at the next run; SIGTERM and Ctrl-C remove their own
on the way out.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
import threading
import time

from modelpack import settings

PREFIX = ".modelpack-"
#: the kinds of staging directory packing makes (only these are ever swept)
KINDS = ("reshard", "image", "asset")  # asset: modelpack.assets' packed compile caches
#: a staging directory younger than this is never swept (its owner may not hold it yet)
MIN_AGE_S = 2.0

_held: dict[str, int] = {}
_held_lock = threading.Lock()


def staging_root(parent: str | None = None) -> str:
    """The directory staging directories are made in (created 0700 when it is the default)."""
    if parent:
        return parent
    explicit = settings.STAGING_DIR.get()
    root = explicit or os.path.join(tempfile.gettempdir(), f"modelpack-staging-{os.geteuid()}")
    os.makedirs(root, mode=0o700, exist_ok=True)
    return root


def make_staging_dir(kind: str, parent: str | None = None) -> str:
    """A new staging directory, held by this process until ``remove_staging_dir``; sweeps the
    dead ones under the same root first."""
    root = staging_root(parent)
    sweep_staging(root)
    path = tempfile.mkdtemp(prefix=f"{PREFIX}{kind}-", dir=root)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    fcntl.flock(fd, fcntl.LOCK_EX)
    with _held_lock:
        _held[path] = fd
    return path


def remove_staging_dir(path: str | None) -> None:
    """Remove a staging directory this process made, then let go of it."""
    if not path:
        return
    shutil.rmtree(path, ignore_errors=True)
    with _held_lock:
        fd = _held.pop(path, None)
    if fd is not None:
        os.close(fd)


def sweep_staging(root: str) -> list[str]:
    """Remove the staging directories under ``root`` whose owner is gone; returns them."""
    removed: list[str] = []
    now = time.time()
    try:
        entries = list(os.scandir(root))
    except OSError:
        return removed
    for entry in entries:
        if not entry.name.startswith(tuple(f"{PREFIX}{k}-" for k in KINDS)):
            continue
        if not entry.is_dir(follow_symlinks=False):
            continue
        try:
            if now - entry.stat(follow_symlinks=False).st_mtime < MIN_AGE_S:
                continue
            fd = os.open(entry.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # a live run holds it
            with contextlib.suppress(OSError):
                shutil.rmtree(entry.path)
                removed.append(entry.path)
        finally:
            os.close(fd)
    return removed


__all__ = ["make_staging_dir", "remove_staging_dir", "staging_root", "sweep_staging"]
