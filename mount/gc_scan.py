"""What GC knows before it takes the lock: one linear pass over the cache, with no lock held.

Everything here is read once per GC, outside ``locks/gc.lock`` (pulls wait for that lock to
register, so nothing slow happens under it): every ready marker, each snapshot's lease (mtime and
holders), pins, the size of every blob, the blobs each stored manifest keeps alive, and the
snapshot directories that have no marker, and which ``index.json`` entries are kept signature
referrers (of which model) or pinned manifests a node fills for its peers. Facts that can change before GC acts on them are
checked again under the lock for the chosen victims only (``mount.gc``); facts that cannot (what a
manifest digest references) are reused.

Two rules live here because scan and re-check must agree on them:

- **Whose lease counts** (``lease_blocks_eviction``). A reader lease held by the cache owner or
  root keeps a snapshot however long it is held. A lease held only by processes of other uids (a
  serving container of another user; anyone who can read the cache can take a shared flock on a
  ``0644`` lease), or by holders GC cannot identify (another pid namespace), keeps it only
  ``foreign_lease_s`` seconds (default 1 hour) past the owner's last use: it cannot pin a model
  against GC forever. Such readers keep the files they already opened; pin a model they need.
- **Clock steps** (``clamped_last_use``). A last use in the future (the clock stepped back after
  it was recorded) counts as now, and is rewritten as now, so it ages from the first GC that sees
  it instead of never reaching ``min_age``.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field

from modelpack.mount.assets import version_kind
from modelpack.mount.kept_referrers import SUBJECT_ANNOTATION
from modelpack.mount.refs import Pins
from modelpack.mount.snapshots import MARKER_SUFFIX, SnapshotInfo, Snapshots, tree_bytes
from modelpack.mount.store import Store

from modelpack.errors import ModelpackError
from modelpack.oci.descriptor import Index, parse_manifest_or_index

DEFAULT_FOREIGN_LEASE_S = 3600.0
# a recorded use this far ahead of the clock is a clock step, not a use "just now"
CLOCK_SKEW_S = 1.0


@dataclass
class ScannedSnapshot:
    """One ready snapshot as GC sees it."""

    info: SnapshotInfo
    digest: str
    last_used: float
    pinned: bool
    holders: list[int | None] | None  # None: no reader holds the lease
    kind: tuple[str, str]  # (repository, artifact kind): what keep_versions counts versions of
    blobs: frozenset[str]  # the blobs (and manifest) it keeps alive
    extracted: int  # bytes of files that are not hard links of blobs


@dataclass
class CacheScan:
    """The cache at one moment, read without the GC lock."""

    now: float
    snapshots: list[ScannedSnapshot] = field(default_factory=list)  # least recently used first
    blob_sizes: dict[str, int] = field(default_factory=dict)
    #: snapshots/<hex> without a marker: digest -> (path, bytes its removal frees)
    unmarked_dirs: dict[str, tuple[str, int]] = field(default_factory=dict)
    manifest_blobs: dict[str, frozenset[str]] = field(default_factory=dict)  # every index.json entry
    subjects: dict[str, str] = field(default_factory=dict)  # kept referrer -> the model it signs
    pinned_manifests: set[str] = field(default_factory=set)  # index entries pinned (fills included)

    @property
    def ready(self) -> set[str]:
        return {s.digest for s in self.snapshots}

    def bytes_used(self, store: Store) -> int:
        """Blobs + partial downloads (as ``usage``) + extracted files, from this scan."""
        ingest = 0
        with contextlib.suppress(OSError):
            for entry in os.scandir(store.ingest_dir):
                with contextlib.suppress(FileNotFoundError):
                    ingest += entry.stat(follow_symlinks=False).st_size
        return sum(self.blob_sizes.values()) + ingest + sum(s.extracted for s in self.snapshots)


def lease_blocks_eviction(
    holders: list[int | None] | None, owner: int, last_used: float, now: float, foreign_lease_s: float
) -> bool:
    """Whether the readers holding a snapshot's lease keep it from GC now (module docstring)."""
    if not holders:
        return False
    if any(uid is not None and uid in (owner, 0) for uid in holders):
        return True
    return now - last_used < foreign_lease_s


