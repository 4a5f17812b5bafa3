"""Shared fixtures. Test data is generated; servers are real and bound to 127.0.0.1.

Server fixtures live in ``tests/fixtures/`` (a real distribution registry in its plain, Basic,
token and TLS variants; moto in server mode for S3) and are registered here as plugins.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from modelpack.testdata.synthetic import SyntheticSpec, write_checkpoint

pytest_plugins = [
    "tests.fixtures.registry",
    "tests.fixtures.s3",
    "tests.fixtures.device",
    "tests.fixtures.schedule",
]


def pytest_configure(config: pytest.Config) -> None:
    """A suite started in the background by a non-interactive shell (``make test &``) inherits
    SIGINT ignored, and every process a test starts would inherit that ignore, so the tests that
    interrupt a pull with SIGINT would see it run on (a program keeps an inherited ignore, as
    modelpack does). The test process takes SIGINT back; its children then start with the
    default, as under a terminal."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    """A small 2-shard Llama-shaped checkpoint in a fresh directory the test may modify."""
    d = tmp_path / "ckpt"
    write_checkpoint(str(d), SyntheticSpec(shards=2))
    return d


@pytest.fixture(autouse=True)
def _no_ci_progress(monkeypatch: pytest.MonkeyPatch) -> None:
    # keep progress bars out of captured output, as in CI
    monkeypatch.setenv("CI", os.environ.get("CI", "1"))
