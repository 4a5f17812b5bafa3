"""Helpers shared by the trust tests (not a test module): pack to a layout, materialise files,
play a concurrent writer that keeps dropping referrers from the tag-schema fallback index."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import requests
from modelpack.mediatypes import MEDIA_TYPE_OCI_INDEX, layer_filepath

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


@contextlib.contextmanager
def referrers_index_clobbered(registry_host: str, repository: str, digest: str) -> Iterator[None]:
    """Another writer that keeps replacing the tag-schema fallback index of ``digest`` (the
    ``sha256-<hex>`` tag) with an empty one, for as long as the block runs: a referrer written
    meanwhile is dropped again and again, so a writer that reads back must end up failing."""
    url = f"http://{registry_host}/v2/{repository}/manifests/sha256-{digest[7:]}"
    empty = json.dumps({"schemaVersion": 2, "mediaType": MEDIA_TYPE_OCI_INDEX, "manifests": []}).encode()
    stop = threading.Event()

    def clobber() -> None:
        with requests.Session() as s:
            while not stop.is_set():
                s.put(url, data=empty, headers={"Content-Type": MEDIA_TYPE_OCI_INDEX}, timeout=30)
                stop.wait(0.02)

    writer = threading.Thread(target=clobber, daemon=True)
    writer.start()
    try:
        yield
    finally:
        stop.set()
        writer.join(30)