def clamped_last_use(
    snapshots: Snapshots, digest: str, last_used: float, now: float, *, rewrite: bool
) -> float:
    """``last_used``, or now when it lies in the future; ``rewrite`` records now on the lease."""
    if last_used <= now + CLOCK_SKEW_S:
        return last_used
    if rewrite:
        with contextlib.suppress(OSError):
            snapshots.touch(digest)
    return now


def manifest_blobs(store: Store, digest: str) -> frozenset[str]:
    """Digests a stored manifest keeps alive (itself, config, layers); content-addressed, so the
    answer for a digest never changes."""
    try:
        parsed = parse_manifest_or_index(store.read_small(digest))
    except (OSError, ModelpackError):
        return frozenset({digest})
    if isinstance(parsed, Index):
        return frozenset({digest, *(str(m.digest) for m in parsed.manifests)})
    return frozenset({digest, str(parsed.config.digest), *(str(layer.digest) for layer in parsed.layers)})


def scan_cache(store: Store, snapshots: Snapshots, pins: Pins, *, rewrite_clock: bool) -> CacheScan:
    """One pass: O(snapshots + blobs + manifests) reads and stats, no lock held."""
    scan = CacheScan(now=time.time())
    for entry in os.scandir(store.blobs_dir):
        if len(entry.name) == 64 and not entry.name.startswith("."):
            with contextlib.suppress(FileNotFoundError):
                scan.blob_sizes["sha256:" + entry.name] = entry.stat(follow_symlinks=False).st_size
    markers: set[str] = set()
    dirs: list[str] = []
    for entry in os.scandir(snapshots.dir):
        if entry.name.startswith("."):
            continue
        if entry.name.endswith(MARKER_SUFFIX):
            markers.add(entry.name[: -len(MARKER_SUFFIX)])
        elif len(entry.name) == 64 and entry.is_dir(follow_symlinks=False):
            dirs.append(entry.name)
    for hexd in sorted(markers):
        digest = "sha256:" + hexd
        with contextlib.suppress(ModelpackError):
            info = snapshots.ready(digest)
            if info is not None:
                scan.snapshots.append(_scanned(store, snapshots, pins, info, scan, rewrite_clock))
    ready = scan.ready
    for h in dirs:
        if "sha256:" + h not in ready:
            path = snapshots.path("sha256:" + h)
            scan.unmarked_dirs["sha256:" + h] = (path, tree_bytes(path))
    scan.snapshots.sort(key=lambda s: s.last_used)
    for doc in store.index_entries():
        m = doc.get("digest")
        if not isinstance(m, str):
            continue
        scan.manifest_blobs[m] = manifest_blobs(store, m)
        annotations = doc.get("annotations")
        subject = annotations.get(SUBJECT_ANNOTATION) if isinstance(annotations, dict) else None
        if isinstance(subject, str):
            scan.subjects[m] = subject
        elif pins.is_pinned(m):
            scan.pinned_manifests.add(m)
    return scan


def _scanned(
    store: Store, snapshots: Snapshots, pins: Pins, info: SnapshotInfo, scan: CacheScan, rewrite_clock: bool
) -> ScannedSnapshot:
    d = str(info.digest)
    holders = snapshots.lease_holders(d)
    return ScannedSnapshot(
        info=info,
        digest=d,
        last_used=clamped_last_use(snapshots, d, info.last_used, scan.now, rewrite=rewrite_clock),
        pinned=pins.is_pinned(d),
        holders=holders,
        kind=(str(info.meta.get("repository", "")), version_kind(store, d)),
        blobs=frozenset(info.blob_digests() | {d}),
        extracted=sum(f.size for f in info.files if not f.linked),
    )
