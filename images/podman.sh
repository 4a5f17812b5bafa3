#!/usr/bin/env bash
# podman with this repository's settings (images/containers.conf) unless CONTAINERS_CONF is set:
# the one place that knows what the machine's podman needs. Used by images/build.sh (make image)
# and tests/e2e/test_podman_kube.py.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export CONTAINERS_CONF="${CONTAINERS_CONF:-$here/containers.conf}"
exec podman "$@"
