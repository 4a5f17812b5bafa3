"""The release files `make dist` writes, built once per test session and shared by the modules
that need a wheel (tests/e2e/test_release.py, tests/e2e/test_installed_package.py).

Under pytest-xdist each worker is its own process: the first to get the lock builds into the
session's shared temporary folder, the others wait for it and reuse what it wrote.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from modelpack._version import __version__
from tests.paths import REPO_ROOT

DEV_VENV = Path(sys.executable).parent.parent


@dataclass(frozen=True)
class ReleaseDist:
    folder: Path
    version: str

    @property
    def wheel(self) -> Path:
        return self.folder / f"modelpack_oci-{self.version}-py3-none-any.whl"

    @property
    def sdist(self) -> Path:
        return self.folder / f"modelpack_oci-{self.version}.tar.gz"

    @property
    def sbom(self) -> Path:
        return self.folder / f"modelpack_oci-{self.version}.cdx.json"

    @property
    def notes(self) -> Path:
        return self.folder / f"CHANGELOG-{self.version}.md"

    @property
    def sums(self) -> Path:
        return self.folder / "SHA256SUMS"


def make_dist(folder: Path) -> subprocess.CompletedProcess[str]:
    """`make dist` as a release manager runs it, into ``folder``, with the dev venv's build tools."""
    proc = subprocess.run(
        ["make", "--no-print-directory", "-C", str(REPO_ROOT), "dist", f"DIST={folder}", f"VENV={DEV_VENV}"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


@pytest.fixture(scope="session")
def release_dist(tmp_path_factory: pytest.TempPathFactory) -> ReleaseDist:
    base = tmp_path_factory.getbasetemp()
    shared = (
        base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    )  # one folder for all xdist workers
    dist = ReleaseDist(shared / "release-dist", __version__)
    with open(shared / "release-dist.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not dist.sums.exists():
            make_dist(dist.folder)
    return dist
