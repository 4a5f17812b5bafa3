"""A failure that cannot heal fails at once with one line; one that can is retried and says so.

The mistakes: a typo'd port (nothing listens: connection refused), a host name that does not
resolve, ``modelpack ls HOST:PORT`` (a registry where a repository belongs), credentials or a tag
the registry refuses. Each used to wait the whole ``--retry-for`` (60 s by default) in silence
before failing. Here each is a real ``modelpack`` process, and each must end with exit 1 (2 for a
usage error) in under 5 s with one line on stderr. A registry answering 503 is an outage that may
heal: it is retried for ``--retry-for``, and the command says once what it waits for, until when.
"""

from __future__ import annotations

import http.server
import os
import pty
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from modelpack.exit_codes import ExitCode
from tests.fixtures.loopback import LoopbackServer, free_port

pytestmark = pytest.mark.timeout(240)

MODELPACK = str(Path(sys.executable).with_name("modelpack"))
COMMANDS = ["pull", "ls", "inspect"]


def _run(
    command: str, ref: str, tmp_path: Path, *extra: str
) -> tuple[subprocess.CompletedProcess[str], float]:
    argv = [MODELPACK, command, ref]
    if command == "pull":
        argv.append(str(tmp_path / "dest"))
    start = time.monotonic()
    proc = subprocess.run(
        [*argv, *extra], capture_output=True, text=True, timeout=120, env={**os.environ, "CI": "1"}
    )
    return proc, time.monotonic() - start


def _repo(ref: str) -> str:
    """``HOST/REPO:TAG`` → ``HOST/REPO`` (what ``ls`` takes)."""
    head, _, tail = ref.rpartition(":")
    return head if "/" not in tail else ref


def _assert_fast_one_line(
    proc: subprocess.CompletedProcess[str], took: float, status: int = ExitCode.FAILURE
) -> None:
    assert proc.returncode == status, (proc.returncode, proc.stderr)
    assert took < 5.0, f"took {took:.1f} s: {proc.stderr}"
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr


def _command(
    command: str, ref: str, tmp_path: Path, *extra: str
) -> tuple[subprocess.CompletedProcess[str], float]:
    return _run(command, _repo(ref) if command == "ls" else ref, tmp_path, *extra)


@pytest.mark.parametrize("command", COMMANDS)
def test_a_port_nothing_listens_on_fails_at_once(command: str, tmp_path: Path) -> None:
    """Connection refused by a registry that never answered in this run: no retry, one line
    that says the connection was refused."""
    proc, took = _command(command, f"127.0.0.1:{free_port()}/m/x:v1", tmp_path)
    _assert_fast_one_line(proc, took)
    assert "connection refused" in proc.stderr, proc.stderr


@pytest.mark.parametrize("command", COMMANDS)
def test_a_host_name_that_does_not_resolve_fails_at_once(command: str, tmp_path: Path) -> None:
    """``.invalid`` never resolves (RFC 2606): the name is named and nothing is retried."""
    proc, took = _command(command, "registry.invalid/m/x:v1", tmp_path)
    _assert_fast_one_line(proc, took)
    assert "does not resolve" in proc.stderr and "registry.invalid" in proc.stderr, proc.stderr


def test_ls_of_a_bare_host_and_port_is_a_usage_error_at_once(tmp_path: Path) -> None:
    """``modelpack ls HOST:PORT`` names a registry, not a repository: said at once (it used to be
    read as Docker Hub's ``library/HOST`` and wait a minute for it)."""
    proc, took = _run("ls", f"127.0.0.1:{free_port()}", tmp_path)
    _assert_fast_one_line(proc, took, ExitCode.USAGE)
    assert "HOST:PORT/REPOSITORY" in proc.stderr, proc.stderr


def _answering(status: int) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:
            pass

        def _answer(self) -> None:
            body = b'{"errors":[{"code":"DENIED","message":"no"}]}' if status != 404 else b""
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        do_GET = do_HEAD = _answer

    return Handler


@pytest.fixture(params=[401, 403, 404], ids=lambda s: f"status{s}")
def refusing(request: pytest.FixtureRequest) -> Iterator[LoopbackServer]:
    server = LoopbackServer(_answering(request.param))
    yield server
    server.close()


@pytest.mark.parametrize("command", COMMANDS)
def test_a_refused_or_missing_tag_fails_at_once(
    command: str, refusing: LoopbackServer, tmp_path: Path
) -> None:
    """401, 403 and 404 are answers, not outages: the command fails at once with one line."""
    proc, took = _command(command, f"{refusing.host}/m/x:v1", tmp_path)
    _assert_fast_one_line(proc, took)


def _run_on_a_terminal(*argv: str) -> tuple[int, str, float]:
    """The command with its stderr on a pseudo-terminal (what a person at a shell sees)."""
    master, slave = pty.openpty()
    start = time.monotonic()
    proc = subprocess.Popen(
        [MODELPACK, *argv], stdout=subprocess.DEVNULL, stderr=slave, env={**os.environ, "CI": "1"}
    )
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 4096)
        except OSError:  # EIO: the command closed its end
            break
        if not data:
            break
        chunks.append(data)
    rc = proc.wait(timeout=120)
    os.close(master)
    return rc, b"".join(chunks).decode(errors="replace").replace("\r\n", "\n"), time.monotonic() - start


def test_an_outage_that_may_heal_is_retried_and_said_once_on_a_terminal(tmp_path: Path) -> None:
    """503 (a registry restarting behind its load balancer) is retried for ``--retry-for``; on a
    terminal the command says once what it waits for and until when, then fails with one line.
    On a pipe or a log the failure is the one error line, as every failure is."""
    server = LoopbackServer(_answering(503))
    try:
        rc, stderr, took = _run_on_a_terminal("inspect", f"{server.host}/m/x:v1", "--retry-for", "3")
        proc, _ = _run("inspect", f"{server.host}/m/x:v1", tmp_path, "--retry-for", "3")
    finally:
        server.close()
    assert rc == ExitCode.FAILURE, stderr
    assert 3.0 <= took < 20.0, took
    lines = stderr.strip().splitlines()
    waits = [line for line in lines if "waiting for" in line]
    assert len(waits) == 1 and "until" in waits[0] and server.host in waits[0], stderr
    assert lines[-1].startswith("error:") and len(lines) == 2, stderr
    assert proc.returncode == ExitCode.FAILURE, proc.stderr
    piped = proc.stderr.strip().splitlines()
    assert len(piped) == 1 and piped[0].startswith("error:"), proc.stderr
