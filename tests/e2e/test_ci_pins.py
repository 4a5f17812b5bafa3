"""No CI job that holds secrets installs an unpinned name.

A job that can read a signing key, a registry password or an OIDC token runs whatever its `pip
install` fetched: a name resolved from an index (`pip install 'modelpack-oci[loader]'`) runs code
of whoever controls that name, with those secrets. Every example (examples/ci/*.yml) and every
command block of the documents is scanned: in a job holding secrets, `pip install` must be
`--require-hashes -r FILE` with FILE kept in the repository and every line of it pinned `==` with
a `--hash`, or a local wheel with `--no-index` (the wheel the job built from its pinned commit).
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.paths import REPO_ROOT

EXAMPLES_CI = REPO_ROOT / "examples" / "ci"
DOCUMENTS = [
    REPO_ROOT / "README.md",
    *sorted((REPO_ROOT / "docs").glob("*.md")),
    REPO_ROOT / "examples" / "README.md",
]
PIP_INSTALL = re.compile(r"(?:\bpip3?|python3?\s+-m\s+pip|\buv\s+pip)[\"']?\s+install\b")
HOLDS_SECRETS = re.compile(
    r"secrets\.|id-token:\s*write|id_tokens:|_PASSWORD|_TOKEN\b|SIGNING_KEY|--password-stdin|--sign-key"
)
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)


def _requirements_file_is_pinned(path: Path) -> str | None:
    """None when every requirement of ``path`` is `name==version` with a sha256; else why not."""
    if not path.is_file():
        return f"{path.name} is not kept in the repository (examples/ci/)"
    logical = re.sub(r"\\\n", " ", path.read_text())
    lines = [line.split("#", 1)[0].strip() for line in logical.splitlines()]
    lines = [line for line in lines if line]
    if not lines:
        return f"{path.name} is empty"
    for line in lines:
        if not re.match(r"^[A-Za-z0-9._-]+==[^\s;]+(\s*;[^-]*)?\s+--hash=sha256:[0-9a-f]{64}", line):
            return f"{path.name}: {line!r} is not pinned by version and hash"
    return None


def unpinned_installs(commands: str, requirements_dir: Path = EXAMPLES_CI) -> list[str]:
    """The `pip install` commands of a shell script that could fetch an unpinned name."""
    script = re.sub(r"\\\n", " ", commands)
    found = []
    for line in script.splitlines():
        for part in re.split(r"&&|\|\||;", line):
            match = PIP_INSTALL.search(part)
            if not match:
                continue
            try:
                args = shlex.split(part[match.end() :], comments=True)
            except ValueError:
                found.append(part.strip())
                continue
            targets = [a for a in args if not a.startswith("-")]
            files = [args[i + 1] for i, a in enumerate(args[:-1]) if a in ("-r", "--requirement")]
            targets = [t for t in targets if t not in files]
            if "--require-hashes" in args and files and not targets:
                problems = [_requirements_file_is_pinned(requirements_dir / Path(f).name) for f in files]
                if not any(problems):
                    continue
                found.append(f"{part.strip()}: {'; '.join(p for p in problems if p)}")
            elif "--no-index" in args and targets and all(t.endswith(".whl") for t in targets) and not files:
                continue  # the wheel the job built, nothing fetched
            else:
                found.append(part.strip())
    return found


def _shell(value: Any) -> str:
    return "\n".join(value) if isinstance(value, list) else str(value or "")


def ci_jobs(path: Path) -> dict[str, tuple[bool, str]]:
    """job name → (holds secrets, its shell commands) for a GitHub workflow or a GitLab pipeline."""
    doc: dict[str, Any] = yaml.safe_load(path.read_text())
    jobs: dict[str, tuple[bool, str]] = {}
    if "jobs" in doc:  # GitHub Actions: a job holds what it or the workflow names
        workflow_secrets = bool(
            HOLDS_SECRETS.search(yaml.safe_dump({k: v for k, v in doc.items() if k != "jobs"}))
        )
        for name, job in doc["jobs"].items():
            text = yaml.safe_dump(job)
            commands = "\n".join(_shell(step.get("run")) for step in job.get("steps", []))
            jobs[name] = (workflow_secrets or bool(HOLDS_SECRETS.search(text)), commands)
    else:  # GitLab: every job of a protected ref sees the project's CI/CD variables
        default = doc.get("default", {}) if isinstance(doc.get("default"), dict) else {}
        for name, job in doc.items():
            if not isinstance(job, dict) or name in ("variables", "default", "workflow", "include", "stages"):
                continue
            commands = "\n".join(
                _shell(job.get(key, default.get(key, doc.get(key))))
                for key in ("before_script", "script", "after_script")
            )
            jobs[name] = (True, commands)
    return jobs


def _document_blocks(path: Path) -> list[tuple[str, str]]:
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(path.read_text())]


def violations_in_document(path: Path) -> list[str]:
    """Unpinned installs in a document's command blocks that hold secrets (a YAML block: its strings)."""
    found = []
    for lang, block in _document_blocks(path):
        if not HOLDS_SECRETS.search(block):
            continue
        commands = _all_strings(yaml.safe_load(block)) if lang in ("yaml", "yml") else block
        found += [f"{path.name}: {c}" for c in unpinned_installs(commands)]
    return found


