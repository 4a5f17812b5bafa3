"""``modelpack --timeout SECONDS`` (and ``MODELPACK_TIMEOUT``) is real.

The attack on the old text: an error said "--timeout sets the limit", no command had the flag,
and a registry that accepts connections and never answers held every command for the 300 s
default. The stalled registry here is a loopback socket that accepts and reads but never
writes; the commands are real subprocesses of the CLI.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from modelpack.errors import RegistryConnectionError
from modelpack.targets.opener import TargetOptions, open_readable

pytestmark = pytest.mark.timeout(120)


class StalledServer:
    """Accepts TCP connections on 127.0.0.1 and never answers (keeps them open until closed)."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.conns: list[socket.socket] = []
        self.closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)  # read nothing, answer nothing

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.sock.getsockname()[1]}"

    def close(self) -> None:
        self.closed.set()
        self.sock.close()
        for c in self.conns:
            c.close()


@pytest.fixture
def stalled() -> Iterator[StalledServer]:
    server = StalledServer()
    yield server
    server.close()


def _cli(*args: str, env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess[str], float]:
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "modelpack.cli", *args],
        capture_output=True,
        text=True,
        timeout=90,
        env={**os.environ, **(env or {})},
    )
    return proc, time.monotonic() - start


def test_global_timeout_flag_bounds_a_stalled_registry(stalled: StalledServer) -> None:
    proc, took = _cli(
        "--timeout", "2", "inspect", f"{stalled.host}/m/x:v1", "--plain-http", "--retry-for", "0"
    )
    assert proc.returncode == 1, proc.stderr
    assert took < 10, took
    err = proc.stderr
    assert "Traceback" not in err
    assert stalled.host in err and "--timeout" in err and "2 s" in err, err


def test_timeout_from_the_environment_and_its_bounds(stalled: StalledServer) -> None:
    proc, took = _cli(
        "ls", f"{stalled.host}/m/x", "--plain-http", "--retry-for", "0", env={"MODELPACK_TIMEOUT": "1.5"}
    )
    assert proc.returncode == 1 and took < 10, (took, proc.stderr)
    assert "--timeout" in proc.stderr and stalled.host in proc.stderr, proc.stderr
    # zero, negative or nonsense: a usage error, not a registry client that never waits
    for bad in ("0", "-1", "soon"):
        proc, _ = _cli("--timeout", bad, "ls", f"{stalled.host}/m/x")
        assert proc.returncode == 2 and "--timeout" in proc.stderr, proc.stderr


def test_timeout_in_the_python_api(stalled: StalledServer) -> None:
    start = time.monotonic()
    target = open_readable(f"{stalled.host}/m/x:v1", TargetOptions(plain_http=True, timeout=1.0, retry_for=0))
    with pytest.raises(RegistryConnectionError) as exc:
        target.resolve("v1")
    assert time.monotonic() - start < 8
    assert exc.value.target == stalled.host and "--timeout" in str(exc.value)
