"""The distribution has a name of its own on PyPI, and every install hint uses it.

``pip install modelpack`` installs an unrelated project (DeepView ModelPack) and
``modelpack-client`` installs a script called ``modelpack``: this project is ``modelpack-oci``,
with the import package ``modelpack`` and the command ``modelpack`` unchanged.
"""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import tomllib
from click.testing import CliRunner

from modelpack.cli import main
from tests.paths import REPO_ROOT

ROOT = REPO_ROOT
DIST = "modelpack-oci"


def test_pyproject_names_the_distribution_and_keeps_the_command() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["name"] == DIST
    assert project["scripts"] == {"modelpack": "modelpack.cli:main"}


def test_the_installed_distribution_is_this_project() -> None:
    dist = importlib.metadata.distribution(DIST)
    scripts = {ep.name: ep.value for ep in dist.entry_points if ep.group == "console_scripts"}
    assert scripts["modelpack"] == "modelpack.cli:main"
    assert dist.version == importlib.metadata.version(DIST)


def test_version_comes_from_the_distribution_metadata() -> None:
    out = CliRunner().invoke(main, ["--version"], prog_name="modelpack")
    assert out.exit_code == 0, out.output
    assert out.output.strip() == f"modelpack, version {importlib.metadata.version(DIST)}"


def test_python_dash_m_runs_this_cli_whatever_is_on_path() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "modelpack.cli", "--help"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert "pack" in out.stdout and "pull" in out.stdout and "cache" in out.stdout


def _tracked_text_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=False)
    names = listed.stdout.split() if listed.returncode == 0 else []
    return [
        ROOT / n
        for n in names
        if n.endswith((".md", ".py", ".sh", ".toml", ".yaml", ".yml")) and (ROOT / n).is_file()
    ]


def test_every_install_hint_installs_this_project() -> None:
    wrong = re.compile(r"pip install\s+['\"]?modelpack(\[|['\"\s]|$)")
    offenders = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in _tracked_text_files()
        for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
        if wrong.search(line)
    ]
    assert not offenders, f"install hints that install PyPI's unrelated 'modelpack': {offenders}"
    readme = (ROOT / "README.md").read_text()
    assert f"pip install '{DIST}[" in readme
    assert "PATH" in readme and "modelpack-client" in readme  # what happens with another `modelpack`
