#!/usr/bin/env bash
# Installs sigstore-js (@sigstore/verify and what it needs, exact versions) into .node/sigstore-js,
# idempotently: tests/test_interop_sigstore_js.py verifies the bundles modelpack writes with it.
# Re-installs only when the pinned versions (the stamp) changed or the install is incomplete.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${SIGSTORE_JS_DIR:-.node/sigstore-js}
# @sigstore/verify 3.1.x is the newest line that runs on node 20 (4.x needs node >= 22)
PINS='"@sigstore/verify": "3.1.1", "@sigstore/bundle": "4.0.0", "@sigstore/core": "3.2.1", "@sigstore/protobuf-specs": "0.5.2"'
stamp="$DEST/.modelpack-installed"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$PINS" ] && [ -f "$DEST/node_modules/@sigstore/verify/package.json" ]; then
  exit 0
fi
command -v npm >/dev/null 2>&1 || { echo "sigstore-js: npm is not installed (bootstrap installs nodejs npm)" >&2; exit 1; }
mkdir -p "$DEST"
cat > "$DEST/package.json" <<JSON
{
  "name": "modelpack-sigstore-js-interop",
  "private": true,
  "description": "sigstore-js for tests/test_interop_sigstore_js.py (written by .ci/sigstore-js.sh)",
  "dependencies": { $PINS }
}
JSON
rm -f "$stamp"
(cd "$DEST" && npm install --no-audit --no-fund --loglevel=error)
printf '%s' "$PINS" > "$stamp"
echo "sigstore-js: installed in $DEST"
