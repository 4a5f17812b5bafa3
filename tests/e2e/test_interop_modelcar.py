"""modelpack reads what others write — KServe modelcar images, modctl's tar layers.

A modelcar is a plain OCI (or Docker) image whose tar layers hold the model under ``models/``
and carry no file-path annotations. Two are built here: one with the building blocks of the PyPI
tool ``oci-modelcar`` (one uncompressed layer per file, members ``models/<path>``, no directory
entries), and one shaped like the KServe documentation's ``FROM busybox`` + ``COPY models
/models/`` build (Docker media types, gzip, a base layer with files outside ``models/``).
``modelpack pull`` writes the files of ``models/`` at their paths below it, like the image-shaped
variant (``--keep-prefix`` keeps ``models/``), never the rest of the image, through the same untar
rules (links, devices, ``..``, bombs refused under ``models/``); the node cache takes both like the
image-shaped variant (the same rules, the config's ``diff_ids`` checked) and the loader loads the
snapshot, each extracted file hashed (``tests/loader/test_loader_tar_snapshots.py``). Which layers are
tars, with which prefix and which members passed over, is one table for all of them
(``modelpack.transfer.layer_formats``), tested at the end of this file.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import re
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest
import requests
from click.testing import CliRunner

from modelpack.api import transfer
from modelpack.cli import main
from modelpack.errors import UnsafeTarError, UnsupportedLayerError
from tests.fixtures.registry import RegistryServer

DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_CONFIG = "application/vnd.docker.container.image.v1+json"
DOCKER_LAYER_GZIP = "application/vnd.docker.image.rootfs.diff.tar.gzip"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
OCI_LAYER = "application/vnd.oci.image.layer.v1.tar"
DOCKER_LAYER = "application/vnd.docker.image.rootfs.diff.tar"


@pytest.fixture(autouse=True)
def _upload_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MODELPACK_UPLOAD_STATE_DIR", str(tmp_path / "upload-state"))
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "no-docker-config"))


def _files(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def push_with_oci_modelcar(registry: RegistryServer, checkpoint: Path, repo: str, work: Path) -> str:
    """The image ``oci-modelcar push`` builds, made with its own layer/manifest/registry code (its
    CLI downloads from the Hugging Face hub, which tests cannot reach)."""
    # declared test dependency (Python ≥ 3.11, its own floor): missing there is a failure, not a skip
    if sys.version_info < (3, 11):
        pytest.skip("oci-modelcar requires Python 3.11; the test extra declares it only there")
    import oci_modelcar.layer as layer_mod
    from oci_modelcar.manifest import ML_TAR, BlobDescriptor, build_config_bytes, build_manifest_bytes
    from oci_modelcar.registry import OciClient, StreamingBlobUpload, push_manifest, push_small_blob

    client = OciClient(registry_host=registry.host, target_repo=repo)
    descriptors: list[BlobDescriptor] = []
    for i, src in enumerate(sorted(p for p in checkpoint.rglob("*") if p.is_file())):
        rel = src.relative_to(checkpoint).as_posix()
        tar_path = work / f"layer-{i}.tar"
        digest, size = layer_mod.build_layer_to_file(src, "models/", rel, tar_path)
        StreamingBlobUpload(client, repo).push_from_file(tar_path, size, digest)
        descriptors.append(BlobDescriptor(ML_TAR, digest, size, hf_path=rel))
    config = build_config_bytes([d.digest for d in descriptors])
    config_digest = push_small_blob(client, repo, config)
    manifest = build_manifest_bytes(config_digest, len(config), descriptors)
    push_manifest(client, repo, "v1", manifest)
    return registry.ref(repo, "v1")


def _tar(entries: list[tuple[str, bytes | None, int]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for name, data, mode in entries:
            ti = tarfile.TarInfo(name)
            ti.mode = mode if mode >= 0 else 0o777
            ti.mtime = 1_700_000_000
            if mode < 0:  # a symlink, as base images are full of
                ti.type = tarfile.SYMTYPE
                ti.linkname = "/etc/passwd"
                tar.addfile(ti)
            elif data is None:
                ti.type = tarfile.DIRTYPE
                tar.addfile(ti)
            else:
                ti.size = len(data)
                tar.addfile(ti, io.BytesIO(data))
    return buf.getvalue()


def _put_blob(registry: RegistryServer, repo: str, data: bytes) -> str:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    base = f"http://{registry.host}/v2/{repo}/blobs/uploads/"
    r = requests.post(base, timeout=30)
    assert r.status_code == 202, r.text
    loc = r.headers["Location"]
    loc = loc if loc.startswith("http") else f"http://{registry.host}{loc}"
    sep = "&" if "?" in loc else "?"
    r = requests.put(f"{loc}{sep}digest={digest}", data=data, timeout=60)
    assert r.status_code == 201, r.text
    return digest


def put_manifest(registry: RegistryServer, repo: str, manifest: dict[str, Any]) -> str:
    r = requests.put(
        f"http://{registry.host}/v2/{repo}/manifests/v1",
        data=json.dumps(manifest).encode(),
        headers={"Content-Type": OCI_MANIFEST},
        timeout=30,
    )
    assert r.status_code == 201, r.text
    return registry.ref(repo, "v1")


def model_manifest(
    registry: RegistryServer, repo: str, layers: list[dict[str, Any]], diff_ids: list[str], vendor: str
) -> str:
    config = json.dumps(
        {
            "descriptor": {"name": "m"},
            "config": {"format": "safetensors"},
            "modelfs": {"type": "layers", "diffIds": diff_ids},
        }
    ).encode()
    manifest = {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "artifactType": f"application/vnd.{vendor}.model.manifest.v1+json",
        "config": {
            "mediaType": f"application/vnd.{vendor}.model.config.v1+json",
            "digest": _put_blob(registry, repo, config),
            "size": len(config),
        },
        "layers": layers,
    }
    return put_manifest(registry, repo, manifest)


def push_kserve_style(
    registry: RegistryServer,
    checkpoint: Path,
    repo: str,
    extra: list[Any] | None = None,
    *,
    oci: bool = False,
    wrong_diff_id: bool = False,
    gzipped: bool = True,
) -> str:
    """``FROM busybox`` + ``COPY models /models/`` as docker build pushes it: Docker media types,
    gzip layers, a base layer of the OS, a ``models/`` directory entry and per-file modes.
    ``oci``: the same image with OCI media types (buildah, ``docker buildx --output oci-mediatypes``);
    ``wrong_diff_id``: the config's diff_id of the model layer is not its uncompressed tar's;
    ``gzipped=False``: uncompressed tar layers (a layer's digest is then its diff_id)."""
    base_layer = _tar(
        [
            ("bin/", None, 0o755),
            ("bin/busybox", b"\x7fELF...", 0o755),
            ("bin/sh", None, -1),
            ("etc/passwd", b"root:x:0:0\n", 0o644),
        ]
    )
    model_entries: list[tuple[str, bytes | None, int]] = [("models/", None, 0o775)]
    for src in sorted(checkpoint.rglob("*")):
        rel = src.relative_to(checkpoint).as_posix()
        if src.is_dir():
            model_entries.append((f"models/{rel}/", None, 0o755))
        else:
            model_entries.append((f"models/{rel}", src.read_bytes(), src.stat().st_mode & 0o777))
    model_entries += extra or []
    layers, diff_ids = [], []
    for raw in (base_layer, _tar(model_entries)):
        blob = gzip.compress(raw, mtime=0) if gzipped else raw
        layer_type = (
            (OCI_LAYER_GZIP if oci else DOCKER_LAYER_GZIP) if gzipped else OCI_LAYER if oci else DOCKER_LAYER
        )
        layers.append(
            {
                "mediaType": layer_type,
                "digest": _put_blob(registry, repo, blob),
                "size": len(blob),
            }
        )
        diff_ids.append("sha256:" + hashlib.sha256(raw).hexdigest())
    if wrong_diff_id:
        diff_ids[-1] = "sha256:" + hashlib.sha256(b"another layer").hexdigest()
    config = json.dumps(
        {
            "architecture": "amd64",
            "os": "linux",
            "config": {"WorkingDir": "/"},
            "rootfs": {"type": "layers", "diff_ids": diff_ids},
        }
    ).encode()
    manifest = {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST if oci else DOCKER_MANIFEST,
        "config": {
            "mediaType": OCI_CONFIG if oci else DOCKER_CONFIG,
            "digest": _put_blob(registry, repo, config),
            "size": len(config),
        },
        "layers": layers,
    }
    r = requests.put(
        f"http://{registry.host}/v2/{repo}/manifests/v1",
        data=json.dumps(manifest).encode(),
        headers={"Content-Type": OCI_MANIFEST if oci else DOCKER_MANIFEST},
        timeout=30,
    )
    assert r.status_code == 201, r.text
    return registry.ref(repo, "v1")


def test_pull_an_oci_modelcar_image(registry: RegistryServer, checkpoint: Path, tmp_path: Path) -> None:
    ref = push_with_oci_modelcar(registry, checkpoint, "modelcar/oci-modelcar", tmp_path)
    stripped = tmp_path / "stripped"
    result = transfer.pull(ref, str(stripped), progress="off")
    assert _files(stripped) == _files(checkpoint)
    assert sorted(result.files) == sorted(_files(checkpoint))
    kept = tmp_path / "as-in-the-image"
    transfer.pull(ref, str(kept), progress="off", keep_prefix=True)
    assert _files(kept) == {f"models/{k}": v for k, v in _files(checkpoint).items()}


def test_pull_a_kserve_style_docker_modelcar_with_a_base_image(
    registry: RegistryServer, checkpoint: Path, tmp_path: Path
) -> None:
    (checkpoint / "run.py").write_text("print(1)\n")
    os.chmod(checkpoint / "run.py", 0o755)
    ref = push_kserve_style(registry, checkpoint, "modelcar/kserve")
    stripped = tmp_path / "stripped"
    r = CliRunner().invoke(main, ["pull", ref, str(stripped)])
    assert r.exit_code == 0, r.output
    # the base image (bin/busybox, a bin/sh symlink, etc/passwd) is outside models/: not written
    assert _files(stripped) == _files(checkpoint)
    kept = tmp_path / "kept"
    r = CliRunner().invoke(main, ["pull", ref, str(kept), "--keep-prefix"])
    assert r.exit_code == 0, r.output
    assert _files(kept) == {f"models/{k}": v for k, v in _files(checkpoint).items()}


def test_a_modelcar_member_escaping_models_is_refused(
    registry: RegistryServer, checkpoint: Path, tmp_path: Path
) -> None:
    ref = push_kserve_style(
        registry, checkpoint, "modelcar/evil", extra=[("models/../../escape", b"x", 0o644)]
    )
    with pytest.raises(UnsafeTarError, match=r"\.\."):
        transfer.pull(ref, str(tmp_path / "out"), progress="off")
    assert not (tmp_path / "escape").exists()
    assert not list((tmp_path / "out").rglob("*.safetensors"))


def test_a_modelcar_symlink_under_models_is_refused(
    registry: RegistryServer, checkpoint: Path, tmp_path: Path
) -> None:
    ref = push_kserve_style(registry, checkpoint, "modelcar/link", extra=[("models/link", None, -1)])
    with pytest.raises(UnsafeTarError, match="link"):
        transfer.pull(ref, str(tmp_path / "out"), progress="off")
    assert not (tmp_path / "out" / "link").exists()


def test_the_node_cache_takes_a_modelcar(registry: RegistryServer, checkpoint: Path, tmp_path: Path) -> None:
    from modelpack.mount import NodeCache

    ref = push_with_oci_modelcar(registry, checkpoint, "modelcar/cache", tmp_path)
    pulled = NodeCache(str(tmp_path / "cache")).pull(ref)
    assert _files(Path(pulled.path)) == _files(checkpoint)  # the files of models/, like the image variant


def test_pull_keeps_reading_modctl_tar_layers_with_cnai_names(
    registry: RegistryServer, checkpoint: Path, tmp_path: Path
) -> None:
    """modctl's default: one ``tar`` layer per file (member = the file's relative path), the
    pre-rename ``vnd.cnai`` media types and ``org.cnai.model.*`` annotations."""
    repo = "modelcar/modctl"
    layers, diff_ids = [], []
    for src in sorted(p for p in checkpoint.rglob("*") if p.is_file()):
        rel = src.relative_to(checkpoint).as_posix()
        raw = _tar([(rel, src.read_bytes(), 0o644)])
        kind = (
            "weight" if rel.endswith(".safetensors") else "weight.config" if rel.endswith(".json") else "doc"
        )
        meta = {"name": src.name, "mode": 0o644, "uid": 0, "gid": 0, "size": src.stat().st_size}
        layers.append(
            {
                "mediaType": f"application/vnd.cnai.model.{kind}.v1.tar",
                "digest": _put_blob(registry, repo, raw),
                "size": len(raw),
                "annotations": {
                    "org.cnai.model.filepath": rel,
                    "org.cnai.model.file.metadata+json": json.dumps(meta | {"mtime": "2025-01-01T00:00:00Z"}),
                },
            }
        )
        diff_ids.append("sha256:" + hashlib.sha256(raw).hexdigest())
    model_manifest(registry, repo, layers, diff_ids, "cnai")
    out = tmp_path / "out"
    transfer.pull(registry.ref(repo, "v1"), str(out), progress="off")
    assert _files(out) == _files(checkpoint)


# one table says, for every reader (pull, node cache, cache verify, loader), what a layer is
_OCI_IMAGE_TYPES = {
    "application/vnd.oci.image.layer.v1.tar": "tar",
    "application/vnd.oci.image.layer.v1.tar+gzip": "tar+gzip",
    "application/vnd.oci.image.layer.v1.tar+zstd": "tar+zstd",
    "application/vnd.docker.image.rootfs.diff.tar": "tar",
    DOCKER_LAYER_GZIP: "tar+gzip",
}


@pytest.mark.parametrize(("media_type", "compression"), sorted(_OCI_IMAGE_TYPES.items()))
@pytest.mark.parametrize("config", [OCI_CONFIG, DOCKER_CONFIG])
def test_image_layers_of_an_image_hold_the_model_under_models(
    media_type: str, compression: str, config: str
) -> None:
    from modelpack.transfer.layer_formats import layer_format

    fmt = layer_format(config, media_type)
    assert (fmt.format, fmt.strip, fmt.outside, fmt.diff_id) == (compression, "models/", "skip", True)
    # the same layer types under another config (a runtime asset): files at their paths, no diff_ids
    other = layer_format("application/vnd.modelpack.runtime-asset.config.v1+json", media_type)
    assert (other.format, other.strip, other.outside, other.diff_id) == (compression, "", "refuse", False)


@pytest.mark.parametrize(
    ("media_type", "fmt"),
    [
        ("application/vnd.cncf.model.weight.v1.raw", "raw"),
        ("application/vnd.cncf.model.weight.v1.tar+zstd", "tar+zstd"),
        ("application/vnd.cnai.model.doc.v1.tar", "tar"),
        ("application/octet-stream", "raw"),  # placed at its annotated path, like the node cache did
    ],
)
def test_modelpack_layers_keep_their_paths(media_type: str, fmt: str) -> None:
    from modelpack.transfer.layer_formats import layer_format

    for config in (OCI_CONFIG, "application/vnd.cncf.model.config.v1+json"):
        got = layer_format(config, media_type)
        assert (got.format, got.strip, got.outside, got.diff_id) == (fmt, "", "refuse", False)


@pytest.mark.parametrize(
    "media_type",
    [
        "application/vnd.oci.image.layer.v1.tar+lz4",
        "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip",
        "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip",
        "application/vnd.cncf.model.weight.v1.tar+lz4",
        "application/vnd.cnai.model.unknown-kind.v1.raw",
    ],
)
def test_a_tar_or_modelpack_type_no_reader_supports_is_refused_never_taken_for_a_file(
    media_type: str,
) -> None:
    from modelpack.transfer.layer_formats import layer_format

    with pytest.raises(UnsupportedLayerError, match=re.escape(media_type)):
        layer_format(OCI_CONFIG, media_type)


def test_the_node_cache_refuses_an_unsupported_tar_layer_before_downloading_it(
    registry: RegistryServer, tmp_path: Path
) -> None:
    """It used to place such a layer, with a path annotation, as if the compressed tar were the file."""
    from modelpack.mount import NodeCache

    repo = "modelcar/lz4"
    blob = b"\x04\x22\x4d\x18 not a file"
    config = b"{}"
    manifest = {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "config": {
            "mediaType": "application/vnd.oci.empty.v1+json",
            "digest": _put_blob(registry, repo, config),
            "size": len(config),
        },
        "layers": [
            {
                "mediaType": "application/vnd.oci.image.layer.v1.tar+lz4",
                "digest": _put_blob(registry, repo, blob),
                "size": len(blob),
                "annotations": {"org.opencontainers.image.title": "model.safetensors"},
            }
        ],
    }
    put_manifest(registry, repo, manifest)
    nc = NodeCache(str(tmp_path / "cache"))
    with pytest.raises(UnsupportedLayerError, match=r"tar\+lz4"):
        nc.pull(registry.ref(repo, "v1"))
    assert nc.snapshots.list_ready() == []
    with pytest.raises(UnsupportedLayerError, match=r"tar\+lz4"):
        transfer.pull(registry.ref(repo, "v1"), str(tmp_path / "out"), progress="off")
    assert not (tmp_path / "out" / "model.safetensors").exists()
