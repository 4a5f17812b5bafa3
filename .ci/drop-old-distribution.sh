#!/usr/bin/env bash
# Usage: drop-old-distribution.sh VENV
# Removes the distribution "modelpack" from VENV when it is an editable install of THIS checkout
# (the project's distribution name before "modelpack-oci"). Another package of that name (PyPI's
# unrelated "modelpack") is left alone.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=$1
[ -x "$VENV/bin/pip" ] || exit 0
location=$("$VENV/bin/pip" show modelpack 2>/dev/null | sed -n 's/^Editable project location: //p' || true)
if [ -n "$location" ] && [ "$(realpath "$location")" = "$(realpath .)" ]; then
  echo "bootstrap: replacing the old editable distribution 'modelpack' in $VENV by 'modelpack-oci'"
  "$VENV/bin/pip" uninstall -q -y modelpack
fi
