"""Node cache: sweeps, byte counters, the pull → reader hand-off, CLI details, expanded-size quota.

Covers gc and ``.tmp-modelpack-*`` files in ``snapshots/``; ``--json`` counters of a resumed
partial; ``gc --min-age``; ``pull --cache --hold``; ``--progress``, ``gc --dry-run`` bytes,
``cache ls --cache /typo``; and a zstd bomb in an image-shaped layer counting against the quota by
its expanded size.
"""

from __future__ import annotations

import datetime
import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
import time
from pathlib import Path
from typing import Any

import pytest
import zstandard
from click.testing import CliRunner
from modelpack.mediatypes import (
    MEDIA_TYPE_IMAGE_CONFIG,
    MEDIA_TYPE_IMAGE_LAYER_TAR_ZSTD,
)
from modelpack.mount import NodeCache

from modelpack import api
from modelpack.cli import main
from modelpack.errors import InsufficientSpaceError, QuotaExceededError
from modelpack.files import TEMP_PREFIX
from modelpack.oci.descriptor import Manifest
from modelpack.targets.layout import OCILayoutTarget

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def layout(checkpoint: Path, tmp_path: Path) -> tuple[str, Manifest]:
    api.pack(str(checkpoint), f"oci:{tmp_path / 'layout'}:v1")
    target = OCILayoutTarget(str(tmp_path / "layout"))
    manifest, _ = api.fetch_manifest(target, "v1")
    return f"oci:{tmp_path / 'layout'}:v1", manifest


def _run(*args: str) -> tuple[int, str, str]:
    res = CliRunner().invoke(main, list(args))
    return res.exit_code, res.stdout, res.stderr


# ------------------------------------------------------------------------- 17.3 sweeps, counters
def test_gc_sweeps_old_temp_files_in_snapshots_and_leaves_live_ones_unreported(
    layout: tuple[str, Manifest], tmp_path: Path
) -> None:
    ref, _ = layout
    cache = NodeCache(str(tmp_path / "cache"))
    cache.pull(ref)
    snaps = Path(cache.snapshots.dir)
    dead = snaps / f"{TEMP_PREFIX}k2j4_x9z"  # a marker temp file (mkstemp name) of a crashed writer
    dead.write_bytes(b"{}")
    os.utime(dead, (1, 1))
    live = snaps / f"{TEMP_PREFIX}q8w7e6r5"  # another process's marker being written right now
    live.write_bytes(b"{")
    res = cache.gc()
    assert not dead.exists(), "an old temp file in snapshots/ must be removed"
    assert str(dead) in res.swept
    assert live.exists() and str(live) not in res.swept, res.swept
    assert all(os.path.lexists(p) is False for p in res.swept)


