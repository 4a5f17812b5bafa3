"""`make dist`: the release files a CI job pins, reproducible from a commit.

The wheel, the sdist, a CycloneDX SBOM and the version's CHANGELOG section land in one folder
with a ``SHA256SUMS`` that ``sha256sum -c`` checks; the same commit built again gives the same
sums. The wheel installed into a fresh venv is checked in test_installed_package.py.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.e2e.conftest import DEV_VENV, ReleaseDist, make_dist
from tests.paths import REPO_ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
CI = REPO_ROOT / ".ci"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_make_dist_writes_every_release_file_and_sha256sums_verifies_them(
    release_dist: ReleaseDist, tmp_path: Path
) -> None:
    d = release_dist
    names = sorted(p.name for p in d.folder.iterdir())
    assert names == sorted(["SHA256SUMS", d.wheel.name, d.sdist.name, d.sbom.name, d.notes.name]), names
    listed = dict(line.split("  ", 1)[::-1] for line in d.sums.read_text().splitlines())
    assert set(listed) == set(names) - {"SHA256SUMS"}
    ok = subprocess.run(["sha256sum", "-c", "SHA256SUMS"], cwd=d.folder, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    # and the check can fail: one byte of the wheel changed
    copy = tmp_path / "dist"
    shutil.copytree(d.folder, copy)
    data = bytearray(copy.joinpath(d.wheel.name).read_bytes())
    data[100] ^= 1
    copy.joinpath(d.wheel.name).write_bytes(bytes(data))
    bad = subprocess.run(["sha256sum", "-c", "SHA256SUMS"], cwd=copy, capture_output=True, text=True)
    assert bad.returncode != 0 and f"{d.wheel.name}: FAILED" in bad.stdout


def test_make_dist_twice_gives_the_same_sha256sums(release_dist: ReleaseDist, tmp_path: Path) -> None:
    again = tmp_path / "again"
    make_dist(again)
    assert (again / "SHA256SUMS").read_text() == release_dist.sums.read_text()


def test_the_release_notes_are_the_changelog_section_of_the_version(release_dist: ReleaseDist) -> None:
    notes = release_dist.notes.read_text()
    assert re.match(rf"## \[{re.escape(release_dist.version)}\] - \d{{4}}-\d{{2}}-\d{{2}}\n", notes), notes[
        :200
    ]
    assert notes in (REPO_ROOT / "CHANGELOG.md").read_text()
    assert "## [Unreleased]" not in notes and "\n## " not in notes


def test_a_version_the_changelog_does_not_release_is_not_built(tmp_path: Path) -> None:
    changelog = tmp_path / "CHANGELOG.md"
    changelog.write_text("# Changelog\n\n## [Unreleased]\n\n- a change\n\n## [0.0.1] - 2026-01-01\n\n")
    for version in ("9.9.9", "0.0.1"):  # no section; an empty section
        proc = subprocess.run(
            [sys.executable, CI / "release-notes.py", changelog, version], capture_output=True, text=True
        )
        assert proc.returncode == 1 and "release-notes:" in proc.stderr, proc.stderr


def _purl(name: str, version: str) -> str:
    return f"pkg:pypi/{re.sub(r'[-_.]+', '-', name).lower()}@{version}"


def test_the_sbom_is_cyclonedx_naming_the_wheel_by_hash_and_its_dependency_closure(
    release_dist: ReleaseDist,
) -> None:
    bom = json.loads(release_dist.sbom.read_text())
    assert bom["bomFormat"] == "CycloneDX" and bom["specVersion"] == "1.5" and bom["version"] == 1
    assert re.fullmatch(
        r"urn:uuid:[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", bom["serialNumber"]
    )
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", bom["metadata"]["timestamp"])
    subject = bom["metadata"]["component"]
    assert subject["name"] == "modelpack-oci" and subject["version"] == release_dist.version
    assert subject["purl"] == f"pkg:pypi/modelpack-oci@{release_dist.version}"
    assert subject["hashes"] == [{"alg": "SHA-256", "content": _sha256(release_dist.wheel)}]
    refs = {c["bom-ref"] for c in bom["components"]}
    for component in bom["components"]:
        assert component["type"] == "library"
        assert component["purl"] == component["bom-ref"] == _purl(component["name"], component["version"])
    # every ref in the graph is a component or the subject; every component is reached from the subject
    graph = {d["ref"]: d["dependsOn"] for d in bom["dependencies"]}
    assert set(graph) == refs | {subject["bom-ref"]}
    assert all(set(deps) <= refs for deps in graph.values())
    reached, todo = set(), [subject["bom-ref"]]
    while todo:
        for dep in graph[todo.pop()]:
            if dep not in reached:
                reached.add(dep)
                todo.append(dep)
    assert reached == refs
    # the wheel's own requirements (no extras) are the subject's direct dependencies
    with zipfile.ZipFile(release_dist.wheel) as zf:
        (meta,) = [n for n in zf.namelist() if n.endswith("METADATA")]
        requires = [
            line.split(":", 1)[1].strip()
            for line in zf.read(meta).decode().splitlines()
            if line.startswith("Requires-Dist:") and "extra ==" not in line
        ]
    direct = {re.split(r"[ <>=!~;\[]", r, maxsplit=1)[0].lower().replace("_", "-") for r in requires}
    direct -= {"tomli"}  # python_version < '3.11'
    assert {ref.split("/")[1].split("@")[0] for ref in graph[subject["bom-ref"]]} == direct


def test_the_sbom_refuses_a_requirement_the_build_environment_lacks(tmp_path: Path) -> None:
    wheel = tmp_path / "hostile-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(
            "hostile-0.1.dist-info/METADATA",
            "Metadata-Version: 2.1\nName: hostile\nVersion: 0.1\nRequires-Dist: click>=8\n"
            "Requires-Dist: no-such-distribution-anywhere>=1\n",
        )
    proc = subprocess.run(
        [DEV_VENV / "bin" / "python", CI / "sbom.py", wheel], capture_output=True, text=True
    )
    assert proc.returncode == 1 and "no-such-distribution-anywhere" in proc.stderr, proc.stderr
    assert proc.stdout == ""


def test_the_pinned_requirements_install_the_release_wheel_with_nothing_unlisted(
    release_dist: ReleaseDist, tmp_path: Path
) -> None:
    """The requirements file covers everything the wheel (with `keyless`) and its build need:
    pip's resolver, in --require-hashes mode, accepts the file plus the wheel by its hash."""
    requirements = tmp_path / "requirements.txt"
    requirements.write_text(
        (REPO_ROOT / "examples" / "ci" / "modelpack-requirements.txt").read_text()
        + f"modelpack-oci[keyless] @ {release_dist.wheel.as_uri()} \\\n"
        + f"    --hash=sha256:{hashlib.sha256(release_dist.wheel.read_bytes()).hexdigest()}\n"
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--ignore-installed",
            "--require-hashes",
            "-r",
            str(requirements),
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "Would install" in proc.stdout and "modelpack-oci-" in proc.stdout
