"""One version: modelpack/_version.py is the only place it is written.

The distribution's metadata (pyproject.toml reads it as a dynamic version), ``modelpack.__version__``,
``modelpack --version`` and the newest release heading of CHANGELOG.md all say the same thing.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from importlib.metadata import version as dist_version
from pathlib import Path

import tomllib
from click.testing import CliRunner

import modelpack
from modelpack.cli import main
from tests.paths import REPO_ROOT

RELEASE_HEADING = re.compile(
    r"^## \[(?P<version>\d+\.\d+\.\d+(?:[.-]?\w+)?)\] - (?P<date>\d{4}-\d{2}-\d{2})$", re.M
)


def _version_file() -> str:
    tree = ast.parse((REPO_ROOT / "modelpack" / "_version.py").read_text())
    (assign,) = [n for n in tree.body if isinstance(n, ast.Assign)]
    assert isinstance(assign.value, ast.Constant) and isinstance(assign.value.value, str)
    return assign.value.value


def latest_release(changelog: Path = REPO_ROOT / "CHANGELOG.md") -> str:
    """The version of the first ``## [X.Y.Z] - YYYY-MM-DD`` heading (``[Unreleased]`` is not one)."""
    found = RELEASE_HEADING.search(changelog.read_text())
    assert found, f"{changelog} has no release heading"
    return found["version"]


def test_pyproject_takes_the_version_from_the_version_module() -> None:
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"], "pyproject.toml writes a version of its own"
    assert "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "modelpack._version.__version__"}


def test_package_cli_metadata_and_changelog_name_the_same_version() -> None:
    written = _version_file()
    assert re.fullmatch(r"\d+\.\d+\.\d+", written), written
    assert modelpack.__version__ == written
    assert dist_version("modelpack-oci") == written  # the installed (editable) metadata
    result = CliRunner().invoke(main, ["--version"])
    assert result.exit_code == 0 and result.output == f"modelpack, version {written}\n", result.output
    assert latest_release() == written


def test_python_m_modelpack_cli_prints_the_version() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "modelpack.cli", "--version"], capture_output=True, text=True, check=True
    )
    assert proc.stdout.strip() == f"modelpack, version {_version_file()}"


def test_a_changelog_without_a_release_heading_is_noticed(tmp_path: Path) -> None:
    """The heading check can fail: only an Unreleased section is no release."""
    path = tmp_path / "CHANGELOG.md"
    path.write_text("# Changelog\n\n## [Unreleased]\n\n- a change\n")
    assert RELEASE_HEADING.search(path.read_text()) is None
    path.write_text("# Changelog\n\n## [Unreleased]\n\n## [1.2.3] - 2026-12-07\n\n- a change\n")
    assert latest_release(path) == "1.2.3"
