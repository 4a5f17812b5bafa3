"""Pull into a directory loses nothing and leaves nothing behind.

Against a real registry (and a fault-injecting hop in front of it): a differing local file is
never overwritten without ``--force``; files the artifact does not contain are reported and
removed only with ``--delete``; a directory where a file goes is a one-line error; a closed
output pipe or SIGTERM ends the pull promptly without temp files; a SIGKILLed pull's leftovers
are resumed or swept by the next pull; a full disk mid-download names the path, keeps the
partial and the next pull resumes it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from modelpack.api import transfer
from modelpack.cli import main
from modelpack.errors import DestinationConflictError, DiskFullError, FileWriteError
from modelpack.oci.descriptor import Manifest
from modelpack.oci.reference import parse_reference
from modelpack.targets.fetch import fetch_manifest
from modelpack.targets.opener import TargetOptions, open_readable
from modelpack.testdata.synthetic import SyntheticSpec, write_checkpoint
from modelpack.transfer.staging import partial_path
from tests.fixtures.faultproxy import Fault, FaultProxy, blob_get
from tests.fixtures.registry import RegistryServer
from tests.pull_dir_helpers import MiB, raw_layer, small_tmpfs, temp_entries, write_artifact

PLAIN = TargetOptions(plain_http=True)


def _run(*args: str) -> tuple[int, str, str]:
    r = CliRunner().invoke(main, list(args))
    return r.exit_code, r.stdout, r.stderr


def _push(directory: Path, ref: str) -> str:
    code, out, err = _run("push", str(directory), ref, "--progress", "off")
    assert code == 0, err
    return out.strip()


def _manifest(ref: str) -> Manifest:
    r = parse_reference(ref)
    manifest, _ = fetch_manifest(open_readable(r, PLAIN), r.identifier)
    return manifest


def _largest_layer(ref: str):  # type: ignore[no-untyped-def]
    return max(_manifest(ref).layers, key=lambda d: d.size)


@pytest.fixture
def versions(registry: RegistryServer, tmp_path: Path) -> tuple[str, str, Path, Path]:
    """v1: one safetensors file; v2: two shards, and a config.json that differs from v1's."""
    v1 = tmp_path / "v1"
    v2 = tmp_path / "v2"
    write_checkpoint(str(v1), SyntheticSpec(shards=1, seed=1))
    write_checkpoint(str(v2), SyntheticSpec(shards=2, seed=2))
    cfg = json.loads((v2 / "config.json").read_text())
    cfg["rope_theta"] = 1234.0
    (v2 / "config.json").write_text(json.dumps(cfg))
    repo = f"pulldir/model-{tmp_path.name[-12:].lower()}"
    r1, r2 = registry.ref(repo, "v1"), registry.ref(repo, "v2")
    _push(v1, r1)
    _push(v2, r2)
    return r1, r2, v1, v2


# --------------------------------------------------------------------------- 12.6: nothing overwritten
def test_pull_v2_over_v1_refuses_differing_files_then_force_and_delete(
    versions: tuple[str, str, Path, Path], tmp_path: Path
) -> None:
    r1, r2, v1, v2 = versions
    dest = tmp_path / "model"
    code, _, err = _run("pull", r1, str(dest), "--progress", "off")
    assert code == 0, err
    before = {p.name: p.read_bytes() for p in dest.iterdir()}

    code, _, err = _run("pull", r2, str(dest), "--progress", "off")
    assert code == 1, err
    assert "config.json" in err and "--force" in err and "Traceback" not in err
    assert {p.name: p.read_bytes() for p in dest.iterdir()} == before  # nothing written at all

    code, out, err = _run("pull", r2, str(dest), "--force", "--json", "--progress", "off")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["directory"]["replaced"] == ["config.json"]
    assert doc["directory"]["extraFiles"] == ["model.safetensors"] and doc["directory"]["deleted"] == []
    for p in v2.iterdir():
        assert (dest / p.name).read_bytes() == p.read_bytes()
    assert (dest / "model.safetensors").exists()  # kept: only --delete removes it

    code, _, err = _run("pull", r2, str(dest), "--progress", "off")
    assert code == 0, err
    assert "model.safetensors" in err and "--delete" in err  # reported, with the way to remove it

    code, out, err = _run("pull", r2, str(dest), "--delete", "--json", "--progress", "off")
    assert code == 0, err
    assert json.loads(out)["directory"]["deleted"] == ["model.safetensors"]
    assert sorted(os.listdir(dest)) == sorted(os.listdir(v2))
    assert (v1 / "model.safetensors").exists()


