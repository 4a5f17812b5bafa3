"""KServe's own OCI fetch as a peer for modelcar pulls, shared by ``kserve.py`` and ``transfer.py``.

A modelcar is an OCI image whose layers hold the model under ``models/`` (uncompressed tar, as
``modelpack push --format image`` writes it and KServe's ``oci+fetch`` reads it). The peer is
``kserve-storage`` 0.21 from the peers venv (``.ci/peers-venv.sh``): ``Storage.download_files``,
the call KServe's storage-initializer entrypoint makes, with ``KSERVE_OCI_INSECURE_REGISTRY`` for
a plain-HTTP loopback registry. It verifies no digest and fsyncs nothing; modelpack does both,
so a row comparing the two says so.

Each contender is one process whose command and environment come from here; the benchmarks
time it and read its peak RSS themselves (from a small launcher or /proc, never from a child
forked off the benchmark, which would start with the benchmark's high-water mark).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PEERS_PYTHON = ROOT / ".venv-peers" / "bin" / "python"
MODELPACK = ROOT / ".venv" / "bin" / "modelpack"
KSERVE_SCRIPT = (
    "import sys; from kserve_storage import Storage; Storage.download_files([sys.argv[1]], [sys.argv[2]])"
)
#: what the row comparing the two must say about the peer
PEER_CAVEAT = "kserve-storage verifies no digest and fsyncs nothing; modelpack verifies every blob and fsyncs"


def peer_available() -> bool:
    return PEERS_PYTHON.exists()


def make_model(directory: Path, size: int, files: int = 4) -> dict[str, str]:
    """Random (incompressible) weight files plus a config; returns name → sha256."""
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps({"model_type": "benchmark", "files": files}))
    per = size // files
    for i in range(files):
        with open(directory / f"model-{i:05d}.bin", "wb") as f:
            left = per
            while left:
                n = min(left, 16 << 20)
                f.write(os.urandom(n))
                left -= n
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in directory.iterdir()}


def kserve_storage(
    host: str, repo: str, dest: Path, base_env: dict[str, str]
) -> tuple[list[str], dict[str, str]]:
    """``kserve-storage`` fetching ``oci://HOST/REPO`` into ``dest``: (argv, env)."""
    env = {**base_env, "KSERVE_OCI_INSECURE_REGISTRY": "true"}
    return [str(PEERS_PYTHON), "-c", KSERVE_SCRIPT, f"oci://{host}/{repo}", str(dest)], env


def modelpack_initializer(
    host: str, repo: str, dest: Path, base_env: dict[str, str], *, jobs: int = 4, cache: Path | None = None
) -> tuple[list[str], dict[str, str]]:
    """``modelpack storage-initializer modelpack://HOST/REPO DEST`` (verifying, fsyncing), through
    a node cache at ``cache`` when given: (argv, env)."""
    env = {
        **base_env,
        "MODELPACK_PLAIN_HTTP": "true",
        "MODELPACK_PROGRESS_INTERVAL": "0",
        "MODELPACK_JOBS": str(jobs),
    }
    if cache is not None:
        env["MODELPACK_CACHE"] = str(cache)
    exe = str(MODELPACK) if MODELPACK.exists() else sys.executable
    head = [exe] if MODELPACK.exists() else [exe, "-m", "modelpack.cli"]
    return [*head, "storage-initializer", f"modelpack://{host}/{repo}", str(dest)], env


__all__ = [
    "KSERVE_SCRIPT",
    "PEERS_PYTHON",
    "PEER_CAVEAT",
    "kserve_storage",
    "make_model",
    "modelpack_initializer",
    "peer_available",
]
