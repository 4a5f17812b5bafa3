"""The image-shaped variant of a model artifact (docs/node.md#the-image-shaped-variant), for runtimes that mount only images.

containerd (2.1+) image volumes unpack image layers, so the model must look like an image: no
``artifactType``, an ``application/vnd.oci.image.config.v1+json`` config whose ``rootfs.diff_ids``
are the sha256 of each uncompressed layer tar, and ``application/vnd.oci.image.layer.v1.tar``
(or ``+zstd``) layers holding the files under ``models/``.

Layering: one layer for the small files (configs, tokenizer, docs), one per weight file, so an
update that changes one shard re-sends one layer; when that would exceed ``MAX_LAYERS``
(overlayfs and containerd cap the lower-dir count) weight files are grouped into consecutive
layers. Tars are deterministic (sorted, uid/gid 0, the files' own permission bits, the
``SOURCE_DATE_EPOCH`` mtime or 0, PAX only where USTAR cannot hold a field) and streamed to temp files, so memory stays bounded for any model size.
Reading such layers back (pull to a directory, the node cache) is ``modelpack.transfer.untar``.
"""

from __future__ import annotations

import os
import tarfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from modelpack.errors import PackError
from modelpack.mediatypes import (
    ANNOTATION_CREATED,
    ANNOTATION_TITLE,
    MEDIA_TYPE_IMAGE_CONFIG,
    BlobFormat,
    Compression,
    LayerKind,
    layer_media_type,
)
from modelpack.mediatypes.annotations import (
    ANNOTATION_HF_ARCHITECTURE,
    LABEL_ARTIFACT_DIGEST,
    LABEL_MODEL_PREFIX,
    safe_relative_path,
)
from modelpack.oci.descriptor import Descriptor, Manifest, canonical_json
from modelpack.oci.digest import Digest, HashingWriter
from modelpack.oci.image_config import MODELS_PREFIX
from modelpack.packing.file_metadata import source_date_epoch
from modelpack.packing.opened_input import InputFile
from modelpack.packing.packed_artifact import PackedArtifact, PackedFile, PackOptions
from modelpack.packing.packer import build_artifact
from modelpack.packing.reshard import staging_write_error
from modelpack.packing.staging_area import make_staging_dir, remove_staging_dir

MAX_LAYERS = 100
#: what this writer produces: plain or zstd tars (containerd, podman and this project read both)
WRITTEN_FORMATS = (BlobFormat.TAR, BlobFormat.TAR_ZSTD)


@dataclass
class ImageArtifact(PackedArtifact):
    """A built image-shaped artifact: a read-only Target whose layer blobs are temp tar files.

    ``files`` holds one entry per layer (the tar), ``model_files`` the checkpoint files packed.
    Call ``cleanup()`` when done (it removes the temp tars).
    """

    model_files: list[PackedFile] = field(default_factory=list)
    diff_ids: list[str] = field(default_factory=list)
    base_staging: str | None = None

    @property
    def file_count(self) -> int:
        return len(self.model_files)

    def cleanup(self) -> None:
        super().cleanup()
        for f in self.model_files:
            if f.source is not None:
                f.source.close()
        remove_staging_dir(self.base_staging)  # re-sharded files written by build_artifact
        self.base_staging = None


def _tarinfo(
    name: str, *, size: int = 0, directory: bool = False, mode: int = 0o644, mtime: int = 0
) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.mtime = mtime
    ti.uid = ti.gid = 0
    ti.uname = ti.gname = ""
    if directory:
        ti.type = tarfile.DIRTYPE
        ti.mode = 0o755
    else:
        ti.type = tarfile.REGTYPE
        ti.mode = mode
        ti.size = size
    return ti


