"""Helpers shared by the loader tests (not a test module)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from modelpack.loader.plan import ShardRule
from safetensors.torch import load_file

from modelpack import api
from modelpack.oci.descriptor import Descriptor, Manifest
from modelpack.targets.layout import OCILayoutTarget


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
