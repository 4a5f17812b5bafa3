"""Placing a node-cache snapshot at KServe's DEST: one writer at a time, whatever the entry point.

Two storage initializers (two containers of one pod, a restarted init container beside a slow
one) may place the same model into one DEST. Each file goes to a temp name and is renamed into
place; that temp name was one per file, so one initializer removed or renamed the other's
half-copied file (3 of 12 runs failed on copies, a slow filesystem left hidden temp links in
DEST). The placement now holds DEST as a pull into a directory does (``destination_locked``).
"""

from __future__ import annotations

import threading
from pathlib import Path

from modelpack.mount import NodeCache
from modelpack.mount.snapshots import SnapshotInfo

from modelpack.api import transfer
from modelpack.files import TEMP_PREFIX
from modelpack.oci.digest import sha256_file
from modelpack.serving.kserve.placement import place_snapshot
from modelpack.testdata.synthetic import SyntheticSpec, write_checkpoint


def test_two_placements_into_one_dest_both_succeed_and_leave_no_temp_file(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    write_checkpoint(str(ckpt), SyntheticSpec(seed=21, shards=4, hidden=512, intermediate=1376, layers=2))
    layout = tmp_path / "layout"
    transfer.push(str(ckpt), f"oci:{layout}:v1", progress="off")
    cache = NodeCache(str(tmp_path / "cache"))
    with cache.open_snapshot(str(cache.pull(f"oci:{layout}:v1").digest)) as snapshot:
        _place_concurrently(snapshot, tmp_path)


def _place_concurrently(snapshot: SnapshotInfo, tmp_path: Path) -> None:
    want = {f.path: f.digest for f in snapshot.files}
    for trial in range(6):
        dest = tmp_path / f"dest-{trial}"
        errors: list[BaseException] = []

        def place(dest: Path = dest, errors: list[BaseException] = errors) -> None:
            try:
                place_snapshot(snapshot, str(dest), link="copy")
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=place) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert errors == [], (trial, errors)
        left = [p.name for p in dest.rglob("*") if p.name.startswith(TEMP_PREFIX)]
        assert left == [], (trial, left)
        got = {str(p.relative_to(dest)): str(sha256_file(str(p))[0]) for p in dest.rglob("*") if p.is_file()}
        assert got == want, trial
