#!/usr/bin/env bash
# mypy resolves packages by folder, so give it the installed shape of the namespace:
# build/typecheck/modelpack/{*.py, registry/, mediatypes/ → ../../mediatypes, …}.
set -euo pipefail
cd "$(dirname "$0")/.."
tree=build/typecheck/modelpack
rm -rf build/typecheck && mkdir -p "$tree"
for entry in modelpack/*; do ln -s "$PWD/$entry" "$tree/$(basename "$entry")"; done
for sub in mediatypes signing mount loader; do ln -s "$PWD/$sub" "$tree/$sub"; done
