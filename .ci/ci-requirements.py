"""Write the hash-pinned requirements file the CI examples install from (examples/ci/).

    ci-requirements.py WHEEL > examples/ci/modelpack-requirements.txt

Resolves, with pip's own resolver against the index pip is configured with (`pip install
--dry-run --report`, nothing installed), what a CI job needs to build modelpack from a pinned commit
(`build`, `setuptools`) and to run it with the `keyless` extra, and prints every distribution but
modelpack-oci itself as `name==version --hash=sha256:…`. The job then installs with `pip install
--require-hashes -r …`: pip refuses anything unlisted, unpinned or of another hash. The resolution
is for this interpreter and platform (Python 3.11 on Linux x86_64, the examples' runners).
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

BUILD_TOOLS = ["build>=1.2", "setuptools>=77"]
EXTRAS = "keyless"


def resolve(wheel: str) -> list[tuple[str, str, str]]:
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--quiet",
                "--dry-run",
                "--ignore-installed",
                "--report",
                str(report),
                f"{wheel}[{EXTRAS}]",
                *BUILD_TOOLS,
            ],
            check=True,
        )
        installs = json.loads(report.read_text())["install"]
    pinned = []
    for item in installs:
        name, version = item["metadata"]["name"], item["metadata"]["version"]
        if name == "modelpack-oci":
            continue
        hashes = item["download_info"].get("archive_info", {}).get("hashes", {})
        if "sha256" not in hashes:
            raise SystemExit(f"ci-requirements: the index gave no sha256 for {name} {version}")
        pinned.append((name.lower(), version, hashes["sha256"]))
    return sorted(pinned)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: ci-requirements.py WHEEL")
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    print("# Hash-pinned: what the CI examples install before building modelpack from its pinned commit")
    print(f"# (build tools, and modelpack's dependencies with the `{EXTRAS}` extra), for Python {py} on")
    print(
        f"# {platform.system()} {platform.machine()}. `pip install --require-hashes -r` refuses anything else."
    )
    print("# Regenerate after changing pyproject.toml's dependencies: make dist, then")
    print(
        "#   .venv/bin/python .ci/ci-requirements.py dist/modelpack_oci-*.whl > examples/ci/modelpack-requirements.txt"
    )
    for name, version, sha in resolve(sys.argv[1]):
        print(f"{name}=={version} \\\n    --hash=sha256:{sha}")