def write_layer_tar(
    members: Iterable[tuple[str, str | InputFile]],
    out_path: str,
    compression: str | None = None,
    *,
    modes: dict[str, int] | None = None,
    mtime: int = 0,
) -> tuple[Digest, Digest, int]:
    """Write a deterministic tar of ``(relpath, source file)`` under ``models/``.

    ``modes`` gives each file's permission bits (default 0644), ``mtime`` every entry's time.
    Returns (diff_id, blob digest, blob size): the diff_id hashes the uncompressed tar, the blob
    digest the bytes stored (equal without compression).
    """
    fmt = image_layer_format(compression)
    members = sorted(members, key=lambda m: m[0].split("/"))
    try:
        return _write_tar(members, out_path, fmt.compression, modes or {}, mtime)
    except OSError as exc:
        if exc.filename is not None and exc.filename != out_path:
            raise  # a source file: its own path is already named
        raise staging_write_error(out_path, exc) from exc


def _write_tar(
    members: list[tuple[str, str | InputFile]],
    out_path: str,
    compression: Compression | None,
    modes: dict[str, int],
    mtime: int,
) -> tuple[Digest, Digest, int]:
    with open(out_path, "wb") as raw_out:
        digesting = HashingWriter(raw_out)
        compressor: Any = None
        sink: Any = digesting
        if compression is Compression.ZSTD:
            import zstandard

            compressor = zstandard.ZstdCompressor(level=3, write_checksum=True).stream_writer(
                digesting,  # type: ignore[arg-type]  # any object with write() will do
                closefd=False,
            )
            sink = compressor
        hw = HashingWriter(sink)
        with tarfile.open(fileobj=hw, mode="w|", format=tarfile.PAX_FORMAT, encoding="utf-8") as tar:  # type: ignore[call-overload]
            dirs_done: set[str] = set()
            for rel, src in members:
                rel = safe_relative_path(rel, what="model file path")
                parts = (MODELS_PREFIX + rel).split("/")
                for i in range(1, len(parts)):
                    d = "/".join(parts[:i]) + "/"
                    if d not in dirs_done:
                        dirs_done.add(d)
                        tar.addfile(_tarinfo(d, directory=True, mtime=mtime))
                if isinstance(src, InputFile):  # a pack input: read from its descriptor only
                    size, shown, f = os.fstat(src.fd).st_size, src.shown, src.open()
                else:
                    size, shown, f = os.path.getsize(src), src, open(src, "rb")
                with f:
                    ti = _tarinfo(MODELS_PREFIX + rel, size=size, mode=modes.get(rel, 0o644), mtime=mtime)
                    tar.addfile(ti, f)
                    if f.tell() != size:
                        raise PackError(f"{shown}: file changed size while it was being packed")
        if compressor is not None:
            compressor.flush(1)  # zstandard.FLUSH_FRAME
            compressor.close()
        raw_out.flush()
        os.fsync(raw_out.fileno())
    return hw.digest, digesting.digest, digesting.size


def image_layer_format(compression: str | None) -> BlobFormat:
    """The tar format of the image-shaped variant's layers for ``--compression`` (None: plain)."""
    try:
        fmt = BlobFormat.tar(Compression(compression) if compression else None)
    except ValueError:
        fmt = None
    if fmt is None or fmt not in WRITTEN_FORMATS:
        raise PackError(f"unsupported layer compression {compression!r}; use zstd or none")
    return fmt


