"""Re-hash cached snapshots against their manifests on demand; a damaged one is unpublished.

A hit trusts the ready marker and hashes nothing, so this is where damage after publishing
(disk errors, someone writing into the store or the snapshot, an edited marker) is found. The
truth is the manifest in the store, checked against its digest (the snapshot's name): the files
it implies (``mount.contents``) must be exactly what the marker lists and exactly what the
directory holds, each with the manifest's digest and size, read-only and the cache owner's. A
planted file, a file dropped from the marker, an edited marker entry or blob list: all damage.
Repair goes in an order that a kill at any step cannot undo: first every blob found corrupt is
moved out of ``blobs/`` into ``quarantine/`` (one rename each, fsynced), so no later pull can
link it into a snapshot again; then the ready marker is removed, so no reader trusts the
snapshot; then the snapshot's files. A verify killed between the first two steps leaves a marker
over a quarantined blob: the next pull (``mount.pull``) and the next verify see the quarantine
and finish the repair.
"""

from __future__ import annotations

import contextlib
import os
import stat
import time

from modelpack.mediatypes.annotations import safe_relative_path
from modelpack.mount.contents import ExpectedFile, expected_files
from modelpack.mount.modes import untrusted_reason
from modelpack.mount.reports import VerifyReport, to_ms
from modelpack.mount.snapshots import SnapshotInfo, Snapshots
from modelpack.mount.store import Store

from modelpack.errors import ModelpackError, SnapshotInUseError, UnsafePathError
from modelpack.events import EventLog
from modelpack.oci.descriptor import Manifest
from modelpack.oci.digest import sha256_file, verify_bytes
from modelpack.transfer.layer_formats import needs_config


def _manifest(store: Store, info: SnapshotInfo) -> Manifest:
    raw = store.read_small(info.digest)
    verify_bytes(raw, info.digest, None, what="manifest", source=store.root)
    return Manifest.parse(raw)


def _expected(store: Store, manifest: Manifest) -> dict[str, ExpectedFile]:
    config_raw = None
    if needs_config(manifest):
        config_raw = store.read_small(manifest.config.digest)
        verify_bytes(config_raw, manifest.config.digest, manifest.config.size, what="image config")
    return expected_files(manifest, store, config_raw)


def _marker_problems(info: SnapshotInfo, manifest: Manifest, expected: dict[str, ExpectedFile]) -> list[str]:
    """The marker against the manifest: same files, same digests and sizes, same blobs."""
    problems = []
    listed = {f.path: f for f in info.files}
    if len(listed) != len(info.files):
        problems.append("ready marker lists a path twice")
    for path in sorted(expected.keys() - listed.keys()):
        problems.append(f"{path}: in the manifest but missing from the ready marker")
    for path in sorted(listed.keys() - expected.keys()):
        problems.append(f"{path}: listed in the ready marker but not in the manifest")
    for path in sorted(listed.keys() & expected.keys()):
        m, e = listed[path], expected[path]
        if (m.digest, m.size, m.linked) != (e.digest, e.size, e.linked):
            problems.append(
                f"{path}: the ready marker says {m.digest} ({m.size} B), the manifest {e.digest} ({e.size} B)"
            )
    blobs = {str(manifest.config.digest), *(str(layer.digest) for layer in manifest.layers)}
    if set(info.meta.get("blobs", [])) != blobs:
        problems.append("ready marker: its blob list differs from the manifest's config and layers")
    return problems


def _disk_problems(
    info: SnapshotInfo, truth: dict[str, ExpectedFile], owner: int, report: VerifyReport
) -> set[str]:
    """The directory against ``truth``: nothing more, nothing less, every byte; returns bad blobs."""
    bad_blobs: set[str] = set()
    for dirpath, dirnames, filenames in os.walk(info.path):
        for name in [*dirnames, *filenames]:
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, info.path).replace(os.sep, "/")
            st = os.lstat(full)
            if stat.S_ISDIR(st.st_mode):
                reason = untrusted_reason(st, owner)
                if reason:
                    report.problems.append(f"{rel}/: {reason}")
                continue
            if rel not in truth:
                report.problems.append(f"{rel}: not in the manifest (a file added to the snapshot)")
            elif not stat.S_ISREG(st.st_mode):
                report.problems.append(f"{rel}: not a regular file")
    for rel, f in sorted(truth.items()):
        p = os.path.join(info.path, *rel.split("/"))
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            report.problems.append(f"{rel}: missing")
            continue
        if not stat.S_ISREG(st.st_mode):
            continue  # reported above
        reason = untrusted_reason(st, owner, read_only=True)
        if reason:
            report.problems.append(f"{rel}: {reason}")
        actual, size = sha256_file(p)
        report.bytes += size
        if actual != f.digest or size != f.size:
            report.problems.append(f"{rel}: expected {f.digest} ({f.size} B), got {actual} ({size} B)")
            if f.linked:
                bad_blobs.add(f.digest)
    return bad_blobs


def verify_snapshots(
    infos: list[SnapshotInfo], store: Store, snapshots: Snapshots, events: EventLog, *, repair: bool
) -> list[VerifyReport]:
    """One report per snapshot: manifest, marker and directory checked against each other."""
    reports = []
    for info in infos:
        t = time.monotonic()
        report = VerifyReport(str(info.digest), True, len(info.files), 0)
        truth: dict[str, ExpectedFile] | None = None
        try:
            manifest = _manifest(store, info)
        except (OSError, ModelpackError) as exc:
            report.problems.append(f"manifest: {exc}")
        else:
            try:
                truth = _expected(store, manifest)
            except (OSError, ModelpackError) as exc:
                report.problems.append(f"layers: {exc}")
            else:
                report.problems.extend(_marker_problems(info, manifest, truth))
        if truth is None:  # without a manifest, at least hold the files to the marker
            truth = {}
            for f in info.files:
                try:
                    rel = safe_relative_path(f.path, what="ready marker entry")
                except UnsafePathError as exc:
                    report.problems.append(str(exc))
                    continue
                truth[rel] = ExpectedFile(rel, f.digest, f.size, f.linked)
        bad_blobs = _disk_problems(info, truth, store.owner, report)
        for b in sorted(store.quarantined_since(info.blob_digests(), info.created)):
            report.problems.append(f"{b}: found corrupt by an earlier verify (quarantined); rebuilding")
        report.files = len(truth)
        report.ok = not report.problems
        report.seconds = time.monotonic() - t
        if not report.ok:
            events.emit(
                "cache.verify_failed",
                digest=str(info.digest),
                reason="; ".join(report.problems)[:2000],
                path=info.path,
            )
            if repair:
                for b in sorted(bad_blobs):  # first: out of the store, whatever happens next
                    store.quarantine_blob(b)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(snapshots.marker_path(info.digest))
                with contextlib.suppress(SnapshotInUseError):
                    snapshots.remove(info.digest)
        else:
            events.emit(
                "cache.verified",
                digest=str(info.digest),
                bytes=report.bytes,
                duration_ms=to_ms(report.seconds),
            )
        reports.append(report)
    return reports
