#!/usr/bin/env bash
# Installs everything `make test` / `make demo` need on a fresh Debian machine, idempotently:
# Debian packages (docker-registry, skopeo, htpasswd, containerd) when missing, a venv with torch==2.13.0
# (the CPU build; never a plain "torch" requirement, which would pull a CUDA build) and the
# package in editable mode (setuptools' finder maps the folders as setup.py does) with its test extras.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
need_apt=()
command -v docker-registry >/dev/null 2>&1 || [ -x /usr/bin/docker-registry ] || need_apt+=(docker-registry)
command -v skopeo >/dev/null 2>&1 || need_apt+=(skopeo)
command -v htpasswd >/dev/null 2>&1 || need_apt+=(apache2-utils)
# strace: tests/test_pull_dir.py reads the fsync/rename order from the real syscalls
command -v strace >/dev/null 2>&1 || need_apt+=(strace)
# node and npm: tests/test_interop_sigstore_js.py verifies bundles with sigstore-js
command -v npm >/dev/null 2>&1 || need_apt+=(nodejs npm)
# containerd (with ctr): tests/test_interop_containerd.py pulls the image-shaped variant with it
command -v containerd >/dev/null 2>&1 && command -v ctr >/dev/null 2>&1 || need_apt+=(containerd)
if [ ${#need_apt[@]} -gt 0 ] && [ "${MODELPACK_SKIP_APT:-}" != 1 ]; then
  echo "bootstrap: installing Debian packages: ${need_apt[*]}"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi
stamp="$VENV/.modelpack-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ setup.py -nt "$stamp" ] || [ .ci/bootstrap.sh -nt "$stamp" ]; then
  [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
  "$VENV/bin/pip" install -q "torch==2.13.0"
  # the distribution was called "modelpack" before it became "modelpack-oci": an editable install of
  # this checkout under the old name would claim the same package and `modelpack` script twice
  bash .ci/drop-old-distribution.sh "$VENV"
  # bench: the benchmarks' peers and plots (runai-model-streamer, matplotlib), for `make bench`
  "$VENV/bin/pip" install -q -e ".[test,loader,s3,image,k8s,bench]"
  touch "$stamp"
fi
[ "${MODELPACK_SKIP_VLLM:-}" = 1 ] || bash .ci/vllm-venv.sh  # vLLM (CPU) for tests/test_vllm.py, own venv
bash .ci/peers-venv.sh  # modelpack-client for tests/test_interop_*.py, own venv (its script is also `modelpack`)
