"""The CLI answers every failure with one line and a non-zero exit.

A ``ModelpackError`` prints as ``error: …``; an ``OSError`` names its path; anything else prints
one line plus "run with --debug for details", and the traceback appears only under ``--debug``.
A closed stdout or stderr (``modelpack … | head``) ends the process quietly. Every case runs the
real ``modelpack`` in a fresh interpreter.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from modelpack.testdata.synthetic import SyntheticSpec, write_checkpoint

pytestmark = pytest.mark.timeout(120)


def run_cli(*argv: str, **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(  # type: ignore[call-overload, no-any-return]
        [sys.executable, "-m", "modelpack.cli", *argv], capture_output=True, text=True, timeout=60, **kwargs
    )


def one_line_error(proc: subprocess.CompletedProcess[str], *culprits: str) -> str:
    assert proc.returncode not in (0, None), proc
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    if proc.returncode == 2 and lines and lines[0].startswith("Usage:"):  # click's usage error
        lines = [line for line in lines if line.startswith("Error:")]
    assert len(lines) == 1, proc.stderr
    for c in culprits:
        assert c in lines[0], lines[0]
    return lines[0]


# A command that fails in a way the library never planned for: registered on the real group
# in a fresh interpreter, so the mapping under test is the one every command goes through.
_UNPLANNED = textwrap.dedent(
    """
    import sys
    import click
    from modelpack.cli import main
    from modelpack.cli.options import handle_errors

    @main.command("boom")
    @click.argument("what")
    @handle_errors
    def boom(what):
        if what == "recursion":
            def f(n): return f(n + 1)
            f(0)
        if what == "type":
            raise TypeError("empty(): argument 'size' failed to unpack the object at pos 2")
        if what == "oserror":
            open("/nonexistent-dir/file")
        if what == "multiline":
            raise RuntimeError("first line\\nsecond line")

    @main.command("bare")
    def bare():
        raise KeyError("no handle_errors on this one")

    main(sys.argv[1:], prog_name="modelpack")
    """
)


@pytest.mark.parametrize(
    ("argv", "culprits"),
    [
        (["boom", "recursion"], ["RecursionError", "--debug"]),
        (["boom", "type"], ["TypeError", "'size'", "--debug"]),
        (["boom", "multiline"], ["RuntimeError", "first line", "--debug"]),
        (["bare"], ["KeyError", "--debug"]),
    ],
)
def test_unexpected_exception_is_one_line_with_the_debug_hint(argv: list[str], culprits: list[str]) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _UNPLANNED, *argv], capture_output=True, text=True, timeout=60
    )
    one_line_error(proc, *culprits)
    assert proc.returncode == 1


def test_os_error_names_the_path() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _UNPLANNED, "boom", "oserror"], capture_output=True, text=True
    )
    line = one_line_error(proc, "/nonexistent-dir/file", "No such file or directory")
    assert "--debug" not in line  # a path and a reason are actionable as they are


def test_debug_shows_the_traceback() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _UNPLANNED, "--debug", "boom", "type"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    assert "Traceback" in proc.stderr and "TypeError" in proc.stderr
    assert proc.stderr.rstrip().splitlines()[-1].startswith("error: ")


# --- real commands -------------------------------------------------------------------------------


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    d = tmp_path / "ckpt"
    write_checkpoint(str(d), SyntheticSpec(shards=1))
    return d


def test_layout_under_a_file_names_the_path(ckpt: Path) -> None:
    """``oci:/dev/null/x`` cannot be created (today: NotADirectoryError traceback)."""
    proc = run_cli("pack", str(ckpt), "oci:/dev/null/x:v1")
    one_line_error(proc, "/dev/null/x")


def _as_nobody() -> list[str]:
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv to run as a second uid")
    return ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]


@pytest.fixture
def world_tmp() -> Iterator[Path]:
    """A directory a second uid can reach (pytest's tmp_path sits under a 0700 directory)."""
    d = Path(tempfile.mkdtemp(prefix="modelpack-w5-", dir="/tmp"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _readable_checkpoint(world_tmp: Path) -> Path:
    ckpt = world_tmp / "ckpt"
    write_checkpoint(str(ckpt), SyntheticSpec(shards=1))
    ckpt.chmod(0o755)
    for f in ckpt.iterdir():
        f.chmod(0o644)
    return ckpt


def test_unreadable_checkpoint_file_names_the_path(world_tmp: Path) -> None:
    """A file the user cannot read (another uid's 0600 file): today a PermissionError traceback."""
    prefix = _as_nobody()
    ckpt = _readable_checkpoint(world_tmp)
    (ckpt / "README.md").chmod(0o600)
    out = world_tmp / "out"
    out.mkdir()
    out.chmod(0o777)
    proc = subprocess.run(
        [*prefix, sys.executable, "-m", "modelpack.cli", "pack", str(ckpt), f"oci:{out / 'layout'}:v1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    one_line_error(proc, str(ckpt / "README.md"))


def test_unwritable_destination_names_the_path(world_tmp: Path) -> None:
    prefix = _as_nobody()
    ckpt = _readable_checkpoint(world_tmp)
    proc = subprocess.run(
        [*prefix, sys.executable, "-m", "modelpack.cli", "pack", str(ckpt), f"oci:{world_tmp / 'layout'}:v1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    one_line_error(proc, str(world_tmp / "layout"), "Permission denied")


def test_unreachable_checkpoint_dir_says_why(world_tmp: Path) -> None:
    """A directory the user may not enter is not "not a directory"."""
    prefix = _as_nobody()
    ckpt = _readable_checkpoint(world_tmp)
    ckpt.chmod(0o700)
    proc = subprocess.run(
        [*prefix, sys.executable, "-m", "modelpack.cli", "pack", str(ckpt), f"oci:{world_tmp / 'l'}:v1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "Permission denied" in proc.stderr and str(ckpt) in proc.stderr, proc.stderr


def test_missing_checkpoint_dir_says_it_does_not_exist(tmp_path: Path) -> None:
    proc = run_cli("pack", str(tmp_path / "nope"), f"oci:{tmp_path / 'l'}:v1")
    assert proc.returncode == 2 and "does not exist" in proc.stderr, proc.stderr


def test_pack_into_a_path_suggests_oci(tmp_path: Path, ckpt: Path) -> None:
    for dest in ("./layout", "../layout", str(tmp_path / "layout")):
        proc = run_cli("pack", str(ckpt), dest, cwd=tmp_path)
        line = one_line_error(proc, dest)
        assert f"oci:{dest}" in line, line
        assert "invalid registry host" not in line, line


def test_pack_into_an_existing_directory_suggests_oci(tmp_path: Path, ckpt: Path) -> None:
    """A bare name that is a local directory is not pushed to Docker Hub as library/NAME."""
    (tmp_path / "layout").mkdir()
    proc = run_cli("pack", str(ckpt), "layout", cwd=tmp_path)
    line = one_line_error(proc, "oci:layout")
    assert proc.returncode == 2, line


def test_closed_stdout_exits_quietly(tmp_path: Path, ckpt: Path) -> None:
    """``modelpack … | head -c0``: the reader is gone before the first write."""
    layout = tmp_path / "layout"
    assert run_cli("pack", str(ckpt), f"oci:{layout}:v1").returncode == 0
    for argv in (["ls", f"oci:{layout}"], ["inspect", f"oci:{layout}:v1"], ["--help"], ["pack", "--help"]):
        r, w = os.pipe()
        os.close(r)
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "modelpack.cli", *argv],
                stdout=w,
                stderr=subprocess.PIPE,
                text=True,
                timeout=60,
            )
        finally:
            os.close(w)
        assert proc.stderr == "", (argv, proc.stderr)
        assert proc.returncode in (0, 1, 141), (argv, proc.returncode)


def test_closed_stderr_does_not_turn_an_error_into_a_crash(tmp_path: Path) -> None:
    """The error line cannot be written: the exit code still says what happened (not 120)."""
    r, w = os.pipe()
    os.close(r)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "modelpack.cli", "inspect", f"oci:{tmp_path / 'none'}:v1"],
            stdout=subprocess.PIPE,
            stderr=w,
            timeout=60,
        )
    finally:
        os.close(w)
    assert proc.returncode == 1


@pytest.mark.parametrize("source", ["./nope", "../nope", "/no/such/ckpt", "a-file"])
def test_push_of_a_missing_directory_names_it(source: str, tmp_path: Path) -> None:
    # before: "invalid registry host '.'" — the path was read as a reference
    (tmp_path / "a-file").write_bytes(b"x")
    proc = subprocess.run(
        [sys.executable, "-m", "modelpack.cli", "push", source, "127.0.0.1:9/m:v1"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=60,
    )
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert f"checkpoint directory {source} " in proc.stderr
    assert ("is not a directory" if source == "a-file" else "does not exist") in proc.stderr


def test_copy_into_a_full_layout_names_the_blob_path(tmp_path: Path) -> None:
    # before: "error: [Errno 28] No space left on device" with no path
    from tests.pull_dir_helpers import MiB, raw_layer, small_tmpfs, temp_entries, write_artifact

    src = tmp_path / "src"
    write_artifact(src, "v1", [raw_layer("model.safetensors", b"\1" * (4 * MiB))])
    with small_tmpfs(tmp_path / "disk", "1m") as disk:
        if disk is None:
            pytest.skip("mounting a tmpfs is not allowed here")
        proc = subprocess.run(
            [sys.executable, "-m", "modelpack.cli", "cp", f"oci:{src}:v1", f"oci:{disk}/layout:v1"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 1, proc.stderr
        assert "Traceback" not in proc.stderr
        assert f"{disk}/layout/blobs/sha256/" in proc.stderr and "No space left on device" in proc.stderr
        assert temp_entries(disk) == []
