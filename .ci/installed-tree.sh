#!/usr/bin/env bash
# mypy and lint-imports read the package as users install it: the wheel built from this tree,
# installed (without dependencies) into build/installed. Its layout is what pip puts into a
# user's site-packages (modelpack/, modelpack/mount/, …), so the tools see exactly the modules the
# wheel ships and nothing else of the checkout (no modelpack.tests, no modelpack.benchmarks).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
rm -rf build/installed
"$VENV/bin/pip" install -q --no-deps --no-build-isolation --no-compile --target build/installed . \
  2> >(grep -v "is ignored: it is neither" >&2)
# setuptools leaves its own build/lib copy behind; nothing reads it
rm -rf build/lib build/bdist.*
