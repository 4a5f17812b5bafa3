#!/usr/bin/env bash
# Builds .venv-peers, the venv of the independent ModelPack clients that the interop tests
# (tests/test_interop_*.py) run against what modelpack writes, idempotently (a stamp skips it
# unless this script changed). modelpack-client lives here and not in .venv because it installs
# a console script that is also called `modelpack`: in .venv it would replace ours. The tests call
# it as `.venv-peers/bin/python -m modelpack_client`, never through PATH. kserve-storage (KServe's
# storage initializer library) is here for benchmarks/kserve.py.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${PEERS_VENV:-.venv-peers}
PYTHON=${PYTHON:-python3}
MODELPACK_CLIENT_VERSION=${MODELPACK_CLIENT_VERSION:-0.1.0}
KSERVE_STORAGE_VERSION=${KSERVE_STORAGE_VERSION:-0.21.0}
stamp="$VENV/.modelpack-peers-installed"
if [ -f "$stamp" ] && [ ! .ci/peers-venv.sh -nt "$stamp" ] && [ -x "$VENV/bin/python" ]; then
  exit 0
fi
echo "peers-venv: building $VENV with modelpack-client==$MODELPACK_CLIENT_VERSION"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip 2> >(grep -v "is ignored: it is neither" >&2)
"$VENV/bin/pip" install -q "modelpack-client==$MODELPACK_CLIENT_VERSION" 2> >(grep -v "is ignored: it is neither" >&2)
# kserve-storage: KServe's own storage initializer library, for benchmarks/kserve.py (side by side)
"$VENV/bin/pip" install -q "kserve-storage==$KSERVE_STORAGE_VERSION" 2> >(grep -v "is ignored: it is neither" >&2)
"$VENV/bin/python" -c "import modelpack_client; print('peers-venv: modelpack-client', modelpack_client.__name__)"
"$VENV/bin/python" -c "import kserve_storage; print('peers-venv: kserve-storage', kserve_storage.__name__)"
touch "$stamp"