def _all_strings(value: Any) -> str:
    if isinstance(value, dict):
        return "\n".join(_all_strings(v) for v in value.values())
    if isinstance(value, list):
        return "\n".join(_all_strings(v) for v in value)
    return value if isinstance(value, str) else ""


@pytest.mark.parametrize("path", sorted(EXAMPLES_CI.glob("*.yml")), ids=lambda p: p.name)
def test_no_ci_example_job_holding_secrets_installs_an_unpinned_name(path: Path) -> None:
    jobs = ci_jobs(path)
    assert jobs
    bad = {
        name: unpinned_installs(commands)
        for name, (secrets, commands) in jobs.items()
        if secrets and unpinned_installs(commands)
    }
    assert not bad, f"{path.name}: jobs holding secrets install unpinned names: {bad}"
    # each example does install modelpack in its secret-holding jobs (the scan saw the commands)
    for name, (secrets, commands) in jobs.items():
        if secrets:
            assert PIP_INSTALL.search(commands), f"{path.name}: job {name} installs nothing the scan saw"


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda p: p.name)
def test_no_document_command_block_holding_secrets_installs_an_unpinned_name(path: Path) -> None:
    assert not violations_in_document(path)


def test_the_scan_finds_unpinned_installs_in_jobs_holding_secrets(tmp_path: Path) -> None:
    """The checks can fail: hostile variants of the examples are each caught."""
    gh = tmp_path / "gh.yml"
    gh.write_text(
        "on: push\njobs:\n"
        "  publish:\n    runs-on: x\n    steps:\n"
        "      - run: pip install 'modelpack-oci[loader]'\n"
        "      - run: modelpack push . r --sign-key env:K\n        env:\n          K: ${{ secrets.K }}\n"
        "  keyless:\n    runs-on: x\n    permissions:\n      id-token: write\n    steps:\n"
        "      - run: python -m pip install -U modelpack-oci==0.1.0\n"
        "  lint:\n    runs-on: x\n    steps:\n      - run: pip install ruff\n"
    )
    jobs = ci_jobs(gh)
    assert jobs["publish"][0] and jobs["keyless"][0] and not jobs["lint"][0]
    assert unpinned_installs(jobs["publish"][1]) == ["pip install 'modelpack-oci[loader]'"]
    assert unpinned_installs(jobs["keyless"][1])  # == without a hash is a name an index resolves
    gl = tmp_path / "gl.yml"
    gl.write_text(
        "publish:\n  before_script:\n    - pip install modelpack-oci\n  script:\n    - modelpack push\n"
    )
    assert unpinned_installs(ci_jobs(gl)["publish"][1]) == ["pip install modelpack-oci"]
    # --require-hashes only counts with a file kept here whose every line is hashed
    (tmp_path / "loose.txt").write_text("modelpack-oci==0.1.0\n")
    (tmp_path / "pinned.txt").write_text("click==8.1.0 \\\n    --hash=sha256:" + "a" * 64 + "\n")
    assert unpinned_installs("pip install --require-hashes -r ci/loose.txt", tmp_path)
    assert unpinned_installs("pip install --require-hashes -r ci/absent.txt", tmp_path)
    assert unpinned_installs("pip install --require-hashes -r ci/pinned.txt modelpack-oci", tmp_path)
    assert not unpinned_installs("pip install --require-hashes -r ci/pinned.txt", tmp_path)
    assert unpinned_installs('"$VENV/bin/pip" install modelpack-oci')  # a venv's pip, quoted
    assert unpinned_installs("pip install dist/modelpack_oci-0.1.0-py3-none-any.whl")  # deps from an index
    assert not unpinned_installs("pip install --no-deps --no-index dist/modelpack_oci-0.1.0-py3-none-any.whl")
    doc = tmp_path / "doc.md"
    doc.write_text(
        "```sh\npip install 'modelpack-oci[s3]'\n```\n\n"
        "```sh\npip install modelpack-oci && modelpack push ckpt r --sign-key env:MODELPACK_SIGNING_KEY\n```\n"
    )
    assert len(violations_in_document(doc)) == 1