def test_library_pull_refuses_conflicts_with_a_typed_error(
    versions: tuple[str, str, Path, Path], tmp_path: Path
) -> None:
    r1, r2, _, _ = versions
    dest = tmp_path / "m"
    transfer.pull(r1, str(dest), target_options=PLAIN, progress="off")
    with pytest.raises(DestinationConflictError) as err:
        transfer.pull(r2, str(dest), target_options=PLAIN, progress="off")
    assert err.value.conflicts == ["config.json"]


def test_a_directory_where_a_file_goes_is_one_line(
    versions: tuple[str, str, Path, Path], tmp_path: Path
) -> None:
    r1, _, _, _ = versions
    dest = tmp_path / "m"
    (dest / "config.json").mkdir(parents=True)
    (dest / "config.json" / "keep").write_text("mine")
    for extra in ((), ("--force",)):
        code, _, err = _run("pull", r1, str(dest), "--progress", "off", *extra)
        assert code == 1, err
        assert "Traceback" not in err and str(dest / "config.json") in err and "directory" in err
    assert (dest / "config.json" / "keep").read_text() == "mine"


def test_a_file_where_a_directory_goes_is_a_typed_error(tmp_path: Path) -> None:
    layout = tmp_path / "layout"
    write_artifact(layout, "v1", [raw_layer("sub/w.bin", b"weights")])
    dest = tmp_path / "m"
    dest.mkdir()
    (dest / "sub").write_text("a file")
    with pytest.raises(FileWriteError) as err:
        transfer.pull(f"oci:{layout}:v1", str(dest), progress="off", force=True)
    assert str(dest / "sub") in str(err.value)
    assert (dest / "sub").read_text() == "a file"


# --------------------------------------------------------------------------- 12.8: closed pipe, signals
@pytest.fixture
def slow_model(registry: RegistryServer, tmp_path: Path) -> tuple[str, FaultProxy]:
    """A ~6 MiB model behind a proxy that relays 2 MiB/s: a pull takes a few seconds."""
    ck = tmp_path / "ck"
    write_checkpoint(str(ck), SyntheticSpec(hidden=512, intermediate=1376, layers=2, vocab=2048, shards=2))
    ref = registry.ref(f"pulldir/slow-{tmp_path.name[-12:].lower()}", "v1")
    _push(ck, ref)
    proxy = FaultProxy(registry.host, rate=2 * MiB)
    yield ref.replace(registry.host, proxy.host), proxy
    proxy.close()


def _pull_process(
    ref: str, dest: Path, *extra: str, stdout: int | None = subprocess.PIPE
) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    return subprocess.Popen(
        [sys.executable, "-m", "modelpack.cli", "pull", ref, str(dest), *extra],
        stdout=stdout,
        stderr=subprocess.STDOUT,
        env=env,
    )


def test_closed_pipe_ends_the_pull_promptly_without_temp_files(
    slow_model: tuple[str, FaultProxy], tmp_path: Path
) -> None:
    ref, _ = slow_model
    dest = tmp_path / "m"
    proc = _pull_process(ref, dest, "--progress", "on")
    assert proc.stdout is not None
    got = b""
    while len(got) < 300:  # `| head -c 300`
        chunk = proc.stdout.read1(300 - len(got))
        if not chunk:
            break
        got += chunk
    proc.stdout.close()
    closed = time.monotonic()
    try:
        rc = proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail("pull kept running after its output pipe was closed")
    assert time.monotonic() - closed < 10
    assert rc != 0
    assert _only_partials(temp_entries(dest)) if dest.exists() else True


def _only_partials(entries: list[str]) -> bool:
    """Whether every temp entry left is a resumable partial download (no staging, no spool)."""
    return all(name.endswith(".partial") for name in entries)


