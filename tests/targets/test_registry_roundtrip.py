"""Push, pull, copy and query against a real distribution 2.8 registry (plain HTTP, loopback)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from modelpack.mediatypes import MEDIA_TYPE_OCI_INDEX, MEDIA_TYPE_OCI_MANIFEST

from modelpack import api
from modelpack.api import transfer
from modelpack.errors import (
    DigestMismatchError,
    ManifestTooLargeError,
    NotFoundError,
    RegistryNotFoundError,
    UnsupportedLayerError,
)
from modelpack.oci.descriptor import Descriptor, Manifest, empty_config_descriptor
from modelpack.oci.digest import Digest
from modelpack.oci.reference import parse_reference
from modelpack.targets.base import bytes_blob_source
from modelpack.targets.opener import TargetOptions, open_target
from modelpack.targets.registry.target import RegistryTarget
from modelpack.transfer.materialize import PullOptions, pull_to_directory
from tests.fixtures.registry import RegistryFactory, RegistryServer


@pytest.fixture(autouse=True)
def _upload_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MODELPACK_UPLOAD_STATE_DIR", str(tmp_path / "upload-state"))


def _files(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _target(registry: RegistryServer, repo: str, write: bool = False) -> RegistryTarget:
    t = open_target(registry.ref(repo, None), TargetOptions(), for_write=write)
    assert isinstance(t, RegistryTarget)
    return t


def test_push_pull_round_trip_is_byte_identical(
    registry: RegistryServer, checkpoint: Path, tmp_path: Path
) -> None:
    ref = registry.ref("roundtrip/model", "v1")
    pushed = transfer.push(str(checkpoint), ref, progress="off")
    # the same directory packs to the same digest, in a layout as in the registry
    layout = api.pack(str(checkpoint), f"oci:{tmp_path / 'layout'}:v1")
    assert pushed.digest == str(layout.artifact.digest)
    # the registry serves the exact manifest bytes we built
    target = _target(registry, "roundtrip/model")
    raw, media_type = target.fetch_manifest("v1")
    assert raw == layout.artifact.manifest.raw
    assert media_type == MEDIA_TYPE_OCI_MANIFEST
    assert str(Digest.from_bytes(raw)) == pushed.digest

    dest = tmp_path / "pulled"
    result = transfer.pull(ref, str(dest), progress="off")
    assert result.digest == pushed.digest
    assert _files(dest) == _files(checkpoint)
    assert not [p for p in dest.rglob(".tmp-modelpack-*")]

    # pinned by digest works too, and a second pull downloads nothing
    again = transfer.pull(
        f"{registry.ref('roundtrip/model', None)}@{pushed.digest}", str(dest), progress="off"
    )
    assert again.downloaded == 0 and again.present == len(result.files)


def test_second_push_uploads_no_blob(registry: RegistryServer, checkpoint: Path) -> None:
    ref = registry.ref("idempotent/model", "v1")
    first = transfer.push(str(checkpoint), ref, progress="off")
    assert first.copy.blobs_copied == first.copy.blobs_total > 0
    mark = registry.log_mark()
    second = transfer.push(str(checkpoint), ref, progress="off")
    assert second.digest == first.digest
    assert second.copy.blobs_copied == 0 and second.copy.blobs_skipped == first.copy.blobs_total
    after = registry.requests_since(mark)
    assert not [r for r in after if "/blobs/uploads/" in r[1]], after
    assert [r for r in after if r[0] == "HEAD" and "/blobs/sha256:" in r[1]]


def test_cross_repository_copy_mounts_instead_of_uploading(
    registry: RegistryServer, checkpoint: Path
) -> None:
    first = transfer.push(str(checkpoint), registry.ref("mount/src", "v1"), progress="off")
    mark = registry.log_mark()
    res = transfer.cp(registry.ref("mount/src", "v1"), registry.ref("mount/dst", "v1"), progress="off")
    assert str(res.descriptor.digest) == first.digest
    assert res.blobs_mounted == first.copy.blobs_total and res.blobs_copied == 0
    after = registry.requests_since(mark)
    mounts = [r for r in after if r[0] == "POST" and "mount=sha256" in r[1] and "from=mount%2Fsrc" in r[1]]
    assert len(mounts) == first.copy.blobs_total and all(r[2] == 201 for r in mounts)
    assert not [r for r in after if r[0] in ("PATCH",) or (r[0] == "PUT" and "/blobs/uploads/" in r[1])]
    assert _target(registry, "mount/dst").resolve("v1").digest == first.digest


def test_corrupted_blob_is_refused_on_pull(
    registry_factory: RegistryFactory, checkpoint: Path, tmp_path: Path
) -> None:
    # its own registry: blobs are shared across repositories, and this test damages one
    registry = registry_factory.start()
    pushed = transfer.push(str(checkpoint), registry.ref("corrupt/model", "v1"), progress="off")
    manifest = Manifest.parse(_target(registry, "corrupt/model").fetch_manifest(pushed.digest)[0])
    victim = max(manifest.layers, key=lambda d: d.size)
    data_path = registry.blob_data_path(victim.digest)
    blob = bytearray(data_path.read_bytes())
    blob[len(blob) // 2] ^= 0xFF  # same size, one byte flipped
    data_path.write_bytes(bytes(blob))
    victim_path = victim.annotations["org.cncf.model.filepath"]  # type: ignore[index]

    dest = tmp_path / "dest"
    with pytest.raises(DigestMismatchError) as exc:
        transfer.pull(registry.ref("corrupt/model", "v1"), str(dest), jobs=1, progress="off")
    assert str(victim.digest) in str(exc.value)
    assert not (dest / victim_path).exists()
    assert not [p for p in dest.rglob("*") if p.name.startswith(".tmp-modelpack-")]


def test_blob_ranges_and_offsets(registry: RegistryServer, checkpoint: Path) -> None:
    pushed = transfer.push(str(checkpoint), registry.ref("ranges/model", "v1"), progress="off")
    target = _target(registry, "ranges/model")
    manifest = Manifest.parse(target.fetch_manifest(pushed.digest)[0])
    layer = max(manifest.layers, key=lambda d: d.size)
    local = (checkpoint / layer.annotations["org.cncf.model.filepath"]).read_bytes()  # type: ignore[index]
    assert target.fetch_range(layer, 1000, 4096) == local[1000:5096]
    assert target.fetch_range(layer, layer.size - 7, 7) == local[-7:]
    with target.fetch_blob(layer, 12345) as f:
        got = f.read()
    assert len(got) == len(local) - 12345
    assert got == local[12345:]
    with pytest.raises(Exception) as exc:
        target.fetch_range(layer, layer.size - 1, 2)
    assert str(layer.digest) in str(exc.value)


def test_tags_catalog_and_typed_not_found(registry: RegistryServer, checkpoint: Path) -> None:
    transfer.push(str(checkpoint), registry.ref("tags/model", "v1"), progress="off")
    digest = transfer.tag(registry.ref("tags/model", "v1"), "stable")
    target = _target(registry, "tags/model")
    assert set(target.list_tags()) == {"v1", "stable"}
    assert target.resolve("stable").digest == digest
    assert "tags/model" in set(target.catalog(page_size=2))  # forces Link pagination
    with pytest.raises(RegistryNotFoundError) as exc:
        target.resolve("missing")
    assert isinstance(exc.value, NotFoundError)
    assert exc.value.status == 404 and exc.value.code == "MANIFEST_UNKNOWN"
    assert "tags/model" in str(exc.value)


def _referrer(subject: Descriptor, artifact_type: str, payload: bytes) -> tuple[Manifest, Descriptor]:
    layer = Descriptor("application/octet-stream", Digest.from_bytes(payload), len(payload))
    m = Manifest.build(empty_config_descriptor(), [layer], artifact_type=artifact_type, subject=subject)
    return m, layer


def test_referrers_through_the_fallback_tag(registry: RegistryServer, checkpoint: Path) -> None:
    pushed = transfer.push(str(checkpoint), registry.ref("refs/model", "v1"), progress="off")
    target = _target(registry, "refs/model", write=True)
    subject = target.resolve("v1")
    assert target.referrers(subject) == []
    sig, sig_layer = _referrer(subject, "application/vnd.example.signature", b"sig-1")
    table, table_layer = _referrer(subject, "application/vnd.example.chunks", b"chunks")
    for m, layer, payload in ((sig, sig_layer, b"sig-1"), (table, table_layer, b"chunks")):
        target.push_blob(bytes_blob_source(empty_config_descriptor(), b"{}"))
        target.push_blob(bytes_blob_source(layer, payload))
        target.push_manifest(m.raw, m.media_type)
    target.push_manifest(sig.raw, sig.media_type)  # pushing again does not duplicate the entry

    fresh = _target(registry, "refs/model")
    found = fresh.referrers(subject)
    assert [d.digest for d in found] == [sig.digest, table.digest]
    assert [d.artifact_type for d in found] == [
        "application/vnd.example.signature",
        "application/vnd.example.chunks",
    ]
    only = fresh.referrers(subject, "application/vnd.example.chunks")
    assert [d.digest for d in only] == [table.digest]
    raw, mt = fresh.fetch_manifest("sha256-" + Digest(pushed.digest).hex)
    assert mt == MEDIA_TYPE_OCI_INDEX and len(json.loads(raw)["manifests"]) == 2

    # cp --referrers carries them to another repository
    res = transfer.cp(
        registry.ref("refs/model", "v1"), registry.ref("refs/copy", "v1"), referrers=True, progress="off"
    )
    assert {str(r.digest) for r in res.referrers} == {sig.digest, table.digest}
    assert {d.digest for d in _target(registry, "refs/copy").referrers(subject)} == {sig.digest, table.digest}


def test_manifest_over_4_mib_is_refused_before_sending(registry: RegistryServer) -> None:
    target = _target(registry, "big/manifest", write=True)
    layer = Descriptor(
        "application/octet-stream", Digest.from_bytes(b"x"), 1, annotations={"pad": "x" * (4 << 20)}
    )
    raw = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": MEDIA_TYPE_OCI_MANIFEST,
            "config": empty_config_descriptor().to_dict(),
            "layers": [layer.to_dict()],
        }
    ).encode()
    mark = registry.log_mark()
    with pytest.raises(ManifestTooLargeError):
        target.push_manifest(raw, MEDIA_TYPE_OCI_MANIFEST, "v1")
    assert not [r for r in registry.requests_since(mark) if r[0] == "PUT"]


def test_unknown_layer_format_is_refused_before_download(registry: RegistryServer, tmp_path: Path) -> None:
    target = _target(registry, "weird/model", write=True)
    payload = b"not a tar"
    layer = Descriptor(
        "application/vnd.cncf.model.weight.v1.tar+lz4-nonexistent",
        Digest.from_bytes(payload),
        len(payload),
        annotations={"org.cncf.model.filepath": "w.bin"},
    )
    m = Manifest.build(empty_config_descriptor(), [layer])
    target.push_blob(bytes_blob_source(empty_config_descriptor(), b"{}"))
    target.push_blob(bytes_blob_source(layer, payload))
    target.push_manifest(m.raw, m.media_type, "v1")
    with pytest.raises(UnsupportedLayerError):
        pull_to_directory(target, "v1", str(tmp_path / "d"), PullOptions(progress="off"))
    assert not (tmp_path / "d" / "w.bin").exists()


def test_partial_pull_with_globs(registry: RegistryServer, checkpoint: Path, tmp_path: Path) -> None:
    transfer.push(str(checkpoint), registry.ref("globs/model", "v1"), progress="off")
    dest = tmp_path / "cfg"
    res = transfer.pull(registry.ref("globs/model", "v1"), str(dest), include=("*.json",), progress="off")
    assert res.files and all(f.endswith(".json") for f in res.files)
    assert sorted(os.listdir(dest)) == sorted(f for f in os.listdir(checkpoint) if f.endswith(".json"))
    dest2 = tmp_path / "noweights"
    res2 = transfer.pull(
        registry.ref("globs/model", "v1"), str(dest2), exclude=("*.safetensors",), progress="off"
    )
    assert res2.files and not any(f.endswith(".safetensors") for f in res2.files)


def test_layout_to_registry_and_back(registry: RegistryServer, checkpoint: Path, tmp_path: Path) -> None:
    layout = api.pack(str(checkpoint), f"oci:{tmp_path / 'l1'}:v1")
    pushed = transfer.push(f"oci:{tmp_path / 'l1'}:v1", registry.ref("layout/model", "v2"), progress="off")
    assert pushed.digest == str(layout.artifact.digest)
    back = transfer.cp(registry.ref("layout/model", "v2"), f"oci:{tmp_path / 'l2'}:v3", progress="off")
    assert str(back.descriptor.digest) == pushed.digest
    assert open_target(parse_reference(f"oci:{tmp_path / 'l2'}:v3")).resolve("v3").digest == pushed.digest
