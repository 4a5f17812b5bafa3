"""Image-shaped pulls (modelcars, ``push --format image``) prove every file before it appears.

Pull into a directory extracts a tar layer into a staging directory inside DEST while the blob
digest is computed over the same stream, and renames the files into place only once it matched;
files are not hashed one by one any more (the blob digest covers their bytes). So each way a
layer can be wrong must still leave nothing at DEST and no staging behind: a byte flipped in
the registry's stored blob (digest mismatch after the files were written to staging), a tar
whose member ends early inside a blob that does match its digest (a publisher's truncated
tar), a SIGKILL in the middle of an extraction (the next pull finishes and sweeps), and a
same-sized but different file already at DEST (compared by hashing the staged file, now only
when there is such a file).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from modelpack.api import transfer
from modelpack.errors import DestinationConflictError, DigestMismatchError, LayerFormatError
from modelpack.oci.reference import parse_reference
from modelpack.targets.fetch import fetch_manifest
from modelpack.targets.opener import TargetOptions, open_readable
from tests.fixtures.faultproxy import FaultProxy
from tests.fixtures.registry import RegistryServer
from tests.pull_dir_helpers import BLOCK, MiB, image_layer, tar_member, tar_of, temp_entries, write_artifact

PLAIN = TargetOptions(plain_http=True)


def _model(directory: Path, *, files: int = 3, size: int = 2 * MiB) -> dict[str, bytes]:
    """Incompressible weight files and a config; returns relpath → bytes."""
    directory.mkdir(parents=True)
    out = {"config.json": b'{"model_type": "test"}'}
    for i in range(files):
        out[f"model-{i:05d}.bin"] = os.urandom(size)
    for name, data in out.items():
        (directory / name).write_bytes(data)
    return out


def _tree(dest: Path) -> dict[str, bytes]:
    """Files at their final paths (staging directories left out)."""
    if not dest.exists():
        return {}
    return {
        str(p.relative_to(dest)): p.read_bytes()
        for p in dest.rglob("*")
        if p.is_file() and not any(part.startswith(".tmp-modelpack-") for part in p.relative_to(dest).parts)
    }


def _push_image(registry: RegistryServer, src: Path, name: str) -> str:
    ref = registry.ref(f"imagepull/{name}-{uuid.uuid4().hex[:8]}", "v1")
    transfer.push(str(src), ref, format="image", progress="off")
    return ref


def _largest_layer_digest(ref: str) -> str:
    r = parse_reference(ref)
    manifest, _ = fetch_manifest(open_readable(r, PLAIN), r.identifier)
    return str(max(manifest.layers, key=lambda d: d.size).digest)


def test_a_byte_flipped_in_a_stored_tar_layer_leaves_nothing_at_dest(
    registry: RegistryServer, tmp_path: Path
) -> None:
    """The flip is inside a file's data: the tar parses, the file is written to staging whole,
    and only the blob digest at the end of the stream can tell. Nothing may reach DEST."""
    _model(tmp_path / "src")
    ref = _push_image(registry, tmp_path / "src", "flip")
    victim = _largest_layer_digest(ref)
    data = registry.blob_data_path(victim)
    with open(data, "r+b") as f:
        f.seek(os.path.getsize(data) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))
    dest = tmp_path / "dest"
    with pytest.raises(DigestMismatchError) as info:
        transfer.pull(ref, str(dest), target_options=PLAIN, progress="off", jobs=1)
    assert victim in str(info.value)
    assert _tree(dest) == {}, "a file of the corrupted layer reached DEST"
    assert temp_entries(dest) == [], "the staging directory was left behind"


def test_a_member_cut_short_inside_a_matching_blob_is_refused_naming_it(tmp_path: Path) -> None:
    """A publisher's tar whose last member declares 1 MiB and holds 100 KiB: the blob matches its
    digest, so only the extraction can refuse it; the whole member written so far is discarded."""
    whole = tar_member("models/config.json", b"{}")
    head = tar_member("models/weights.bin", bytes(MiB))[: BLOCK + 100 * 1024]
    layout = tmp_path / "layout"
    write_artifact(layout, "v1", [image_layer(whole + head)], image_config=True)
    dest = tmp_path / "dest"
    with pytest.raises(LayerFormatError, match=r"weights\.bin.*truncated \(102400 of 1048576 bytes\)"):
        transfer.pull(f"oci:{layout}:v1", str(dest), progress="off")
    assert _tree(dest) == {}
    assert temp_entries(dest) == []


def test_a_same_sized_different_file_at_dest_is_a_conflict_and_an_equal_one_is_present(
    registry: RegistryServer, tmp_path: Path
) -> None:
    """Staged files are hashed only when a file of the same size is already at DEST: that
    comparison must still tell a changed file from the artifact's."""
    files = _model(tmp_path / "src", files=2, size=256 * 1024)
    ref = _push_image(registry, tmp_path / "src", "conflict")
    dest = tmp_path / "dest"
    first = transfer.pull(ref, str(dest), target_options=PLAIN, progress="off")
    assert first.downloaded == len(files) and _tree(dest) == files
    again = transfer.pull(ref, str(dest), target_options=PLAIN, progress="off")
    assert (again.present, again.downloaded) == (len(files), 0)
    edited = dest / "model-00001.bin"
    edited.chmod(0o644)
    edited.write_bytes(bytes(len(files["model-00001.bin"])))  # same size, other bytes
    with pytest.raises(DestinationConflictError, match=r"model-00001\.bin"):
        transfer.pull(ref, str(dest), target_options=PLAIN, progress="off")
    assert edited.read_bytes() == bytes(len(files["model-00001.bin"]))  # not overwritten
    assert temp_entries(dest) == []
    forced = transfer.pull(ref, str(dest), target_options=PLAIN, progress="off", force=True)
    assert forced.replaced == ["model-00001.bin"] and _tree(dest) == files


