"""A tar layer's compression is read from its bytes, as containerd and podman do.

``podman push`` relabels plain tar blobs ``tar+zstd`` (its descriptor's digest and size are the
plain blob's); containerd and podman detect the compression from the magic number and mount
them. Our readers do the same: gzip (``1f 8b``), zstd (``28 b5 2f fd``) or a tar. The
``diff_id`` still binds what was extracted to the image config. A blob that is none of these is
refused, named by digest and by what its first bytes are; a blob labelled a plain tar is never
decompressed (its diff_id is its own digest: nothing would check what decompression produced).
"""

from __future__ import annotations

import gzip
import io
import json
from pathlib import Path

import pytest
from modelpack.mediatypes import (
    MEDIA_TYPE_IMAGE_LAYER_TAR,
    MEDIA_TYPE_IMAGE_LAYER_TAR_GZIP,
    MEDIA_TYPE_IMAGE_LAYER_TAR_ZSTD,
    BlobFormat,
)
from modelpack.mount import NodeCache

from modelpack.api import transfer
from modelpack.errors import DigestMismatchError, LayerFormatError, ModelpackError
from modelpack.oci.descriptor import Descriptor, Manifest
from modelpack.oci.digest import Digest
from modelpack.targets.base import file_blob_source
from modelpack.targets.layout import OCILayoutTarget
from modelpack.transfer.untar import extract_tar_layer
from tests.pull_dir_helpers import tar_member, tar_of, write_artifact, zstd

CONFIG = b'{"hidden_size": 8}'
WEIGHTS = b"\x00\x01" * 4096


def _model_tar() -> bytes:
    return tar_of(tar_member("models/config.json", CONFIG), tar_member("models/w.bin", WEIGHTS))


def _lying_image(layout: Path, media_type: str, blob: bytes) -> str:
    """An image-shaped variant with one layer whose descriptor says ``media_type`` while its blob
    is ``blob`` (digest, size and the config's diff_id all consistent with the bytes)."""
    return write_artifact(layout, "v1", [(media_type, blob, None)], image_config=True)


@pytest.mark.parametrize(
    ("label", "encode"),
    [
        (MEDIA_TYPE_IMAGE_LAYER_TAR_ZSTD, lambda tar: tar),  # podman push: plain tar labelled zstd
        (MEDIA_TYPE_IMAGE_LAYER_TAR_GZIP, lambda tar: tar),
        (MEDIA_TYPE_IMAGE_LAYER_TAR_ZSTD, lambda tar: gzip.compress(tar, mtime=0)),
        (MEDIA_TYPE_IMAGE_LAYER_TAR_GZIP, zstd),
    ],
    ids=["plain-as-zstd", "plain-as-gzip", "gzip-as-zstd", "zstd-as-gzip"],
)
def test_a_layer_whose_label_names_another_compression_is_read_by_its_bytes(
    tmp_path: Path, label: str, encode
) -> None:  # type: ignore[no-untyped-def]
    """The pull to a directory and the node cache both read the layer as what its bytes are, and
    the image config's diff_id is still checked against the uncompressed tar."""
    tar = _model_tar()
    blob = encode(tar)
    # the diff_id the config must carry is the uncompressed tar's, whatever the blob is
    layout = tmp_path / "layout"
    digest = write_artifact(layout, "v1", [(label, blob, None)], image_config=True)
    _rewrite_diff_id(layout, digest, str(Digest.from_bytes(tar)))
    out = tmp_path / "files"
    transfer.pull(f"oci:{layout}:v1", str(out), progress="off")
    assert (out / "config.json").read_bytes() == CONFIG and (out / "w.bin").read_bytes() == WEIGHTS
    cache = NodeCache(str(tmp_path / "cache"))
    res = cache.pull(f"oci:{layout}:v1")
    assert (Path(res.path) / "w.bin").read_bytes() == WEIGHTS
    assert all(r.ok for r in cache.verify())


