"""Every layer kind ``modelpack pull`` writes, through ``storage-initializer`` as KServe runs it:
raw ModelPack layers, ModelPack tar folders (``tar+zstd``), the image-shaped variant and a
docker-built KServe modelcar (base image layer passed over), with and without the node cache. The anonymous plain-HTTP registry needs ``MODELPACK_PLAIN_HTTP=true``."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from modelpack.api import transfer
from modelpack.testdata.synthetic import SyntheticSpec, write_checkpoint
from tests.e2e.test_interop_modelcar import push_kserve_style
from tests.kserve_support import Pod, kserve_env, pod_volumes, run_initializer
from tests.loader.test_loader_tar_snapshots import push_modelpack_folders

pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: setpriv to uid 1000 and a mount namespace"),
]


@pytest.fixture
def pod() -> Iterator[Pod]:
    yield from pod_volumes()


def _checkpoint_files(ckpt: Path, prefix_weights: str = "", prefix_meta: str = "") -> dict[str, bytes]:
    out = {}
    for p in sorted(ckpt.rglob("*")):
        if p.is_file():
            rel = p.relative_to(ckpt).as_posix()
            prefix = prefix_weights if rel.endswith(".safetensors") else prefix_meta
            out[prefix + rel] = p.read_bytes()
    return out


@pytest.mark.parametrize("kind", ["raw", "tar-folders", "image-zstd", "docker-modelcar"])
def test_every_layer_kind_lands_verified_at_dest(registry, pod: Pod, tmp_path: Path, kind: str) -> None:  # type: ignore[no-untyped-def]
    ckpt = tmp_path / "ckpt"
    write_checkpoint(str(ckpt), SyntheticSpec(seed=11, shards=2))
    repo = f"kserve-kinds/{kind}"
    expected = _checkpoint_files(ckpt)
    if kind == "raw":
        ref = transfer.push(str(ckpt), registry.ref(repo, "v1"), progress="off").reference
    elif kind == "image-zstd":
        ref = transfer.push(
            str(ckpt), registry.ref(repo, "v1"), format="image", compression="zstd", progress="off"
        ).reference
    elif kind == "docker-modelcar":
        ref = push_kserve_style(registry, ckpt, repo)
    else:
        ref = push_modelpack_folders(registry, ckpt, repo, "tar+zstd")  # the tag it wrote
        expected = _checkpoint_files(ckpt, "weights/", "meta/")
    for cached in (False, True):
        dest = pod.dest("cached" if cached else "direct")
        env = kserve_env(
            pod, MODELPACK_PLAIN_HTTP="true", MODELPACK_CACHE=str(pod.node_cache) if cached else None
        )
        run = run_initializer(pod, [f"modelpack://{ref}", str(dest)], env)
        assert run.returncode == 0, run.stderr
        assert pod.files(dest) == expected, (kind, cached)


def test_s3_and_layout_uris_as_kserve_passes_them(s3, pod: Pod, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """``s3://BUCKET/PREFIX:TAG`` with the variables KServe's S3 credential builder sets
    (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL``), and ``oci:DIR:TAG``
    on a mounted volume, through the node cache and without."""
    from modelpack.api import pack
    from modelpack.targets.opener import TargetOptions
    from tests.fixtures.s3 import DUMMY_ENV

    ckpt = tmp_path / "ckpt"
    write_checkpoint(str(ckpt), SyntheticSpec(seed=13, shards=2))
    bucket = s3.make_bucket()
    pack(str(ckpt), f"s3://{bucket}/models/llama:v1", target_options=TargetOptions())
    layout = pod.root / "layout"
    pack(str(ckpt), f"oci:{layout}:v1")
    os.chmod(pod.root / "layout", 0o755)
    expected = _checkpoint_files(ckpt)
    s3_env = {**DUMMY_ENV, "AWS_ENDPOINT_URL": s3.endpoint, "AWS_CONFIG_FILE": os.devnull}
    for uri in (f"s3://{bucket}/models/llama:v1", f"oci:{layout}:v1"):
        for cached in (False, True):
            dest = pod.dest(f"{'cached' if cached else 'direct'}-{uri[:2]}")
            env = kserve_env(pod, **s3_env, MODELPACK_CACHE=str(pod.node_cache) if cached else None)
            run = run_initializer(pod, [uri, str(dest)], env)
            assert run.returncode == 0, run.stderr
            assert pod.files(dest) == expected, (uri, cached)