def test_sigterm_keeps_only_partials_the_rerun_resumes(
    slow_model: tuple[str, FaultProxy], tmp_path: Path
) -> None:
    """SIGTERM mid-pull: exit 143, nothing left under a temp name but partial downloads, and
    the rerun resumes them and leaves no temp entry."""
    ref, proxy = slow_model
    dest = tmp_path / "m"
    proc = _pull_process(ref, dest, "--progress", "off", stdout=subprocess.DEVNULL)
    _wait_for_temp_file(dest, proc)
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(timeout=20)
    assert rc == 128 + signal.SIGTERM
    left = temp_entries(dest)
    assert left and _only_partials(left), left
    proxy.settle()
    proxy.rate = None
    proxy.clear()
    res = transfer.pull(ref, str(dest), target_options=PLAIN, progress="off")
    assert res.resumed_bytes > 0
    assert temp_entries(dest) == []


def _wait_for_temp_file(dest: Path, proc: subprocess.Popen[bytes], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if dest.exists() and any(
            p.stat().st_size > 64 * 1024 for p in dest.rglob(".tmp-modelpack-*") if p.is_file()
        ):
            return
        assert proc.poll() is None, "pull ended before it wrote anything"
        time.sleep(0.05)
    pytest.fail("no temp file appeared")


def test_a_later_pull_resumes_or_sweeps_what_a_killed_pull_left(
    slow_model: tuple[str, FaultProxy], tmp_path: Path
) -> None:
    ref, proxy = slow_model
    dest = tmp_path / "m"
    proc = _pull_process(ref, dest, "--progress", "off", "-j", "1", stdout=subprocess.DEVNULL)
    _wait_for_temp_file(dest, proc)
    proc.kill()
    proc.wait()
    proxy.settle()
    left = temp_entries(dest)
    assert left, "SIGKILL left nothing to clean up"
    # a stale staging directory of a dead pull as well
    stale = dest / ".tmp-modelpack-pull-deadbeef"
    (stale / "models").mkdir(parents=True)
    (stale / "models" / "x").write_bytes(b"stale")
    proxy.rate = None
    proxy.clear()
    res = transfer.pull(ref, str(dest), target_options=PLAIN, progress="off")
    assert temp_entries(dest) == []
    assert res.resumed_bytes > 0
    total = sum(layer.size for layer in _manifest(ref).layers)
    proxy.settle()
    assert sum(proxy.blob_bytes.values()) <= total - res.resumed_bytes


# --------------------------------------------------------------------------- 17.2: ENOSPC mid-download
def test_disk_full_mid_download_keeps_the_partial_and_resumes(
    registry: RegistryServer, tmp_path: Path
) -> None:
    layout = tmp_path / "layout"
    weights = os.urandom(6 * MiB)
    write_artifact(layout, "v1", [raw_layer("w.bin", weights), raw_layer("config.json", b"{}")])
    ref = registry.ref(f"pulldir/full-{tmp_path.name[-12:].lower()}", "v1")
    code, _, err = _run("cp", f"oci:{layout}:v1", ref, "--progress", "off")
    assert code == 0, err
    with small_tmpfs(tmp_path / "disk", "8m") as disk:
        if disk is None:
            pytest.skip("cannot mount a tmpfs here")
        filler = disk / "filler"
        layer = next(d for d in _manifest(ref).layers if d.size == len(weights))

        def fill_disk_then_relay(body: bytes, _range: str | None) -> bytes:
            filler.write_bytes(bytes(5 * MiB))  # another process takes the space mid-pull
            return body

        proxy = FaultProxy(registry.host)
        try:
            proxy.add(Fault(match=blob_get(str(layer.digest)), rewrite=fill_disk_then_relay, times=1))
            via = ref.replace(registry.host, proxy.host)
            dest = disk / "model"
            code, _, err = _run("pull", via, str(dest), "--progress", "off")
            assert code == 1, err
            assert "Traceback" not in err and str(dest / "w.bin") in err and "space" in err
            assert not (dest / "w.bin").exists()
            partials = [p for p in temp_entries(dest) if p.endswith(".partial")]
            assert len(partials) == 1, temp_entries(dest)
            kept = (dest / partials[0]).stat().st_size
            assert kept > 0

            filler.unlink()
            proxy.clear()
            res = transfer.pull(via, str(dest), target_options=PLAIN, progress="off")
            assert (dest / "w.bin").read_bytes() == weights
            assert res.resumed_bytes == kept
            proxy.settle()
            assert proxy.blob_bytes[str(layer.digest)] == len(weights) - kept
            assert temp_entries(dest) == []
        finally:
            proxy.close()


def test_library_raises_disk_full_as_a_typed_error(registry: RegistryServer, tmp_path: Path) -> None:
    layout = tmp_path / "layout"
    write_artifact(layout, "v1", [raw_layer("w.bin", os.urandom(3 * MiB))])
    with small_tmpfs(tmp_path / "disk", "2m") as disk:
        if disk is None:
            pytest.skip("cannot mount a tmpfs here")
        with pytest.raises(DiskFullError) as err:
            transfer.pull(f"oci:{layout}:v1", str(disk / "m"), progress="off")
        assert str(disk / "m") in str(err.value)
        assert not (disk / "m" / "w.bin").exists()


# --------------------------------------------------------------------------- a second user
NOBODY = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]


