"""Re-hash cached snapshots on demand; a damaged one is unpublished and its bad blobs removed.

A hit trusts the ready marker and hashes nothing, so this is where damage after publishing
(disk errors, someone writing into the store) is found. Repair removes the marker first, so no
reader trusts the snapshot while its files and blobs are removed.
"""

from __future__ import annotations

import contextlib
import os
import time

from modelpack.mount.reports import VerifyReport, to_ms
from modelpack.mount.snapshots import SnapshotInfo, Snapshots
from modelpack.mount.store import Store

from modelpack.errors import ModelpackError, SnapshotInUseError
from modelpack.events import EventLog
from modelpack.oci.digest import sha256_file, verify_bytes


def verify_snapshots(
    infos: list[SnapshotInfo], store: Store, snapshots: Snapshots, events: EventLog, *, repair: bool
) -> list[VerifyReport]:
    """One report per snapshot: each file re-hashed against the marker, the manifest against its digest."""
    reports = []
    for info in infos:
        t = time.monotonic()
        report = VerifyReport(str(info.digest), True, len(info.files), 0)
        bad_blobs: set[str] = set()
        for f in info.files:
            p = os.path.join(info.path, *f.path.split("/"))
            try:
                actual, size = sha256_file(p)
            except FileNotFoundError:
                report.problems.append(f"{f.path}: missing")
                continue
            report.bytes += size
            if actual != f.digest or size != f.size:
                report.problems.append(f"{f.path}: expected {f.digest} ({f.size} B), got {actual} ({size} B)")
                if f.linked:
                    bad_blobs.add(f.digest)
        try:
            verify_bytes(store.read_small(info.digest), info.digest, None, what="manifest")
        except (OSError, ModelpackError) as exc:
            report.problems.append(f"manifest: {exc}")
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
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(snapshots.marker_path(info.digest))
                for b in bad_blobs:
                    store.remove_blob(b)
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