def test_json_counters_count_a_complete_partial_once(layout: tuple[str, Manifest], tmp_path: Path) -> None:
    """Killed after the last byte but before the rename: the partial is complete. It is re-hashed
    and committed; the counters must still add up to the total."""
    ref, manifest = layout
    cache = NodeCache(str(tmp_path / "cache"))
    big = max(manifest.layers, key=lambda x: x.size)
    src = OCILayoutTarget(ref[4:].rsplit(":", 1)[0]).blob_path(big.digest)
    shutil.copyfile(src, cache.store.partial_path(big.digest))
    half = min((x for x in manifest.layers if x.size > 1000), key=lambda x: x.size)
    with open(OCILayoutTarget(ref[4:].rsplit(":", 1)[0]).blob_path(half.digest), "rb") as f:
        Path(cache.store.partial_path(half.digest)).write_bytes(f.read(half.size // 2))
    doc = cache.pull(ref).to_json()
    res = doc["cache"]["bytes"]
    assert doc["bytesDownloaded"] + res["reused"] == res["total"], doc
    assert res["resumed"] == big.size + half.size // 2


# ------------------------------------------------------------------------- 17.4 hand-off
def test_gc_keeps_a_fresh_unreferenced_snapshot_for_min_age(
    layout: tuple[str, Manifest], tmp_path: Path
) -> None:
    ref, manifest = layout
    cache = NodeCache(str(tmp_path / "cache"))
    path = cache.pull(ref).path
    # a gc right after the pull (the puller has printed the path; its reader has not opened it yet)
    res = cache.gc(max_bytes=0)
    assert res.evicted == [] and os.path.isdir(path), "a just-published snapshot was evicted"
    assert res.kept_young == [str(manifest.digest)]
    code, out, err = _run("cache", "gc", "--cache", cache.root, "--max-bytes", "1", "--json")
    assert code == 0 and json.loads(out)["evicted"] == [], err
    code, out, err = _run(
        "cache", "gc", "--cache", cache.root, "--max-bytes", "1", "--min-age", "0", "--json"
    )
    assert code == 0 and json.loads(out)["evicted"] == [str(manifest.digest)], err


def test_pull_hold_keeps_the_snapshot_through_gc_until_it_expires(
    layout: tuple[str, Manifest], tmp_path: Path
) -> None:
    ref, manifest = layout
    cache = str(tmp_path / "cache")
    code, out, err = _run("pull", ref, "--cache", cache, "--hold", "2s", "--json")
    assert code == 0, err
    doc = json.loads(out)
    until = datetime.datetime.strptime(doc["cache"]["hold"]["until"], "%Y-%m-%dT%H:%M:%SZ")
    assert (
        until.replace(tzinfo=datetime.timezone.utc).timestamp() > time.time() - 1
    )  # RFC 3339 UTC, whole seconds
    res = NodeCache(cache).gc(max_bytes=0, min_age=0)
    assert res.evicted == [] and res.kept_held == [str(manifest.digest)]
    time.sleep(2.2)
    res = NodeCache(cache).gc(max_bytes=0, min_age=0)
    assert res.evicted == [str(manifest.digest)]
    # a hit can hold too: the hand-off of a model that was already cached
    NodeCache(cache).pull(ref)
    hit = NodeCache(cache).pull(ref, hold=60)
    assert hit.state == "hit" and hit.hold_until > time.time()
    assert NodeCache(cache).gc(max_bytes=0, min_age=0).kept_held == [str(manifest.digest)]
    NodeCache(cache).release_hold(hit.hold_path)
    assert NodeCache(cache).gc(max_bytes=0, min_age=0).evicted == [str(manifest.digest)]


# ------------------------------------------------------------------------- 12.11 CLI details
@pytest.mark.parametrize(
    "args",
    [
        ("cache", "ls"),
        ("cache", "gc"),
        ("cache", "verify"),
        ("cache", "path", "oci:/x:v1"),
        ("cache", "pin", "oci:/x:v1"),
        ("cache", "unpin", "oci:/x:v1"),
        ("cache", "rm", "oci:/x:v1"),
    ],
)
def test_cache_commands_do_not_create_a_mistyped_cache_directory(
    args: tuple[str, ...], tmp_path: Path
) -> None:
    typo = tmp_path / "typo" / "cache"
    code, _, err = _run(*args, "--cache", str(typo))
    assert not (tmp_path / "typo").exists(), f"{args} created {typo}"
    assert code != 0 and str(typo) in err and "Traceback" not in err, err


def test_gc_dry_run_says_how_much_it_would_free(layout: tuple[str, Manifest], tmp_path: Path) -> None:
    ref, manifest = layout
    cache = NodeCache(str(tmp_path / "cache"))
    cache.pull(ref)
    before = cache.usage()
    res = cache.gc(max_bytes=0, min_age=0, dry_run=True)
    assert res.evicted == [str(manifest.digest)] and cache.usage() == before
    assert res.bytes_freed == before > 0 and res.bytes_after == 0
    code, out, _ = _run(
        "cache", "gc", "--cache", cache.root, "--max-bytes", "1", "--min-age", "0", "--dry-run"
    )
    assert code == 0 and "would free" in out and "0 B" not in out.split("would free")[1][:8], out


def test_pull_cache_honours_progress(layout: tuple[str, Manifest], tmp_path: Path) -> None:
    ref, _ = layout
    code, _, err = _run("pull", ref, "--cache", str(tmp_path / "cache"), "--progress", "on")
    assert code == 0, err
    assert "%|" in err or "B/s" in err, f"no progress bar on stderr: {err!r}"
    code, _, err = _run("pull", ref, "--cache", str(tmp_path / "cache2"), "--progress", "off")
    assert code == 0 and "%|" not in err


# ------------------------------------------------------------------------- 12.1 expanded size
class _Zeros(io.RawIOBase):
    def __init__(self, n: int) -> None:
        self.left = n

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        n = min(len(b), self.left)
        b[:n] = bytes(n)
        self.left -= n
        return n


def _bomb_layout(path: Path, expanded: int) -> tuple[str, int]:
    """An image-shaped artifact whose one tar+zstd layer (a few KiB) holds ``expanded`` zero bytes."""
    tar_buf = io.BytesIO()
    with tarfile.open(fileobj=tar_buf, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("models/zeros.bin")
        info.size = expanded
        tar.addfile(info, io.BufferedReader(_Zeros(expanded), buffer_size=1 << 20))
    diff_id = hashlib.sha256(tar_buf.getvalue()).hexdigest()
    blob = zstandard.ZstdCompressor(level=3).compress(tar_buf.getvalue())
    (path / "blobs" / "sha256").mkdir(parents=True)
    (path / "oci-layout").write_text('{"imageLayoutVersion":"1.0.0"}')

    def put(data: bytes) -> tuple[str, int]:
        h = hashlib.sha256(data).hexdigest()
        (path / "blobs" / "sha256" / h).write_bytes(data)
        return "sha256:" + h, len(data)

    config = json.dumps(
        {
            "architecture": "amd64",
            "os": "linux",
            "rootfs": {"type": "layers", "diff_ids": ["sha256:" + diff_id]},
        }
    ).encode()
    cd, cs = put(config)
    ld, ls = put(blob)
    manifest = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": MEDIA_TYPE_IMAGE_CONFIG, "digest": cd, "size": cs},
            "layers": [{"mediaType": MEDIA_TYPE_IMAGE_LAYER_TAR_ZSTD, "digest": ld, "size": ls}],
        }
    ).encode()
    md, ms = put(manifest)
    index = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [
            {
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "digest": md,
                "size": ms,
                "annotations": {"org.opencontainers.image.ref.name": "v1"},
            }
        ],
    }
    (path / "index.json").write_text(json.dumps(index))
    return f"oci:{path}:v1", ls


def test_a_zstd_bomb_counts_against_the_quota_by_its_expanded_size(tmp_path: Path) -> None:
    ref, compressed = _bomb_layout(tmp_path / "bomb", 64 << 20)
    assert compressed < 64 << 10
    cache = NodeCache(str(tmp_path / "cache"), max_cache_bytes=16 << 20)
    with pytest.raises(QuotaExceededError) as exc:
        cache.pull(ref)
    assert "16777216" in str(exc.value)
    assert cache.ls() == []
    leftovers = [e.name for e in os.scandir(cache.snapshots.dir)]
    assert leftovers == [], leftovers
    assert cache.usage() < 1 << 20  # the expanded bytes were never kept


def test_a_zstd_bomb_is_refused_for_free_space_not_enospc(tmp_path: Path) -> None:
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mnt)], check=False).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        ref, _ = _bomb_layout(tmp_path / "bomb", 64 << 20)
        cache = NodeCache(str(mnt / "cache"))
        with pytest.raises(InsufficientSpaceError):
            cache.pull(ref)
        assert cache.ls() == [] and [e.name for e in os.scandir(cache.snapshots.dir)] == []
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