@pytest.fixture
def shared_dir() -> Path:
    """A sticky, world-writable directory (like /tmp) that user nobody can reach."""
    d = Path(tempfile.mkdtemp(prefix="modelpack-w6-", dir="/tmp"))
    d.chmod(0o1777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _as_nobody(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*NOBODY, *cmd], capture_output=True, text=True, check=False, timeout=120)


def test_a_partial_planted_by_another_user_is_never_written_into(shared_dir: Path, tmp_path: Path) -> None:
    data = os.urandom(256 * 1024)
    layout = tmp_path / "layout"
    write_artifact(layout, "v1", [raw_layer("w.bin", data)])
    dest = shared_dir / "model"
    dest.mkdir()
    dest.chmod(0o1777)
    layer = _manifest_of(f"oci:{layout}:v1").layers[0]
    planted = Path(partial_path(str(dest / "w.bin"), layer.digest))
    foreign_temp = dest / ".tmp-modelpack-pull-foreign"
    r = _as_nobody(
        "sh", "-c", f"printf junk > '{planted}' && chmod 666 '{planted}' && mkdir '{foreign_temp}'"
    )
    assert r.returncode == 0, r.stderr
    assert planted.stat().st_uid != os.geteuid()
    res = transfer.pull(f"oci:{layout}:v1", str(dest), progress="off")
    final = dest / "w.bin"
    assert final.read_bytes() == data and res.downloaded == 1
    st = final.stat()
    assert st.st_uid == os.geteuid()  # our own file, not nobody's inode (nobody could edit it later)
    assert foreign_temp.is_dir()  # another user's entry is not ours to sweep


