"""What a snapshot must contain, derived from its manifest alone: path → (digest, size, linked).

The ready marker records what a pull built, but a marker can be edited and a snapshot directory
can gain files; ``cache verify`` (and anyone binding a pinned digest to files) needs the truth
from the manifest, whose digest is the pin. Raw layers name their file and digest in the
manifest; tar layers (the image-shaped variant, modelcars, ``tar`` ModelPack layers: which
ones, and which members are files, ``transfer.layer_formats`` says) are read again from the
store — the blob hashed against its digest, the uncompressed stream against its ``diff_id`` —
and each member hashed, with the same path rules as extraction.
"""

from __future__ import annotations

import hashlib
import os
import stat
import tarfile
from dataclasses import dataclass
from typing import BinaryIO

from modelpack.mediatypes.annotations import safe_relative_path
from modelpack.mount.snapshot_files import raw_layer_path
from modelpack.mount.store import Store

from modelpack.errors import (
    DigestMismatchError,
    ManifestError,
    UnsafePathError,
    UnsafeTarError,
)
from modelpack.oci.descriptor import Descriptor, Manifest
from modelpack.oci.digest import HASH_CHUNK, HashingReader, sha256_file
from modelpack.oci.image_config import image_diff_ids
from modelpack.transfer.layer_formats import LayerFormat, manifest_layer_formats, needs_config
from modelpack.transfer.untar import MAX_TAR_MEMBERS, open_layer_stream


@dataclass(frozen=True)
class ExpectedFile:
    path: str
    digest: str
    size: int
    linked: bool  # a hard link of the layer blob (raw layers); False: extracted from a tar layer


def _tar_members(
    blob: BinaryIO, layer: Descriptor, fmt: LayerFormat, diff_id: str | None
) -> list[ExpectedFile]:
    where = f"layer {layer.digest}"
    strip = fmt.strip
    compressed = HashingReader(blob)
    uncompressed = HashingReader(open_layer_stream(compressed, fmt.format, where))  # type: ignore[arg-type]
    out: list[ExpectedFile] = []
    with tarfile.open(fileobj=uncompressed, mode="r|", encoding="utf-8") as tar:  # type: ignore[call-overload]
        for count, member in enumerate(tar, 1):
            if count > MAX_TAR_MEMBERS:
                raise UnsafeTarError(f"{where}: more than {MAX_TAR_MEMBERS} members")
            name = member.name[2:] if member.name.startswith("./") else member.name
            if member.isdir():
                continue
            if strip and not name.startswith(strip):
                if fmt.skip_outside:
                    continue  # a base image's files: extraction passes them over, so does this
                raise UnsafeTarError(f"{where}: member {member.name!r} is outside {strip!r}")
            try:
                rel = safe_relative_path(name[len(strip) :] if strip else name, what=f"{where} member")
            except UnsafePathError as exc:
                raise UnsafeTarError(str(exc)) from exc
            if not member.isreg():
                raise UnsafeTarError(f"{where}: member {member.name!r} is not a regular file")
            src = tar.extractfile(member)
            h = hashlib.sha256()
            n = 0
            while src is not None:
                chunk = src.read(HASH_CHUNK)
                if not chunk:
                    break
                h.update(chunk)
                n += len(chunk)
            out.append(ExpectedFile(rel, "sha256:" + h.hexdigest(), n, False))
    uncompressed.drain()
    compressed.drain()
    if compressed.digest != layer.digest or compressed.size != layer.size:
        raise DigestMismatchError(layer.digest, compressed.digest, what=where)
    if diff_id is not None and uncompressed.digest != diff_id:
        raise DigestMismatchError(diff_id, uncompressed.digest, what=f"{where} diff_id")
    return out


def expected_files(
    manifest: Manifest, store: Store, config_raw: bytes | None = None
) -> dict[str, ExpectedFile]:
    """Every file the snapshot of ``manifest`` must hold, keyed by path.

    ``config_raw`` (verified by the caller) is needed for an image config's ``diff_ids``
    (``layer_formats.needs_config``). Which layers are tars, and which of their members are files,
    is ``transfer.layer_formats``' answer, as for extraction. Raises ``ManifestError``/
    ``UnsafeTarError`` for a manifest no snapshot could be built from, ``DigestMismatchError`` for
    a damaged tar layer blob and ``OSError`` for a missing one.
    """
    formats = manifest_layer_formats(manifest)
    diff_ids: list[str] = []
    if needs_config(manifest):
        if config_raw is None:
            raise ManifestError(f"{manifest.digest}: image config missing")
        diff_ids = image_diff_ids(config_raw, len(manifest.layers), where=str(manifest.digest))
    out: dict[str, ExpectedFile] = {}
    for i, (layer, fmt) in enumerate(zip(manifest.layers, formats, strict=True)):
        if fmt.is_raw:
            files = [ExpectedFile(raw_layer_path(manifest, layer), str(layer.digest), layer.size, True)]
        else:
            path = store.blob_path(layer.digest)
            # the blob first: a blob swapped for a bomb is refused before it is decompressed
            actual, size = sha256_file(path)
            if actual != layer.digest or size != layer.size:
                raise DigestMismatchError(layer.digest, actual, what=f"layer blob {path}")
            with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), "rb") as blob:
                if not stat.S_ISREG(os.fstat(blob.fileno()).st_mode):
                    raise ManifestError(f"{path}: not a regular file")
                files = _tar_members(blob, layer, fmt, diff_ids[i] if fmt.diff_id else None)
        for f in files:
            if f.path in out:
                raise ManifestError(f"{manifest.digest}: two layers claim the path {f.path!r}")
            out[f.path] = f
    return out
