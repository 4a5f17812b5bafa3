"""The image-shaped variant of a model artifact (DESIGN §2), for runtimes that mount only images.

containerd (2.1+) image volumes unpack image layers, so the model must look like an image: no
``artifactType``, an ``application/vnd.oci.image.config.v1+json`` config whose ``rootfs.diff_ids``
are the sha256 of each uncompressed layer tar, and ``application/vnd.oci.image.layer.v1.tar``
(or ``+zstd``) layers holding the files under ``models/``.

Layering: one layer for the small files (configs, tokenizer, docs), one per weight file, so an
update that changes one shard re-sends one layer; when that would exceed ``MAX_LAYERS``
(overlayfs and containerd cap the lower-dir count) weight files are grouped into consecutive
layers. Tars are deterministic (sorted, mtime 0, uid/gid 0, fixed modes, PAX only where USTAR
cannot hold a field) and streamed to temp files, so memory stays bounded for any model size.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tarfile
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import IO, Any, BinaryIO

from modelpack.errors import (
    DigestMismatchError,
    ManifestError,
    PackError,
    UnsafePathError,
    UnsafeTarError,
)
from modelpack.mediatypes import (
    ANNOTATION_CREATED,
    ANNOTATION_TITLE,
    MEDIA_TYPE_IMAGE_CONFIG,
    MEDIA_TYPE_IMAGE_LAYER_TAR,
    MEDIA_TYPE_IMAGE_LAYER_TAR_GZIP,
    MEDIA_TYPE_IMAGE_LAYER_TAR_ZSTD,
)
from modelpack.mediatypes.annotations import safe_relative_path
from modelpack.oci.descriptor import Descriptor, Manifest, canonical_json
from modelpack.oci.digest import HASH_CHUNK, Digest
from modelpack.packing.packer import PackedArtifact, PackedFile, PackOptions, build_artifact

MODELS_PREFIX = "models/"
MAX_LAYERS = 100
MAX_TAR_MEMBERS = 1_000_000
MAX_CONFIG_BYTES = 4 * 1024 * 1024
LABEL_PREFIX = "org.cncf.model."
COMPRESSIONS = (None, "zstd")


@dataclass
class ImageArtifact(PackedArtifact):
    """A built image-shaped artifact: a read-only Target whose layer blobs are temp tar files.

    ``files`` holds one entry per layer (the tar), ``model_files`` the checkpoint files packed.
    Call ``cleanup()`` when done (it removes the temp tars).
    """

    model_files: list[PackedFile] = field(default_factory=list)
    diff_ids: list[str] = field(default_factory=list)
    base_staging: str | None = None

    def cleanup(self) -> None:
        super().cleanup()
        if self.base_staging:  # re-sharded files written by build_artifact
            shutil.rmtree(self.base_staging, ignore_errors=True)
            self.base_staging = None


def _tarinfo(name: str, *, size: int = 0, directory: bool = False) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.mtime = 0
    ti.uid = ti.gid = 0
    ti.uname = ti.gname = ""
    if directory:
        ti.type = tarfile.DIRTYPE
        ti.mode = 0o755
    else:
        ti.type = tarfile.REGTYPE
        ti.mode = 0o644
        ti.size = size
    return ti


class _HashingWriter:
    """File-like sink: hashes what tarfile writes (the diff_id) and passes it on."""

    def __init__(self, sink: IO[bytes]) -> None:
        self.sink = sink
        self.h = hashlib.sha256()
        self.n = 0

    def write(self, data: bytes) -> int:
        self.h.update(data)
        self.n += len(data)
        self.sink.write(data)
        return len(data)

    def tell(self) -> int:
        return self.n

    def flush(self) -> None:
        self.sink.flush()


class _DigestingFile:
    def __init__(self, f: IO[bytes]) -> None:
        self.f = f
        self.h = hashlib.sha256()
        self.n = 0

    def write(self, data: bytes) -> int:
        self.h.update(data)
        self.n += len(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def write_layer_tar(
    members: Iterable[tuple[str, str]], out_path: str, compression: str | None = None
) -> tuple[Digest, Digest, int]:
    """Write a deterministic tar of ``(relpath, source file)`` under ``models/``.

    Returns (diff_id, blob digest, blob size): the diff_id hashes the uncompressed tar, the blob
    digest the bytes stored (equal without compression).
    """
    if compression not in COMPRESSIONS:
        raise PackError(f"unsupported layer compression {compression!r}; use zstd or none")
    members = sorted(members, key=lambda m: m[0].split("/"))
    with open(out_path, "wb") as raw_out:
        digesting = _DigestingFile(raw_out)
        compressor: Any = None
        sink: Any = digesting
        if compression == "zstd":
            import zstandard

            compressor = zstandard.ZstdCompressor(level=3, write_checksum=True).stream_writer(
                digesting,  # type: ignore[arg-type]  # any object with write() will do
                closefd=False,
            )
            sink = compressor
        hw = _HashingWriter(sink)
        with tarfile.open(fileobj=hw, mode="w|", format=tarfile.PAX_FORMAT, encoding="utf-8") as tar:  # type: ignore[call-overload]
            dirs_done: set[str] = set()
            for rel, src in members:
                rel = safe_relative_path(rel, what="model file path")
                parts = (MODELS_PREFIX + rel).split("/")
                for i in range(1, len(parts)):
                    d = "/".join(parts[:i]) + "/"
                    if d not in dirs_done:
                        dirs_done.add(d)
                        tar.addfile(_tarinfo(d, directory=True))
                size = os.path.getsize(src)
                with open(src, "rb") as f:
                    tar.addfile(_tarinfo(MODELS_PREFIX + rel, size=size), f)
                    if f.tell() != size:
                        raise PackError(f"{src}: file changed size while it was being packed")
        if compressor is not None:
            compressor.flush(1)  # zstandard.FLUSH_FRAME
            compressor.close()
        raw_out.flush()
        os.fsync(raw_out.fileno())
    diff_id = Digest.from_hex(hw.h.hexdigest())
    return diff_id, Digest.from_hex(digesting.h.hexdigest()), digesting.n


def _group_layers(files: list[PackedFile], max_layers: int) -> list[list[PackedFile]]:
    small = [f for f in files if f.kind != "weight"]
    weights = [f for f in files if f.kind == "weight"]
    groups: list[list[PackedFile]] = [small] if small else []
    room = max(1, max_layers - len(groups))
    if len(weights) <= room:
        groups += [[w] for w in weights]
    else:
        per = -(-len(weights) // room)
        groups += [weights[i : i + per] for i in range(0, len(weights), per)]
    return groups


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
    if compression not in COMPRESSIONS:
        raise PackError(f"unsupported compression {compression!r}; use zstd or none")
    os_name, _, arch = platform.partition("/")
    if not os_name or not arch:
        raise PackError(f"--platform must be OS/ARCH (e.g. linux/amd64), got {platform!r}")
    base = build_artifact(checkpoint_dir, opts, staging_parent=staging_parent)
    staging = tempfile.mkdtemp(prefix=".modelpack-image-", dir=staging_parent)
    try:
        layers: list[Descriptor] = []
        tars: list[PackedFile] = []
        diff_ids: list[str] = []
        media_type = MEDIA_TYPE_IMAGE_LAYER_TAR_ZSTD if compression == "zstd" else MEDIA_TYPE_IMAGE_LAYER_TAR
        for i, group in enumerate(_group_layers(base.files, max_layers)):
            out = os.path.join(staging, f"layer-{i:04d}.tar")
            diff_id, digest, size = write_layer_tar([(f.relpath, f.path) for f in group], out, compression)
            title = group[0].relpath if len(group) == 1 else f"{group[0].relpath} (+{len(group) - 1} files)"
            layers.append(Descriptor(media_type, digest, size, annotations={ANNOTATION_TITLE: title}))
            diff_ids.append(str(diff_id))
            tars.append(PackedFile(title, out, "image-layer", False, size, digest))
        spec = base.config.to_dict()
        desc = spec.get("descriptor", {})
        labels = {LABEL_PREFIX + "name": str(desc.get("name", ""))}
        for key in ("version", "family"):
            if desc.get(key):
                labels[LABEL_PREFIX + key] = str(desc[key])
        for key in ("architecture", "format", "paramSize", "precision", "quantization"):
            value = spec.get("config", {}).get(key)
            if value:
                labels[LABEL_PREFIX + key] = str(value)
        labels[LABEL_PREFIX + "artifact.digest"] = str(base.manifest.digest)
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
            diff_ids=diff_ids,
            base_staging=base.staging_dir,
        )
        return art
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        base.cleanup()
        raise


def image_diff_ids(config_raw: bytes, n_layers: int, *, where: str = "image config") -> list[str]:
    """``rootfs.diff_ids`` of an image config, checked for count and digest syntax."""
    if len(config_raw) > MAX_CONFIG_BYTES:
        raise ManifestError(f"{where}: image config larger than {MAX_CONFIG_BYTES} bytes")
    try:
        doc = json.loads(config_raw)
        ids = doc["rootfs"]["diff_ids"]
        if doc["rootfs"].get("type") != "layers" or not isinstance(ids, list):
            raise ValueError("rootfs.type must be 'layers' with a diff_ids array")
        out = [str(Digest(x)) for x in ids]
    except (ValueError, KeyError, TypeError) as exc:
        raise ManifestError(f"{where}: invalid image config rootfs: {exc}") from exc
    if len(out) != n_layers:
        raise ManifestError(f"{where}: {len(out)} diff_ids for {n_layers} layers")
    return out


# --------------------------------------------------------------------------- extraction
class _HashingReader:
    def __init__(self, raw: Any) -> None:
        self.raw = raw
        self.h = hashlib.sha256()
        self.n = 0

    def read(self, n: int = -1) -> bytes:
        data: bytes = self.raw.read(n)
        self.h.update(data)
        self.n += len(data)
        return data

    def drain(self) -> None:
        while self.read(HASH_CHUNK):
            pass


def open_layer_stream(stream: BinaryIO, media_type: str) -> Any:
    """Decompressing view of a layer blob, by media type (or bare format: tar, tar+gzip, tar+zstd)."""
    if media_type.endswith("+zstd"):
        import zstandard

        return zstandard.ZstdDecompressor().stream_reader(stream, read_across_frames=True)
    if media_type.endswith("+gzip"):
        import gzip

        return gzip.GzipFile(fileobj=stream, mode="rb")
    if media_type.endswith("tar") or media_type in (MEDIA_TYPE_IMAGE_LAYER_TAR,):
        return stream
    raise ManifestError(f"unsupported layer media type {media_type!r}")


def extract_tar_layer(
    stream: BinaryIO,
    dest_dir: str,
    strip: str = MODELS_PREFIX,
    *,
    media_type: str = MEDIA_TYPE_IMAGE_LAYER_TAR,
    diff_id: str | None = None,
    where: str = "layer",
    existing: set[str] | None = None,
) -> list[tuple[str, int, str]]:
    """Extract regular files of a layer tar under ``dest_dir``; returns (relpath, size, sha256).

    Refuses (``UnsafeTarError``) symlinks, hard links, devices, FIFOs, absolute or ``..`` paths,
    whiteouts, members outside ``strip`` and duplicates: the tar comes from a registry and must
    not write anywhere else. Files are created with O_EXCL|O_NOFOLLOW and made read-only. When
    ``diff_id`` is given, the uncompressed stream must hash to it (checked after the last byte);
    on any failure the caller discards ``dest_dir``.
    """
    hashing = _HashingReader(open_layer_stream(stream, media_type))
    out: list[tuple[str, int, str]] = []
    seen = existing if existing is not None else set()
    dest_real = os.path.realpath(dest_dir)
    count = 0
    with tarfile.open(fileobj=hashing, mode="r|", encoding="utf-8") as tar:  # type: ignore[call-overload]
        for member in tar:
            count += 1
            if count > MAX_TAR_MEMBERS:
                raise UnsafeTarError(f"{where}: more than {MAX_TAR_MEMBERS} members")
            name = member.name
            if name.startswith("./"):
                name = name[2:]
            if member.isdir():
                if (name.rstrip("/") + "/") == strip or not name.strip("/"):
                    continue
            if strip and not (name.startswith(strip) or (member.isdir() and name.rstrip("/") + "/" == strip)):
                raise UnsafeTarError(f"{where}: member {member.name!r} is outside {strip!r}")
            rel_raw = name[len(strip) :].rstrip("/") if strip else name.rstrip("/")
            try:
                rel = safe_relative_path(rel_raw, what=f"{where} member")
            except UnsafePathError as exc:
                raise UnsafeTarError(str(exc)) from exc
            if any(p.startswith(".wh.") for p in rel.split("/")):
                raise UnsafeTarError(
                    f"{where}: whiteout entry {member.name!r} is not allowed in a model layer"
                )
            target = os.path.join(dest_dir, *rel.split("/"))
            parent_real = os.path.realpath(os.path.dirname(target))
            if os.path.commonpath([dest_real, parent_real]) != dest_real:
                raise UnsafeTarError(f"{where}: member {member.name!r} would land outside the destination")
            if member.isdir():
                if os.path.lexists(target) and not os.path.isdir(target):
                    raise UnsafeTarError(f"{where}: directory {member.name!r} collides with a file")
                os.makedirs(target, mode=0o755, exist_ok=True)
                continue
            if not member.isreg():
                kind = "link" if (member.issym() or member.islnk()) else "special file"
                raise UnsafeTarError(
                    f"{where}: member {member.name!r} is a {kind}; only regular files are allowed"
                )
            if rel in seen:
                raise UnsafeTarError(f"{where}: {rel!r} appears twice")
            seen.add(rel)
            os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
            src = tar.extractfile(member)
            if src is None:  # pragma: no cover - regular files always have data
                raise UnsafeTarError(f"{where}: member {member.name!r} has no data")
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            h = hashlib.sha256()
            n = 0
            with os.fdopen(fd, "wb") as f:
                while True:
                    chunk = src.read(HASH_CHUNK)
                    if not chunk:
                        break
                    h.update(chunk)
                    f.write(chunk)
                    n += len(chunk)
                f.flush()
                os.fsync(f.fileno())
            if n != member.size:
                raise UnsafeTarError(
                    f"{where}: member {member.name!r} truncated ({n} of {member.size} bytes)"
                )
            os.chmod(target, 0o444)
            out.append((rel, n, "sha256:" + h.hexdigest()))
    hashing.drain()
    if diff_id is not None:
        actual = "sha256:" + hashing.h.hexdigest()
        if actual != diff_id:
            raise DigestMismatchError(diff_id, actual, what="uncompressed layer (diff_id)", source=where)
    return out


# --------------------------------------------------------------------------- pull.py hook
def materialize_tar_layer(target: Any, job: Any, bar: Any, *, strip: str = MODELS_PREFIX) -> str:
    """``modelpack.transfer.materialize`` materializer for tar layers: files land at final paths only verified.

    The layer is extracted into a temp directory inside the destination while its blob digest is
    checked as it streams; only after the last byte matched are the files renamed into place.
    """
    import tempfile as _tempfile

    from modelpack.files import TEMP_PREFIX, fsync_dir
    from modelpack.oci.digest import VerifyingReader
    from modelpack.progress import CountingReader

    desc: Descriptor = job.descriptor
    dest = os.path.abspath(job.dest_dir)
    os.makedirs(dest, exist_ok=True)
    tmp = _tempfile.mkdtemp(prefix=TEMP_PREFIX, dir=dest)
    try:
        raw = target.fetch_blob(desc)
        src: Any = CountingReader(raw, bar) if bar is not None else raw
        reader = VerifyingReader(src, desc.digest, desc.size, source=f"{target.name} (layer {desc.digest})")
        try:
            files = extract_tar_layer(
                reader,  # type: ignore[arg-type]
                tmp,
                strip,
                media_type=desc.media_type,
                where=f"layer {desc.digest}",
            )
            while reader.read(HASH_CHUNK):  # the digest check happens at EOF
                pass
        finally:
            reader.close()
        for rel, _, _ in files:
            final = os.path.join(dest, *rel.split("/"))
            parent = os.path.dirname(final)
            os.makedirs(parent, exist_ok=True)
            real_parent = os.path.realpath(parent)
            if os.path.commonpath([real_parent, os.path.realpath(dest)]) != os.path.realpath(dest):
                raise UnsafeTarError(f"{rel}: its directory leaves {dest} (symlink?)")
            if os.path.islink(final):
                raise UnsafeTarError(f"{final} is a symlink; refusing to write through it")
            staged = os.path.join(tmp, *rel.split("/"))
            os.chmod(staged, 0o644)
            os.replace(staged, final)
            fsync_dir(parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return "downloaded"


def register_tar_materializers() -> None:
    """Teach ``modelpack.transfer.materialize`` the image-shaped layers (files under ``models/``) and ModelPack
    ``tar`` / ``tar+gzip`` / ``tar+zstd`` layers (files at their own paths)."""
    from modelpack.transfer.materialize import register_materializer

    for mt in (MEDIA_TYPE_IMAGE_LAYER_TAR, MEDIA_TYPE_IMAGE_LAYER_TAR_ZSTD, MEDIA_TYPE_IMAGE_LAYER_TAR_GZIP):
        register_materializer(mt, materialize_tar_layer)
    for fmt in ("tar", "tar+gzip", "tar+zstd"):
        register_materializer(fmt, lambda t, j, b: materialize_tar_layer(t, j, b, strip=""))


__all__ = [
    "COMPRESSIONS",
    "ImageArtifact",
    "UnsafeTarError",
    "build_image_artifact",
    "extract_tar_layer",
    "image_diff_ids",
    "materialize_tar_layer",
    "open_layer_stream",
    "register_tar_materializers",
    "write_layer_tar",
]
