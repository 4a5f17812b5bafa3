"""Crafted artifacts for the pull-to-directory and tar-bomb tests (task W6).

Everything is generated here: tar layers with hostile members (zstd bombs, sparse members, huge
headers, trailing data), artifacts whose layers collide, and a small tmpfs for a full disk. The
artifacts are written to an OCI image layout and, when a test needs the network, copied to the
real registry with ``modelpack cp``'s library function.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import os
import subprocess
import tarfile
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import zstandard
from modelpack.mediatypes import (
    MEDIA_TYPE_CONFIG,
    MEDIA_TYPE_IMAGE_CONFIG,
    MEDIA_TYPE_IMAGE_LAYER_TAR,
    MEDIA_TYPE_IMAGE_LAYER_TAR_ZSTD,
)
from modelpack.mediatypes.annotations import ANNOTATION_FILEPATH

from modelpack.oci.descriptor import Descriptor, Manifest
from modelpack.oci.digest import Digest
from modelpack.targets.base import file_blob_source
from modelpack.targets.layout import OCILayoutTarget

MiB = 1024 * 1024
GiB = 1024 * MiB
BLOCK = 512


# --------------------------------------------------------------------------- tar members
def tar_member(name: str, data: bytes = b"x", **pax: str) -> bytes:
    """One PAX-format member (header + data + padding), no end-of-archive marker."""
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = 0o644
    if pax:
        info.pax_headers = dict(pax)
    head = info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")
    return head + data + b"\0" * (-len(data) % BLOCK)


def tar_of(*members: bytes) -> bytes:
    """Members followed by the end-of-archive marker and record padding, as tar writes it."""
    body = b"".join(members) + b"\0" * (2 * BLOCK)
    return body + b"\0" * (-len(body) % tarfile.RECORDSIZE)


def zstd(data: bytes) -> bytes:
    return zstandard.ZstdCompressor().compress(data)


def zstd_zero_bomb(name: str = "models/zeros.bin", size: int = GiB, *, trailing_zeros: int = 0) -> bytes:
    """A tar+zstd stream of one member of ``size`` zeros (32 KB for 1 GiB), built without holding
    the expanded bytes; ``trailing_zeros`` appends zeros after the end-of-archive marker."""
    info = tarfile.TarInfo(name)
    info.size = size
    out = io.BytesIO()
    cobj = zstandard.ZstdCompressor(level=3).compressobj()
    out.write(cobj.compress(info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")))
    chunk = bytes(8 * MiB)
    left = size + (-size % BLOCK) + 2 * BLOCK + trailing_zeros
    while left > 0:
        n = min(left, len(chunk))
        out.write(cobj.compress(chunk[:n]))
        left -= n
    out.write(cobj.flush())
    return out.getvalue()


def pax_sparse_member(name: str, real_size: int = GiB, version: str = "1.0") -> bytes:
    """A member whose PAX ``GNU.sparse.*`` headers declare ``real_size`` bytes (holes) with one
    byte of data: tarfile expands it to ``real_size`` zeros when read."""
    if version == "1.0":
        sparse_map = f"1\n{real_size - 1}\n1\n".encode()
        data = sparse_map + b"\0" * (-len(sparse_map) % BLOCK) + b"!"
        pax = {
            "GNU.sparse.major": "1",
            "GNU.sparse.minor": "0",
            "GNU.sparse.name": name,
            "GNU.sparse.realsize": str(real_size),
        }
        return tar_member(os.path.dirname(name) + "/GNUSparseFile.0/" + os.path.basename(name), data, **pax)
    if version == "0.1":
        pax = {
            "GNU.sparse.map": f"{real_size - 1},1",
            "GNU.sparse.numblocks": "1",
            "GNU.sparse.name": name,
            "GNU.sparse.size": str(real_size),
        }
        return tar_member(name, b"!", **pax)
    raise ValueError(version)


def gnu_sparse_member(name: str, real_size: int = GiB) -> bytes:
    """An old-GNU sparse member (type 'S'): one 1-byte extent at the end of ``real_size`` bytes."""
    info = tarfile.TarInfo(name)
    info.size = 1
    info.type = tarfile.REGTYPE
    head = bytearray(info.tobuf(tarfile.GNU_FORMAT, "utf-8", "surrogateescape"))
    head[156:157] = tarfile.GNUTYPE_SPARSE
    # struct sparse at 386: offset[12] numbytes[12]; isextended at 482; realsize[12] at 483
    head[386:398] = b"%011o\0" % (real_size - 1)
    head[398:410] = b"%011o\0" % 1
    head[482] = 0
    head[483:495] = b"%011o\0" % real_size
    head[148:156] = b"        "
    chksum = sum(head[:BLOCK])
    head[148:156] = b"%06o\0 " % chksum
    return bytes(head) + b"!" + b"\0" * (BLOCK - 1)


def huge_pax_header_stream(size: int = 64 * MiB) -> bytes:
    """A tar+zstd stream whose first header is a PAX extended header of ``size`` bytes."""
    info = tarfile.TarInfo("././@PaxHeader")
    info.type = tarfile.XHDTYPE
    info.size = size
    head = info.tobuf(tarfile.USTAR_FORMAT, "utf-8", "surrogateescape")
    cobj = zstandard.ZstdCompressor().compressobj()
    out = io.BytesIO()
    out.write(cobj.compress(head))
    chunk = b"9" * MiB
    left = size + (-size % BLOCK)
    while left > 0:
        n = min(left, len(chunk))
        out.write(cobj.compress(chunk[:n]))
        left -= n
    out.write(cobj.compress(tar_member("models/a.json", b"{}") + b"\0" * 1024))
    out.write(cobj.flush())
    return out.getvalue()


# --------------------------------------------------------------------------- artifacts
Layer = tuple[str, bytes, dict[str, str] | None]  # (media type, blob, annotations)


def raw_layer(path: str, data: bytes) -> Layer:
    return ("application/vnd.cncf.model.weight.v1.raw", data, {ANNOTATION_FILEPATH: path})


def image_layer(tar_bytes: bytes, *, compressed: bool = False, title: str | None = None) -> Layer:
    media = MEDIA_TYPE_IMAGE_LAYER_TAR_ZSTD if compressed else MEDIA_TYPE_IMAGE_LAYER_TAR
    return (
        media,
        zstd(tar_bytes) if compressed else tar_bytes,
        {"org.opencontainers.image.title": title} if title else None,
    )


def modelpack_tar_layer(tar_bytes: bytes, path: str) -> Layer:
    return ("application/vnd.cncf.model.weight.v1.tar", tar_bytes, {ANNOTATION_FILEPATH: path})


def _uncompressed(media_type: str, blob: bytes) -> bytes:
    """The tar a layer's diff_id vouches for: a plain-tar label's blob as it is (never
    decompressed), else what the bytes decompress to by their magic number (as the readers
    decide, whatever the compression label says)."""
    if media_type.endswith(".tar"):
        return blob
    if blob[:4] == b"\x28\xb5\x2f\xfd":
        return zstandard.ZstdDecompressor().decompressobj().decompress(blob)
    if blob[:2] == b"\x1f\x8b":
        return gzip.decompress(blob)
    return blob


def write_artifact(layout: Path, tag: str, layers: list[Layer], *, image_config: bool = False) -> str:
    """Write ``layers`` (and a config) into the OCI layout ``layout`` under ``tag``; returns the digest."""
    target = OCILayoutTarget(str(layout), create=True)
    descs: list[Descriptor] = []
    with tempfile.TemporaryDirectory(dir=layout) as work:
        for media_type, blob, annotations in layers:
            p = os.path.join(work, uuid.uuid4().hex)
            Path(p).write_bytes(blob)
            d = Descriptor(media_type, Digest.from_bytes(blob), len(blob), annotations=annotations)
            target.push_blob(file_blob_source(d, p))
            descs.append(d)
        if image_config:
            config = (
                b'{"architecture":"amd64","os":"linux","rootfs":{"type":"layers","diff_ids":['
                + b",".join(
                    b'"sha256:' + hashlib.sha256(_uncompressed(m, b)).hexdigest().encode() + b'"'
                    for m, b, _ in layers
                )
                + b"]}}"
            )
            config_type = MEDIA_TYPE_IMAGE_CONFIG
        else:
            config, config_type = b"{}", MEDIA_TYPE_CONFIG
        p = os.path.join(work, "config")
        Path(p).write_bytes(config)
        cdesc = Descriptor(config_type, Digest.from_bytes(config), len(config))
        target.push_blob(file_blob_source(cdesc, p))
    manifest = Manifest.build(cdesc, descs)
    pushed = target.push_manifest(manifest.raw, manifest.media_type, tag)
    return str(pushed.digest)


# --------------------------------------------------------------------------- a small disk
@contextlib.contextmanager
def small_tmpfs(path: Path, size: str) -> Iterator[Path | None]:
    """Mount a tmpfs of ``size`` at ``path`` (tests run as root); yields None where mounting is
    not allowed, so a test can fall back or skip."""
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True, check=False
    )
    if r.returncode != 0:
        yield None
        return
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)


def temp_entries(directory: Path) -> list[str]:
    """Every ``.tmp-modelpack-*`` entry under ``directory``, recursively."""
    return sorted(
        str(p.relative_to(directory)) for p in directory.rglob("*") if p.name.startswith(".tmp-modelpack-")
    )
