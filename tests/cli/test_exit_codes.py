"""Exit statuses are one table (``modelpack.exit_codes``), README shows that table, and each status
is what a real ``modelpack`` process ends with in the case the table names: a usage error, a
failure, a refused signature, credentials a registry refuses, a closed stdout, and SIGINT, SIGTERM
or SIGHUP in the middle of a pull."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from modelpack.signing.keys import generate_key, write_keypair

from modelpack.cli import main
from modelpack.exit_codes import MEANING, ExitCode
from modelpack.testdata.synthetic import SyntheticSpec, write_checkpoint
from tests.fixtures.faultproxy import FaultProxy
from tests.fixtures.registry import RegistryServer
from tests.mount.test_cache_support import push_model

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parents[2]
MODELPACK = str(Path(sys.executable).with_name("modelpack"))


def _cli(*argv: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([MODELPACK, *argv], capture_output=True, text=True, timeout=120, input=stdin)


def test_the_readme_table_is_the_exit_code_table() -> None:
    """README's "Exit status" rows are exactly ``ExitCode`` and its meanings, in order."""
    text = (ROOT / "README.md").read_text()
    section = text.split("### Exit status", 1)[1].split("\n#", 1)[0]
    rows = re.findall(r"^\| `(\d+)` \| (.+?) \|$", section, flags=re.M)
    assert rows == [(str(int(code)), MEANING[code]) for code in ExitCode]
    assert set(MEANING) == set(ExitCode)


def test_usage_and_failure_statuses(registry: RegistryServer, tmp_path: Path) -> None:
    """A flag or reference that cannot be used is 2; a command that fails or refuses is 1."""
    ckpt = tmp_path / "ckpt"
    write_checkpoint(str(ckpt), SyntheticSpec())
    digest = push_model(ckpt, registry.host, "exit/model")
    ref = f"{registry.host}/exit/model@{digest}"
    assert _cli("pull", "--no-such-flag").returncode == ExitCode.USAGE
    bad_ref = _cli("pull", "oci://./layout", str(tmp_path / "d"))
    assert bad_ref.returncode == ExitCode.USAGE and "oci:DIR" in bad_ref.stderr
    missing = _cli("pull", registry.ref("exit/missing", "v1"), str(tmp_path / "m"))
    assert missing.returncode == ExitCode.FAILURE and len(missing.stderr.strip().splitlines()) == 1
    # a refused signature: nobody signed it with this key
    _, pub = write_keypair(str(tmp_path / "other"), generate_key())
    refused = _cli("verify", ref, "--key", pub)
    assert refused.returncode == ExitCode.FAILURE, refused.stderr
    assert _cli("verify", ref, "--key", pub, "--json").returncode == ExitCode.FAILURE
    assert _cli("ls", registry.ref("exit/model", None)).returncode == ExitCode.OK


def test_login_with_a_wrong_password_is_a_failure_naming_the_registry(
    basic_registry: RegistryServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Credentials the registry refuses are a failure (1), not a usage error (2): one line naming
    the registry, nothing stored."""
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "docker"))
    res = CliRunner().invoke(
        main,
        ["login", basic_registry.host, "-u", basic_registry.username or "", "--password-stdin"],
        input="wrong-password\n",
    )
    assert res.exit_code == ExitCode.FAILURE, res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and basic_registry.host in lines[0] and "Traceback" not in res.output
    assert not (tmp_path / "docker" / "config.json").exists()


def test_a_closed_stdout_ends_the_command_as_sigpipe_would(registry: RegistryServer, tmp_path: Path) -> None:
    """``modelpack … | head`` whose reader left: 141 (128 + SIGPIPE), quietly."""
    ckpt = tmp_path / "ckpt"
    write_checkpoint(str(ckpt), SyntheticSpec())
    push_model(ckpt, registry.host, "exit/listed")
    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.run(
            [MODELPACK, "ls", registry.ref("exit/listed", None), "--json"],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    finally:
        os.close(write)
    assert proc.returncode == ExitCode.OUTPUT_CLOSED, proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("sig", "status"),
    [
        (signal.SIGINT, ExitCode.SIGINT),
        (signal.SIGTERM, ExitCode.SIGTERM),
        (signal.SIGHUP, ExitCode.SIGHUP),
    ],
    ids=lambda v: getattr(v, "name", str(v)),
)
def test_a_signal_in_the_middle_of_a_pull_ends_it_with_128_plus_the_signal(
    registry: RegistryServer, tmp_path: Path, sig: signal.Signals, status: ExitCode
) -> None:
    """A pull slowed to 1 MiB/s is signalled once its first blob is flowing: it stops with the
    table's status, says so on one line, and leaves no partial destination."""
    ckpt = tmp_path / "ckpt"
    write_checkpoint(str(ckpt), SyntheticSpec(hidden=512, intermediate=1376, layers=4, vocab=4096))
    push_model(ckpt, registry.host, f"exit/slow-{sig.name.lower()}")
    proxy = FaultProxy(registry.host, rate=1024 * 1024)
    dest = tmp_path / "dest"
    try:
        proc = subprocess.Popen(
            [
                MODELPACK,
                "pull",
                f"{proxy.host}/exit/slow-{sig.name.lower()}:v1",
                str(dest),
                "--progress",
                "off",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "CI": "1"},
        )
        deadline = time.monotonic() + 60
        while not any(m == "GET" and "/blobs/" in p for _, m, p, _ in list(proxy.log)):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.02)
        time.sleep(0.3)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        proxy.close()
    assert proc.returncode == status, (proc.returncode, err)
    assert "Traceback" not in err and "interrupt" in err, err
    assert not dest.exists() or not any(p.suffix == ".safetensors" for p in dest.iterdir())