def _staged_bytes(dest: Path) -> int:
    """The largest file inside a staging directory of ``dest``."""
    sizes = [
        p.stat().st_size
        for stage in dest.glob(".tmp-modelpack-*")
        if stage.is_dir()
        for p in stage.rglob("*")
        if p.is_file()
    ]
    return max(sizes, default=0)


def test_sigkill_mid_extraction_then_the_next_pull_finishes(registry: RegistryServer, tmp_path: Path) -> None:
    files = _model(tmp_path / "src", files=3, size=MiB)
    ref = _push_image(registry, tmp_path / "src", "kill")
    proxy = FaultProxy(registry.host, rate=2 * MiB)  # ~1.5 s for the model: time to kill it inside
    try:
        slow_ref = ref.replace(registry.host, proxy.host)
        dest = tmp_path / "dest"
        env = {k: v for k, v in os.environ.items() if k != "CI"}
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "modelpack.cli",
                "pull",
                slow_ref,
                str(dest),
                "--progress",
                "off",
                "-j",
                "1",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=env,
        )
        deadline = time.monotonic() + 60
        while _staged_bytes(dest) < 256 * 1024:
            assert proc.poll() is None, f"the pull ended before it could be killed: {proc.stderr.read()!r}"  # type: ignore[union-attr]
            assert time.monotonic() < deadline, "no extraction got under way"
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert proc.stderr is not None
        proc.stderr.close()
        proxy.settle()
        assert temp_entries(dest), "SIGKILL mid-extraction left no staging directory (killed too late?)"
        for rel, data in _tree(dest).items():  # whatever landed is whole and the artifact's
            assert data == files[rel], f"{rel} at its final path is not the artifact's file"
        assert len(_tree(dest)) < len(files)

        proxy.rate = None
        res = transfer.pull(slow_ref, str(dest), target_options=PLAIN, progress="off")
        assert _tree(dest) == files
        assert temp_entries(dest) == [], "the next pull did not sweep the killed one's staging"
        assert any(".tmp-modelpack-" in s for s in res.swept)
    finally:
        proxy.close()


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_one_layer_of_many_files_lands_whole(tmp_path: Path) -> None:
    """A modelcar built by ``COPY models/ /models/``: every file in one layer, each fsynced in
    staging before the next is extracted. At DEST each must be whole and no descriptor of the
    24 files may stay open."""
    files = {f"models/shard-{i:02d}.bin": os.urandom(64 * 1024 + i) for i in range(24)}
    layout = tmp_path / "layout"
    write_artifact(
        layout, "v1", [image_layer(tar_of(*(tar_member(n, d) for n, d in files.items())))], image_config=True
    )
    dest = tmp_path / "dest"
    before = _open_fds()
    transfer.pull(f"oci:{layout}:v1", str(dest), progress="off")
    assert _open_fds() <= before
    assert _tree(dest) == {n.removeprefix("models/"): d for n, d in files.items()}


def test_a_member_cut_short_after_ten_whole_files_publishes_none(tmp_path: Path) -> None:
    """Ten whole members are written to staging, then the eleventh ends early: the pull fails
    naming it, nothing reaches DEST (not even the ten whole files) and no descriptor is left
    open."""
    whole = b"".join(tar_member(f"models/f{i}.bin", os.urandom(32 * 1024)) for i in range(10))
    head = tar_member("models/weights.bin", bytes(MiB))[: BLOCK + 100 * 1024]
    layout = tmp_path / "layout"
    write_artifact(layout, "v1", [image_layer(whole + head)], image_config=True)
    dest = tmp_path / "dest"
    before = _open_fds()
    with pytest.raises(LayerFormatError, match=r"weights\.bin.*truncated"):
        transfer.pull(f"oci:{layout}:v1", str(dest), progress="off")
    assert _open_fds() <= before, "a staged file's descriptor was never closed"
    assert _tree(dest) == {}
    assert temp_entries(dest) == []
