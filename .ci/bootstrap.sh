#!/usr/bin/env bash
# Installs what `make test` (the default, `bootstrap.sh test`) or `make demo` (`bootstrap.sh demo`)
# needs on a fresh Debian machine, idempotently.
#   demo: Debian's docker-registry when missing, a venv with torch==2.13.0 (the CPU build; never a
#         plain "torch" requirement, which would pull a CUDA build) and the package in editable
#         mode with the `demo` extra — nothing the demo does not use.
#   test: all of that, plus skopeo, htpasswd, strace, node/npm, containerd, podman and mmdebstrap
#         (the image and the kube play tests), the test extras, the
#         vLLM venv (.ci/vllm-venv.sh) and the peer clients' venv (.ci/peers-venv.sh).
# The editable install lets setuptools' finder map the folders into modelpack.* as setup.py does.
set -euo pipefail
cd "$(dirname "$0")/.."
MODE=${1:-test}
case "$MODE" in test | demo) ;; *) echo "usage: $0 [test|demo]" >&2; exit 2 ;; esac
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
need_apt=()
command -v docker-registry >/dev/null 2>&1 || [ -x /usr/bin/docker-registry ] || need_apt+=(docker-registry)
if [ "$MODE" = test ]; then
  command -v skopeo >/dev/null 2>&1 || need_apt+=(skopeo)
  command -v htpasswd >/dev/null 2>&1 || need_apt+=(apache2-utils)
  # strace: tests/test_pull_dir.py reads the fsync/rename order from the real syscalls
  command -v strace >/dev/null 2>&1 || need_apt+=(strace)
  # node and npm: tests/test_interop_sigstore_js.py verifies bundles with sigstore-js
  command -v npm >/dev/null 2>&1 || need_apt+=(nodejs npm)
  # containerd (with ctr): tests/test_interop_containerd.py pulls the image-shaped variant with it
  command -v containerd >/dev/null 2>&1 && command -v ctr >/dev/null 2>&1 || need_apt+=(containerd)
  # podman (kube play) and mmdebstrap: `make image` and tests/e2e/test_podman_kube.py build the
  # modelpack image from Debian packages and run the generated Kubernetes objects with it
  command -v podman >/dev/null 2>&1 || need_apt+=(podman)
  command -v mmdebstrap >/dev/null 2>&1 || need_apt+=(mmdebstrap)
  command -v newuidmap >/dev/null 2>&1 || need_apt+=(uidmap)
fi
if [ ${#need_apt[@]} -gt 0 ] && [ "${MODELPACK_SKIP_APT:-}" != 1 ]; then
  echo "bootstrap: installing Debian packages: ${need_apt[*]}"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

fresh() {  # the stamp exists and is newer than everything that decides what is installed
  [ -f "$1" ] && [ ! pyproject.toml -nt "$1" ] && [ ! setup.py -nt "$1" ] && [ ! .ci/bootstrap.sh -nt "$1" ]
}
test_stamp="$VENV/.modelpack-installed"
demo_stamp="$VENV/.modelpack-installed-demo"
if [ "$MODE" = test ]; then
  stamp=$test_stamp
  # bench: the benchmarks' peers and plots (runai-model-streamer, fastsafetensors, matplotlib), for `make bench`
  extras="test,loader,s3,image,k8s,bench,demo"
else
  stamp=$demo_stamp
  extras="demo"
fi
if ! fresh "$stamp" && ! fresh "$test_stamp"; then  # a test set-up covers the demo's
  [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
  "$VENV/bin/pip" install -q "torch==2.13.0"
  # the distribution was called "modelpack" before it became "modelpack-oci": an editable install of
  # this checkout under the old name would claim the same package and `modelpack` script twice
  bash .ci/drop-old-distribution.sh "$VENV"
  "$VENV/bin/pip" install -q -e ".[$extras]"
  touch "$stamp"
fi
[ "$MODE" = test ] || exit 0
[ "${MODELPACK_SKIP_VLLM:-}" = 1 ] || bash .ci/vllm-venv.sh  # vLLM (CPU) for tests/test_vllm.py, own venv
bash .ci/peers-venv.sh  # modelpack-client for tests/test_interop_*.py, own venv (its script is also `modelpack`)
bash .ci/sigstore-js.sh  # sigstore-js (pinned, npm) in .node/ for tests/test_interop_sigstore_js.py