def test_pull_into_a_directory_it_cannot_write_is_one_line(shared_dir: Path, tmp_path: Path) -> None:
    layout = shared_dir / "layout"
    write_artifact(layout, "v1", [raw_layer("w.bin", b"weights")])
    for p in [layout, *layout.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    dest = shared_dir / "root-owned"
    dest.mkdir(mode=0o755)
    r = _as_nobody(
        sys.executable, "-m", "modelpack.cli", "pull", f"oci:{layout}:v1", str(dest), "--progress", "off"
    )
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr and str(dest) in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert os.listdir(dest) == []


def _manifest_of(ref: str) -> Manifest:
    r = parse_reference(ref)
    manifest, _ = fetch_manifest(open_readable(r), r.identifier)
    return manifest


def test_a_matching_file_of_another_user_is_not_taken_as_present(shared_dir: Path, tmp_path: Path) -> None:
    data = os.urandom(64 * 1024)
    layout = tmp_path / "layout"
    write_artifact(layout, "v1", [raw_layer("w.bin", data)])
    (shared_dir / "src.bin").write_bytes(data)
    (shared_dir / "src.bin").chmod(0o644)
    dest = shared_dir / "model"
    dest.mkdir()
    dest.chmod(0o1777)
    r = _as_nobody("cp", str(shared_dir / "src.bin"), str(dest / "w.bin"))
    assert r.returncode == 0, r.stderr
    with pytest.raises(DestinationConflictError, match="owned by uid"):
        transfer.pull(f"oci:{layout}:v1", str(dest), progress="off")
    res = transfer.pull(f"oci:{layout}:v1", str(dest), progress="off", force=True)
    assert res.replaced == ["w.bin"] and (dest / "w.bin").stat().st_uid == os.geteuid()
    assert (dest / "w.bin").read_bytes() == data


# --------------------------------------------------------------------------- 16.2: batched durability
def _tree_bytes(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` that is not a pull's temp entry, by relative path."""
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not any(part.startswith(".tmp-modelpack-") for part in p.parts)
    }


def test_a_killed_pull_leaves_only_whole_verified_files_at_final_paths(
    slow_model: tuple[str, FaultProxy], tmp_path: Path
) -> None:
    """SIGKILL in the middle, at two moments (a little after the first and after the third file
    is at its path, the next one under way): whatever is at a final path is the artifact's file,
    whole. Durability is batched per directory, but a rename still follows the verified fsync."""
    ref, proxy = slow_model
    expected = _tree_bytes(tmp_path / "ck")
    for landed in (1, 3):
        dest = tmp_path / f"m{landed}"
        proc = _pull_process(ref, dest, "--progress", "off", "-j", "1", stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while not (dest.exists() and len(_tree_bytes(dest)) >= landed):
            assert proc.poll() is None, "the pull ended before it could be killed"
            assert time.monotonic() < deadline, "no file landed"
            time.sleep(0.02)
        time.sleep(0.3)  # ~600 KiB through the 2 MiB/s proxy: into the next file
        assert proc.poll() is None, "the pull ended before it could be killed"
        proc.kill()
        proc.wait()
        proxy.settle()
        left = _tree_bytes(dest)
        assert landed <= len(left) < len(expected)
        for rel, data in left.items():
            assert data == expected[rel], f"{rel} at its final path is not the artifact's file"


def _strace_events(log_prefix: Path) -> list[tuple[float, str, list[str], str]]:
    """(time, syscall, quoted string arguments or the fd, result) of every finished call, in
    order of completion across the threads (``strace -ff -ttt -T``: one file per thread, no
    interleaving; start + duration, so an ``openat`` that got fd N only after another thread's
    ``close(N)`` comes after it even when it started first)."""
    import re

    line_re = re.compile(r"^(\d+\.\d+) (\w+)\((.*)\)\s+= (-?\d+).*<(\d+\.\d+)>\s*$")
    events: list[tuple[float, str, list[str], str]] = []
    for log in log_prefix.parent.glob(log_prefix.name + ".*"):
        for line in log.read_text(errors="replace").splitlines():
            m = line_re.match(line)
            if m:
                t, call, args, result, took = m.groups()
                strings = re.findall(r'"((?:[^"\\]|\\.)*)"', args)
                events.append((float(t) + float(took), call, strings or [args.split(",")[0]], result))
    return sorted(events)


def test_pull_fsyncs_each_file_before_its_rename_and_each_directory_once_after(
    registry: RegistryServer, tmp_path: Path
) -> None:
    """The order that keeps "nothing unverified at a final path" across a power cut, read from
    the real syscalls (strace): a file's temp copy is fsynced before it is renamed to its path;
    every directory renamed into (and each one the pull created, up to the destination) is
    fsynced after its last rename, and only once, not once per file."""
    strace = shutil.which("strace")
    if strace is None:
        pytest.skip("strace is not installed (apt-get install strace)")
    layout = tmp_path / "layout"
    files = {
        "a.bin": os.urandom(3 * MiB),
        "b.bin": os.urandom(2 * MiB),
        "config.json": b"{}",
        "sub/c.json": b'{"c": 1}',
        "sub/deeper/d.bin": os.urandom(MiB),
        "sub/deeper/e.txt": b"e",
    }
    write_artifact(layout, "v1", [raw_layer(rel, data) for rel, data in files.items()])
    ref = registry.ref(f"pulldir/durable-{tmp_path.name[-12:].lower()}", "v1")
    code, _, err = _run("cp", f"oci:{layout}:v1", ref, "--progress", "off")
    assert code == 0, err
    dest = tmp_path / "m"
    log = tmp_path / "trace" / "pull"
    log.parent.mkdir()
    r = subprocess.run(
        [
            strace,
            "-ff",
            "-ttt",
            "-T",
            "-qq",
            "-s",
            "4096",
            "-e",
            "trace=openat,close,fsync,fdatasync,rename,renameat,renameat2",
            "-o",
            str(log),
            sys.executable,
            "-m",
            "modelpack.cli",
            "pull",
            ref,
            str(dest),
            "--progress",
            "off",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if r.returncode != 0 and "ptrace" in r.stderr:
        pytest.skip(f"strace cannot trace here: {r.stderr.strip()[:200]}")
    assert r.returncode == 0, r.stderr
    assert _tree_bytes(dest) == files

    fds: dict[str, str] = {}
    fsynced: list[tuple[int, str]] = []  # (event index, path)
    renames: list[tuple[int, str, str]] = []  # (event index, old, new)
    for i, (_, call, args, result) in enumerate(_strace_events(log)):
        if call == "openat" and not result.startswith("-"):
            fds[result] = args[0]
        elif call == "close":
            fds.pop(args[0], None)
        elif call in ("fsync", "fdatasync") and result == "0" and args[0] in fds:
            fsynced.append((i, fds[args[0]]))
        elif call.startswith("rename") and result == "0" and len(args) == 2:
            renames.append((i, args[0], args[1]))

    placed = {new: (i, old) for i, old, new in renames if new.startswith(str(dest) + "/")}
    assert sorted(placed) == sorted(str(dest / rel) for rel in files)
    for new, (i, old) in placed.items():
        assert ".tmp-modelpack-" in os.path.basename(old), f"{new} was written in place"
        assert any(j < i and path == old for j, path in fsynced), (
            f"{new}: renamed before its data was fsynced"
        )
    directories = {str(dest), str(dest / "sub"), str(dest / "sub" / "deeper")}
    for d in directories:
        last_rename = max((i for new, (i, _) in placed.items() if new.startswith(d + "/")), default=-1)
        syncs = [j for j, path in fsynced if path == d]
        assert syncs and max(syncs) > last_rename, f"{d} not fsynced after its last rename"
        assert len(syncs) == 1, f"{d} fsynced {len(syncs)} times: once per file instead of once"


def test_a_pull_keeps_the_exec_bit_the_manifest_records_and_nothing_more(tmp_path: Path) -> None:
    """The packer records each file's mode (``org.cncf.model.file.metadata+json``) and podman and
    containerd restore it; a pull wrote every file 0644, dropping a script's exec bit. A pulled
    file is 0755 when its recorded mode lets its owner execute it, else 0644: never setuid or
    world-writable, whatever a hostile manifest records (``07777``), and a rerun over a file that
    is there with the right bytes but the wrong mode mends the mode."""
    import json as _json

    from modelpack.mediatypes import ANNOTATION_FILE_METADATA

    from modelpack.oci.descriptor import Manifest
    from modelpack.targets.layout import OCILayoutTarget

    src = tmp_path / "src"
    write_checkpoint(str(src), SyntheticSpec(seed=5, shards=1))
    (src / "run.sh").write_text("#!/bin/sh\necho hi\n")
    (src / "run.sh").chmod(0o755)
    (src / "evil.sh").write_text("#!/bin/sh\n")
    (src / "evil.sh").chmod(0o755)
    layout = tmp_path / "layout"
    transfer.push(str(src), f"oci:{layout}:v1", progress="off")
    # a hostile publisher records 07777 for evil.sh (the manifest is re-tagged as v2)
    target = OCILayoutTarget(str(layout))
    raw, media_type = target.fetch_manifest(str(target.resolve("v1").digest))
    doc = _json.loads(raw)
    for layer in doc["layers"]:
        meta = layer.get("annotations", {}).get(ANNOTATION_FILE_METADATA)
        if meta and _json.loads(meta)["name"] == "evil.sh":
            m = _json.loads(meta)
            m["mode"] = 0o7777
            layer["annotations"][ANNOTATION_FILE_METADATA] = _json.dumps(m)
    target.push_manifest(_json.dumps(doc).encode(), media_type, "v2")
    assert Manifest.parse(_json.dumps(doc).encode(), media_type=media_type)

    out = tmp_path / "out"
    transfer.pull(f"oci:{layout}:v2", str(out), progress="off")
    mode = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert mode["run.sh"] == 0o755 and mode["evil.sh"] == 0o755, mode
    assert all(m == 0o644 for n, m in mode.items() if not n.endswith(".sh")), mode
    (out / "run.sh").chmod(0o644)
    res = transfer.pull(f"oci:{layout}:v2", str(out), progress="off")
    assert res.downloaded == 0 and stat.S_IMODE((out / "run.sh").stat().st_mode) == 0o755