@pytest.mark.parametrize(
    ("label", "encode"),
    [
        (MEDIA_TYPE_IMAGE_LAYER_TAR_ZSTD, lambda tar: tar),
        (MEDIA_TYPE_IMAGE_LAYER_TAR_ZSTD, zstd),
        (MEDIA_TYPE_IMAGE_LAYER_TAR, lambda tar: tar),
    ],
    ids=["plain-as-zstd", "zstd", "plain"],
)
def test_the_diff_id_still_binds_a_layer_in_every_pull(tmp_path: Path, label: str, encode) -> None:  # type: ignore[no-untyped-def]
    """Reading by the bytes changes how a layer is decompressed, not what vouches for it: the node
    cache and the pull into a directory both refuse a layer whose config names another diff_id,
    and the directory is left without the layer's files (the pull into a directory extracted
    without comparing the diff_id before)."""
    layout = tmp_path / "layout"
    digest = _lying_image(layout, label, encode(_model_tar()))
    _rewrite_diff_id(layout, digest, "sha256:" + "0" * 64)
    with pytest.raises(DigestMismatchError, match="diff_id"):
        NodeCache(str(tmp_path / "cache")).pull(f"oci:{layout}:v1")
    out = tmp_path / "files"
    with pytest.raises(DigestMismatchError, match="diff_id"):
        transfer.pull(f"oci:{layout}:v1", str(out), progress="off")
    assert not (out / "w.bin").exists() and not (out / "config.json").exists()


@pytest.mark.parametrize(
    "blob",
    [b"PK\x03\x04" + b"\x00" * 2048, b"\x00" * 2048, b"{" + b"x" * 100],
    ids=["zip", "zeros", "short-json"],
)
def test_a_blob_that_is_no_tar_nor_a_known_compression_is_refused_naming_it(
    tmp_path: Path, blob: bytes
) -> None:
    """Labelled ``tar+zstd`` but neither zstd, gzip nor a tar: refused before anything is
    written, the error naming the layer's digest and what its first bytes are."""
    layout = tmp_path / "layout"
    _lying_image(layout, MEDIA_TYPE_IMAGE_LAYER_TAR_ZSTD, blob)
    layer = str(Digest.from_bytes(blob))
    with pytest.raises(ModelpackError, match=layer) as info:
        transfer.pull(f"oci:{layout}:v1", str(tmp_path / "files"), progress="off")
    assert blob[:4].hex(" ") in str(info.value) and "neither" in str(info.value)
    assert not (tmp_path / "files").exists() or not any((tmp_path / "files").iterdir())


def test_a_blob_labelled_a_plain_tar_is_never_decompressed(tmp_path: Path) -> None:
    """A plain-tar label means the blob is the tar its diff_id (its own digest) vouches for: a
    compressed blob under that label is refused, never decompressed unchecked."""
    with pytest.raises(LayerFormatError, match=r"layer sha256:x.*gzip"):
        extract_tar_layer(
            io.BytesIO(gzip.compress(_model_tar())),
            str(tmp_path),
            blob_format=BlobFormat.TAR,
            where="layer sha256:x",
        )
    layout = tmp_path / "layout"
    _lying_image(layout, MEDIA_TYPE_IMAGE_LAYER_TAR, zstd(_model_tar()))
    with pytest.raises(ModelpackError, match="zstd"):
        transfer.pull(f"oci:{layout}:v1", str(tmp_path / "files"), progress="off")


def _rewrite_diff_id(layout: Path, manifest_digest: str, diff_id: str) -> None:
    """Point the image config's only diff_id at ``diff_id``, re-tagging a manifest that names
    the new config (the layout's blobs are content-addressed)."""
    target = OCILayoutTarget(str(layout))
    raw, media_type = target.fetch_manifest(manifest_digest)
    manifest = Manifest.parse(raw, media_type=media_type)
    config = json.loads(Path(target.blob_path(manifest.config.digest)).read_bytes())
    config["rootfs"]["diff_ids"] = [diff_id]
    data = json.dumps(config).encode()
    path = layout / "config.json.new"
    path.write_bytes(data)
    desc = Descriptor(manifest.config.media_type, Digest.from_bytes(data), len(data))
    target.push_blob(file_blob_source(desc, str(path)))
    path.unlink()
    rebuilt = Manifest.build(desc, manifest.layers)
    target.push_manifest(rebuilt.raw, rebuilt.media_type, "v1")
