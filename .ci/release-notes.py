"""The version in modelpack/_version.py, and the CHANGELOG.md section that releases it.

    release-notes.py --version           prints the version (read statically, nothing imported)
    release-notes.py CHANGELOG.md 1.2.3  prints the `## [1.2.3] - DATE` section, heading included

Fails (exit 1) when the CHANGELOG has no section for the version or it is empty: a release
without notes is not built.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def version() -> str:
    tree = ast.parse((ROOT / "modelpack" / "_version.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__version__" for t in node.targets):
            if isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
                return node.value.value
    raise SystemExit("release-notes: modelpack/_version.py sets no __version__ string")


def section(changelog: str, wanted: str) -> str:
    heading = re.compile(rf"^## \[{re.escape(wanted)}\] - \d{{4}}-\d{{2}}-\d{{2}}$", re.M)
    found = heading.search(changelog)
    if not found:
        raise SystemExit(f"release-notes: CHANGELOG.md has no '## [{wanted}] - YYYY-MM-DD' section")
    following = re.compile(r"^## ", re.M).search(changelog, found.end())
    body = changelog[found.start() : following.start() if following else len(changelog)].rstrip() + "\n"
    if not body[found.end() - found.start() :].strip():
        raise SystemExit(f"release-notes: the CHANGELOG.md section of {wanted} is empty")
    return body


if __name__ == "__main__":
    if sys.argv[1:] == ["--version"]:
        print(version())
    elif len(sys.argv) == 3:
        sys.stdout.write(section(Path(sys.argv[1]).read_text(), sys.argv[2]))
    else:
        raise SystemExit("usage: release-notes.py --version | release-notes.py CHANGELOG.md VERSION")
