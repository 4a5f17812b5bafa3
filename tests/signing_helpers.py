"""Helpers shared by the trust tests (not a test module): pack to a layout, materialise files."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from modelpack.mediatypes import layer_filepath

from modelpack import api
from modelpack.oci.descriptor import Descriptor, Manifest
from modelpack.targets.layout import OCILayoutTarget

SMALL_CHUNK = 64 * 1024


@dataclass
class Packed:
    target: OCILayoutTarget
    ref: str
    desc: Descriptor
    manifest: Manifest


def pack_layout(checkpoint: Path, layout: Path, tag: str = "v1") -> Packed:
    ref = f"oci:{layout}:{tag}"
    api.pack(str(checkpoint), ref)
    target = OCILayoutTarget(str(layout))
    desc = target.resolve(tag)
    manifest, _ = api.fetch_manifest(target, tag)
    return Packed(target, ref, desc, manifest)


def materialise(target: OCILayoutTarget, manifest: Manifest, out: Path) -> Path:
    """Files at their paths from the layout's blobs (what a pull produces for raw layers)."""
    for layer in manifest.layers:
        rel = layer_filepath(layer.annotations)
        assert rel
        dst = out / rel
        os.makedirs(dst.parent, exist_ok=True)
        shutil.copyfile(target.blob_path(layer.digest), dst)
    return out