def _group_layers(files: list[PackedFile], max_layers: int) -> list[list[PackedFile]]:
    small = [f for f in files if f.kind is not LayerKind.WEIGHT]
    weights = [f for f in files if f.kind is LayerKind.WEIGHT]
    groups: list[list[PackedFile]] = [small] if small else []
    room = max(1, max_layers - len(groups))
    if len(weights) <= room:
        groups += [[w] for w in weights]
    else:
        per = -(-len(weights) // room)
        groups += [weights[i : i + per] for i in range(0, len(weights), per)]
    return groups


def image_labels(base: PackedArtifact) -> dict[str, str]:
    """The image config's labels: the model's metadata and the ModelPack artifact this image
    mirrors, under the project's prefix (``org.cncf.model.*`` is the spec's, and it defines no
    image labels)."""
    spec = base.config.to_dict()
    desc = spec.get("descriptor", {})
    labels = {LABEL_MODEL_PREFIX + "name": str(desc.get("name", ""))}
    for key in ("version", "family"):
        if desc.get(key):
            labels[LABEL_MODEL_PREFIX + key] = str(desc[key])
    for key in ("architecture", "format", "paramSize", "precision", "quantization"):
        value = spec.get("config", {}).get(key)
        if value:
            labels[LABEL_MODEL_PREFIX + key] = str(value)
    hf_class = (base.manifest.annotations or {}).get(ANNOTATION_HF_ARCHITECTURE)
    if hf_class:
        labels[ANNOTATION_HF_ARCHITECTURE] = hf_class
    labels[LABEL_ARTIFACT_DIGEST] = str(base.manifest.digest)
    return labels


def build_image_artifact(
    checkpoint_dir: str,
    opts: PackOptions | None = None,
    compression: str | None = None,
    *,
    platform: str = "linux/amd64",
    max_layers: int = MAX_LAYERS,
    staging_parent: str | None = None,
) -> ImageArtifact:
    """Pack ``checkpoint_dir`` as an image-shaped artifact (validated like the default format)."""
    fmt = image_layer_format(compression)
    os_name, _, arch = platform.partition("/")
    if not os_name or not arch:
        raise PackError(f"--platform must be OS/ARCH (e.g. linux/amd64), got {platform!r}")
    base = build_artifact(checkpoint_dir, opts, staging_parent=staging_parent)
    mtime = opts.mtime if opts and opts.mtime is not None else source_date_epoch()
    staging = make_staging_dir("image", staging_parent)
    try:
        layers: list[Descriptor] = []
        tars: list[PackedFile] = []
        diff_ids: list[str] = []
        media_type = layer_media_type(LayerKind.IMAGE, fmt)
        for i, group in enumerate(_group_layers(base.files, max_layers)):
            out = os.path.join(staging, f"layer-{i:04d}.tar")
            diff_id, digest, size = write_layer_tar(
                [(f.relpath, f.source or f.path) for f in group],
                out,
                compression,
                modes={f.relpath: f.mode for f in group},
                mtime=mtime,
            )
            for f in group:  # the tar holds the bytes that were hashed and validated, or nothing
                f.check_unchanged()
            title = group[0].relpath if len(group) == 1 else f"{group[0].relpath} (+{len(group) - 1} files)"
            layers.append(Descriptor(media_type, digest, size, annotations={ANNOTATION_TITLE: title}))
            diff_ids.append(str(diff_id))
            tars.append(PackedFile(title, out, LayerKind.IMAGE, False, size, digest))
        labels = image_labels(base)
        config_doc: dict[str, Any] = {
            "architecture": arch,
            "os": os_name,
            "config": {"Labels": labels, "WorkingDir": "/" + MODELS_PREFIX.rstrip("/")},
            "rootfs": {"type": "layers", "diff_ids": diff_ids},
        }
        if opts and opts.created:
            config_doc["created"] = opts.created
        config_bytes = canonical_json(config_doc)
        config_desc = Descriptor(MEDIA_TYPE_IMAGE_CONFIG, Digest.from_bytes(config_bytes), len(config_bytes))
        annotations = {ANNOTATION_CREATED: opts.created} if opts and opts.created else None
        manifest = Manifest.build(config_desc, layers, annotations=annotations)
        art = ImageArtifact(
            manifest,
            base.config,
            config_bytes,
            tars,
            staging_dir=staging,
            name=base.name,
            model_files=base.files,
            skipped=base.skipped,
            warnings=base.warnings,
            diff_ids=diff_ids,
            base_staging=base.staging_dir,
        )
        return art
    except BaseException:
        remove_staging_dir(staging)
        base.cleanup()
        raise


__all__ = [
    "MAX_LAYERS",
    "WRITTEN_FORMATS",
    "ImageArtifact",
    "build_image_artifact",
    "image_labels",
    "image_layer_format",
    "write_layer_tar",
]
