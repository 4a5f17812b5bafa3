"""Helpers shared by the loader tests (not a test module)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from modelpack.loader.plan import ShardRule
from safetensors.torch import load_file

from modelpack import api
from modelpack.oci.descriptor import Descriptor, Manifest
from modelpack.targets.layout import OCILayoutTarget
from tests.fixtures.loopback import free_port
from tests.paths import REPO_ROOT


def reference_tensors(directory: Path | str) -> dict[str, torch.Tensor]:
    """What ``safetensors.torch.load_file`` returns for every shard of a checkpoint."""
    out: dict[str, torch.Tensor] = {}
    for root, _, files in os.walk(directory):
        for f in sorted(files):
            if f.endswith(".safetensors"):
                out.update(load_file(os.path.join(root, f)))
    return out


def expected_shard(full: torch.Tensor, rule: ShardRule, tp: int, rank: int) -> torch.Tensor:
    if rule is ShardRule.REPLICATE or tp == 1:
        return full
    dim = 0 if rule is ShardRule.DIM0 else 1
    parts = torch.chunk(full, tp, dim)
    if rank < len(parts):
        return parts[rank]
    shape = list(full.shape)
    shape[dim] = 0
    return full.new_empty(shape)


@dataclass
class Layout:
    target: OCILayoutTarget
    digest: str
    desc: Descriptor
    manifest: Manifest
    path: Path

    @property
    def ref(self) -> str:
        return f"oci:{self.path}@{self.digest}"

    def weight_blob(self, name_part: str = "") -> tuple[Descriptor, Path]:
        for layer in self.manifest.layers:
            rel = (layer.annotations or {}).get("org.cncf.model.filepath", "")
            if rel.endswith(".safetensors") and name_part in rel:
                return layer, Path(self.target.blob_path(layer.digest))
        raise AssertionError(f"no weight layer matching {name_part!r}")


def pack_layout(checkpoint: Path, layout: Path, tag: str = "v1") -> Layout:
    """Pack into an OCI layout by copying (so corrupting a blob never touches the checkpoint)."""
    from modelpack.targets.opener import TargetOptions

    api.pack(str(checkpoint), f"oci:{layout}:{tag}", target_options=TargetOptions(link="copy"))
    target = OCILayoutTarget(str(layout))
    desc = target.resolve(tag)
    manifest, digest = api.fetch_manifest(target, tag)
    return Layout(target, digest, desc, manifest, layout)


def corrupt(path: Path, offset: int) -> None:
    """Flip one byte in place (blobs are read-only once committed: lift that first)."""
    os.chmod(path, 0o644)
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def run_gloo_ranks(
    script: str,
    world: int,
    args: Callable[[int], list[str]],
    env: Mapping[str, str] | None = None,
    rank_env: Callable[[int], Mapping[str, str]] | None = None,
) -> list[dict[str, Any]]:
    """Run ``script`` (``python -c``) as ``world`` processes of one gloo group over loopback
    (``INIT``, ``RANK``, ``WORLD`` in their environment, plus ``env`` and ``rank_env(rank)``; argv
    ``args(rank)``) and return each rank's ``RESULT {json}`` line, by rank. A rank that fails, or
    is left waiting in a collective past 300 s, fails the test with its stderr."""
    init = f"tcp://127.0.0.1:{free_port()}"
    procs = []
    for r in range(world):
        penv = dict(os.environ, INIT=init, RANK=str(r), WORLD=str(world), OMP_NUM_THREADS="1")
        penv.update(env or {})
        penv.update(rank_env(r) if rank_env else {})
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", script, *args(r)],
                env=penv,
                cwd=str(REPO_ROOT),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    results = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-4000:]
        line = next(x for x in out.splitlines() if x.startswith("RESULT "))
        results.append(json.loads(line[len("RESULT ") :]))
    return sorted(results, key=lambda d: d["rank"])
