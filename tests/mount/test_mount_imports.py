"""The node cache starts fast: importing ``modelpack.mount`` pulls in no heavy third-party module.

A cache hit (``modelpack pull REF@sha256:… --cache DIR``) must start in well under a second, so
the network, signing, Kubernetes and tensor libraries are imported only by the code that uses them.
"""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = {"requests", "boto3", "botocore", "torch", "kubernetes", "docker", "cryptography", "tqdm", "yaml"}


def modules_after_import(*modules: str) -> set[str]:
    """Every module a fresh interpreter has loaded after importing ``modules``."""
    code = f"import json, sys, {', '.join(modules)}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return set(json.loads(out))


def test_node_cache_and_k8s_import_no_heavy_module() -> None:
    for module in ("modelpack.mount", "modelpack.mount.cache", "modelpack.mount.k8s"):
        heavy = {name.split(".")[0] for name in modules_after_import(module)} & HEAVY
        assert not heavy, f"{module} imports {sorted(heavy)} at import time"


def test_node_cache_does_not_import_loader_or_cli() -> None:
    loaded = modules_after_import("modelpack.mount.cache", "modelpack.mount.k8s")
    assert not {m for m in loaded if m.startswith(("modelpack.loader", "modelpack.cli"))}
