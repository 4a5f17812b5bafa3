"""Node-cache snapshots built from tar layers load, every file hashed.

A KServe modelcar (oci-modelcar), the image-shaped variant modelpack writes (``--format image``),
modctl's one-``tar``-layer-per-file artifacts and ModelPack artifacts with ``tar``/``tar+gzip``/
``tar+zstd`` folder layers are pulled into a node cache, and the snapshot is loaded with the
loader and compared with ``safetensors.torch.load_file`` of the source checkpoint (TP=1 and one
TP=2 rank). A tar-derived file is not a store blob: it is hashed while it is read against its own
sha256 in the ready marker (``verification: hashed``), so an edit in place fails the load, an
edited or padded marker is refused or fails, and a file added next to the others is not loaded.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from modelpack.loader import LoadStats, load_state_dict
from modelpack.mount import NodeCache
from safetensors.torch import save_file

from modelpack.api import transfer
from modelpack.cli import main
from modelpack.errors import DigestMismatchError, SizeMismatchError, SourceError, UnverifiedSourceError
from modelpack.events import EventLog
from tests.e2e.test_interop_modelcar import (
    _files,
    _put_blob,
    _tar,
    model_manifest,
    push_kserve_style,
    push_with_oci_modelcar,
)
from tests.fixtures.registry import RegistryServer
from tests.loader_helpers import expected_shard, reference_tensors

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"


@pytest.fixture(autouse=True)
def _upload_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MODELPACK_UPLOAD_STATE_DIR", str(tmp_path / "upload-state"))
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "no-docker-config"))


# --------------------------------------------------------------------------- building the artifacts
def push_modctl(registry: RegistryServer, checkpoint: Path, repo: str) -> str:
    """modctl's default: one ``tar`` layer per file (member = the file's path), ``vnd.cnai`` names."""
    layers, diff_ids = [], []
    for src in sorted(p for p in checkpoint.rglob("*") if p.is_file()):
        rel = src.relative_to(checkpoint).as_posix()
        raw = _tar([(rel, src.read_bytes(), 0o644)])
        kind = (
            "weight" if rel.endswith(".safetensors") else "weight.config" if rel.endswith(".json") else "doc"
        )
        layers.append(
            {
                "mediaType": f"application/vnd.cnai.model.{kind}.v1.tar",
                "digest": _put_blob(registry, repo, raw),
                "size": len(raw),
                "annotations": {"org.cnai.model.filepath": rel},
            }
        )
        diff_ids.append("sha256:" + hashlib.sha256(raw).hexdigest())
    return model_manifest(registry, repo, layers, diff_ids, "cnai")


def _compress(raw: bytes, fmt: str) -> bytes:
    if fmt == "tar+gzip":
        return gzip.compress(raw, mtime=0)
    if fmt == "tar+zstd":
        import zstandard

        return zstandard.ZstdCompressor().compress(raw)
    return raw


def push_modelpack_folders(registry: RegistryServer, checkpoint: Path, repo: str, fmt: str) -> str:
    """A ModelPack artifact as modelpack-client writes folders: the weights in a ``weights/``
    folder layer and the rest in a ``meta/`` one, both in ``fmt`` (members ``<folder>/<file>``)."""
    files = sorted(p for p in checkpoint.rglob("*") if p.is_file())
    groups = {
        ("weights", "weight"): [p for p in files if p.name.endswith(".safetensors")],
        ("meta", "weight.config"): [p for p in files if not p.name.endswith(".safetensors")],
    }
    layers, diff_ids = [], []
    for (folder, kind), members in groups.items():
        entries: list[tuple[str, bytes | None, int]] = [(f"{folder}/", None, 0o755)]
        entries += [
            (f"{folder}/{p.relative_to(checkpoint).as_posix()}", p.read_bytes(), 0o644) for p in members
        ]
        raw = _tar(entries)
        blob = _compress(raw, fmt)
        layers.append(
            {
                "mediaType": f"application/vnd.cncf.model.{kind}.v1.{fmt}",
                "digest": _put_blob(registry, repo, blob),
                "size": len(blob),
                "annotations": {"org.cncf.model.filepath": folder},
            }
        )
        diff_ids.append("sha256:" + hashlib.sha256(raw).hexdigest())
    return model_manifest(registry, repo, layers, diff_ids, "cncf")


def push_image(registry: RegistryServer, checkpoint: Path, repo: str, compression: str | None) -> str:
    ref = registry.ref(repo, "v1")
    transfer.push(str(checkpoint), ref, format="image", compression=compression, progress="off")
    return ref


# --------------------------------------------------------------------------- loading and comparing
def _check_load(snap: str, digest: str, ref: dict[str, torch.Tensor], weights: set[str], tmp: Path) -> None:
    log = tmp / "events.jsonl"
    stats = LoadStats()
    sd = load_state_dict(snap, expected_digest=digest, stats=stats, events=EventLog(str(log)))
    assert set(sd) == set(ref)
    for name, want in ref.items():
        assert sd[name].dtype == want.dtype and torch.equal(sd[name], want), name
    # every weight file is tar-derived: hashed against its own sha256, none trusted by inode
    assert stats.verification == {w: "hashed" for w in weights}
    events = [json.loads(line) for line in log.read_text().splitlines()]
    hashing = [e for e in events if e["event"] == "loader.hashing"]
    assert len(hashing) == 1 and sorted(hashing[0]["files"]) == sorted(weights), events
    assert "tar layer" in hashing[0]["reason"]
    done = [e for e in events if e["event"] == "loader.read_done"]
    assert done and done[-1]["verification"] == stats.verification
    # one rank of two: the shard slicing gives
    stats2 = LoadStats()
    sd2 = load_state_dict(snap, expected_digest=digest, tp_size=2, tp_rank=1, stats=stats2)
    assert stats2.plan is not None and set(sd2) == set(ref)
    for t in stats2.plan.tensors:
        want = expected_shard(ref[t.name], t.rule, 2, 1)
        assert sd2[t.name].shape == want.shape and torch.equal(sd2[t.name], want), t.name


def _weights(checkpoint: Path, prefix: str = "") -> set[str]:
    return {prefix + p.relative_to(checkpoint).as_posix() for p in checkpoint.rglob("*.safetensors")}


def _pull(tmp_path: Path, ref: str) -> tuple[NodeCache, str, str]:
    nc = NodeCache(str(tmp_path / "cache"))
    res = nc.pull(ref)
    return nc, res.path, str(res.digest)


def test_an_oci_modelcar_loads_from_the_node_cache(
    registry: RegistryServer, checkpoint: Path, tmp_path: Path
) -> None:
    ref = push_with_oci_modelcar(registry, checkpoint, "tarload/modelcar", tmp_path)
    _nc, snap, digest = _pull(tmp_path, ref)
    _check_load(snap, digest, reference_tensors(checkpoint), _weights(checkpoint), tmp_path)


@pytest.mark.parametrize("oci", [False, True], ids=["docker-media-types", "oci-media-types"])
def test_a_docker_built_modelcar_with_a_base_image_loads_from_the_node_cache(
    registry: RegistryServer, checkpoint: Path, tmp_path: Path, oci: bool
) -> None:
    """KServe's ``FROM busybox`` + ``COPY models /models/``: gzip layers with Docker (or OCI) media
    types, a Docker (or OCI) image config, the base image's files outside ``models/``."""
    ref = push_kserve_style(registry, checkpoint, f"tarload/kserve-{'oci' if oci else 'docker'}", oci=oci)
    nc, snap, digest = _pull(tmp_path, ref)
    # exactly the files of models/: bin/busybox, the bin/sh link and etc/passwd are passed over
    assert _files(Path(snap)) == _files(checkpoint)
    assert [r.ok for r in nc.verify()] == [True]
    r = CliRunner().invoke(main, ["cache", "verify", "--cache", nc.root])
    assert r.exit_code == 0, r.output
    _check_load(snap, digest, reference_tensors(checkpoint), _weights(checkpoint), tmp_path)


def test_an_edited_file_of_a_docker_built_modelcar_is_caught_by_verify_and_by_the_load(
    registry: RegistryServer, checkpoint: Path, tmp_path: Path
) -> None:
    ref = push_kserve_style(registry, checkpoint, "tarload/kserve-edit")
    nc, snap, digest = _pull(tmp_path, ref)
    victim = sorted(Path(snap).glob("*.safetensors"))[0]
    _edit_in_place(victim)
    with pytest.raises(DigestMismatchError, match=re.escape(victim.name)):
        load_state_dict(snap, expected_digest=digest)
    reports = nc.verify(repair=False)
    assert len(reports) == 1 and not reports[0].ok
    assert any(p.startswith(victim.name + ": expected") for p in reports[0].problems), reports[0].problems
    r = CliRunner().invoke(main, ["cache", "verify", "--cache", nc.root])
    assert r.exit_code != 0 and victim.name in r.output, r.output


@pytest.mark.parametrize("gzipped", [True, False], ids=["gzip", "uncompressed"])
@pytest.mark.parametrize("oci", [False, True], ids=["docker-config", "oci-config"])
def test_an_image_config_whose_diff_ids_disagree_with_its_layers_is_refused_by_the_cache(
    registry: RegistryServer, checkpoint: Path, tmp_path: Path, oci: bool, gzipped: bool
) -> None:
    """Also for uncompressed layers, whose diff_id the cache compares with the verified blob's
    digest instead of hashing the same bytes a second time."""
    ref = push_kserve_style(
        registry,
        checkpoint,
        f"tarload/diffid-{'oci' if oci else 'docker'}-{'gz' if gzipped else 'tar'}",
        oci=oci,
        wrong_diff_id=True,
        gzipped=gzipped,
    )
    nc = NodeCache(str(tmp_path / "cache"))
    with pytest.raises(DigestMismatchError, match="diff_id"):
        nc.pull(ref)
    assert nc.snapshots.list_ready() == []


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_the_image_shaped_variant_loads_from_the_node_cache(
    registry: RegistryServer, checkpoint: Path, tmp_path: Path, compression: str | None
) -> None:
    ref = push_image(registry, checkpoint, f"tarload/image-{compression or 'plain'}", compression)
    _nc, snap, digest = _pull(tmp_path, ref)
    _check_load(snap, digest, reference_tensors(checkpoint), _weights(checkpoint), tmp_path)


def test_a_modctl_tar_per_file_artifact_loads_from_the_node_cache(
    registry: RegistryServer, checkpoint: Path, tmp_path: Path
) -> None:
    ref = push_modctl(registry, checkpoint, "tarload/modctl")
    _nc, snap, digest = _pull(tmp_path, ref)
    _check_load(snap, digest, reference_tensors(checkpoint), _weights(checkpoint), tmp_path)


@pytest.mark.parametrize("fmt", ["tar", "tar+gzip", "tar+zstd"])
def test_modelpack_folder_layers_load_from_the_node_cache(
    registry: RegistryServer, checkpoint: Path, tmp_path: Path, fmt: str
) -> None:
    ref = push_modelpack_folders(registry, checkpoint, f"tarload/folders-{fmt.replace('+', '-')}", fmt)
    _nc, snap, digest = _pull(tmp_path, ref)
    assert (Path(snap) / "meta" / "config.json").is_file()
    _check_load(snap, digest, reference_tensors(checkpoint), _weights(checkpoint, "weights/"), tmp_path)


def test_load_json_reports_hashed_per_file(
    registry: RegistryServer, checkpoint: Path, tmp_path: Path
) -> None:
    ref = push_image(registry, checkpoint, "tarload/cli", None)
    _nc, snap, digest = _pull(tmp_path, ref)
    r = CliRunner().invoke(main, ["load", snap, "--expected-digest", digest, "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert doc["digest"] == digest and doc["state"] == "hit"
    assert doc["verification"] == {w: "hashed" for w in _weights(checkpoint)}


def test_streaming_a_tar_layer_artifact_says_to_pull_it_into_the_cache(
    registry: RegistryServer, checkpoint: Path, tmp_path: Path
) -> None:
    ref = push_image(registry, checkpoint, "tarload/stream", None)
    _nc, _snap, digest = _pull(tmp_path, ref)
    pinned = ref.rsplit(":", 1)[0] + "@" + digest
    with pytest.raises(SourceError, match=r"modelpack pull --cache DIR .*@sha256:.*snapshots/"):
        load_state_dict(pinned)


# --------------------------------------------------------------------------- attacks
@pytest.fixture
def image_cache(registry: RegistryServer, checkpoint: Path, tmp_path: Path) -> tuple[NodeCache, str, str]:
    ref = push_image(registry, checkpoint, "tarload/attack", None)
    return _pull(tmp_path, ref)


def _edit_in_place(path: Path) -> None:
    """Flip one byte of the last tensor's data, keeping the size (as an in-place edit does)."""
    os.chmod(path, 0o644)
    data = bytearray(path.read_bytes())
    data[len(data) - 3] ^= 0xFF
    path.write_bytes(bytes(data))
    os.chmod(path, 0o444)


def _rewrite(path: Path, text: str) -> None:
    """Edit a read-only file the way its owner (root here) can, leaving it read-only again."""
    os.chmod(path, 0o644)
    path.write_text(text)
    os.chmod(path, 0o444)


def test_an_extracted_weight_edited_in_place_fails_the_load(
    image_cache: tuple[NodeCache, str, str], checkpoint: Path
) -> None:
    _nc, snap, digest = image_cache
    victim = sorted(Path(snap).glob("*.safetensors"))[0]
    size = victim.stat().st_size
    _edit_in_place(victim)
    assert victim.stat().st_size == size
    with pytest.raises(DigestMismatchError, match=re.escape(victim.name)):
        load_state_dict(snap, expected_digest=digest)
    with pytest.raises(DigestMismatchError, match=re.escape(victim.name)):
        load_state_dict(snap, expected_digest=digest, tp_size=2, tp_rank=1)


def test_an_edited_marker_is_refused_or_fails(image_cache: tuple[NodeCache, str, str]) -> None:
    _nc, snap, digest = image_cache
    marker = Path(snap + ".ready")
    doc = json.loads(marker.read_text())
    weights = sorted(f["path"] for f in doc["files"] if f["path"].endswith(".safetensors"))

    def edited(change: Any) -> None:
        d = json.loads(json.dumps(doc))
        change(d)
        _rewrite(marker, json.dumps(d))

    # an extracted weight re-pointed at another digest: the file does not hash to it
    def repoint(d: dict[str, Any]) -> None:
        for f in d["files"]:
            if f["path"] == weights[0]:
                f["digest"] = "sha256:" + "0" * 64

    edited(repoint)
    with pytest.raises(DigestMismatchError, match=re.escape(weights[0])):
        load_state_dict(snap, expected_digest=digest)
    # a weight file the marker claims and the snapshot does not hold
    edited(lambda d: d["files"].append({**d["files"][0], "path": "extra.safetensors"}))
    with pytest.raises(UnverifiedSourceError, match=r"extra\.safetensors"):
        load_state_dict(snap, expected_digest=digest)

    # an extracted file claimed to be a hard link of a blob the manifest does not have
    def relink(d: dict[str, Any]) -> None:
        for f in d["files"]:
            if f["path"] == weights[0]:
                f["linked"] = True

    edited(relink)
    with pytest.raises(UnverifiedSourceError, match=re.escape(weights[0])):
        load_state_dict(snap, expected_digest=digest)
    # a path leaving the snapshot
    edited(lambda d: d["files"].append({**d["files"][0], "path": "../escape.safetensors"}))
    with pytest.raises(UnverifiedSourceError, match="escape"):
        load_state_dict(snap, expected_digest=digest)
    # the blob list of another manifest (a marker copied from another snapshot)
    edited(lambda d: d.update(blobs=d["blobs"][1:]))
    with pytest.raises(UnverifiedSourceError, match="blobs"):
        load_state_dict(snap, expected_digest=digest)
    _rewrite(marker, json.dumps(doc))
    assert load_state_dict(snap, expected_digest=digest)


def test_a_tar_layer_missing_from_the_store_is_refused(image_cache: tuple[NodeCache, str, str]) -> None:
    nc, snap, digest = image_cache
    manifest = json.loads((Path(nc.root) / "blobs" / "sha256" / digest.split(":")[1]).read_bytes())
    blob = Path(nc.root) / "blobs" / "sha256" / manifest["layers"][0]["digest"].split(":")[1]
    blob.unlink()
    with pytest.raises(UnverifiedSourceError, match=manifest["layers"][0]["digest"]):
        load_state_dict(snap, expected_digest=digest)


def test_a_marker_that_is_not_the_cache_owners_is_refused(image_cache: tuple[NodeCache, str, str]) -> None:
    _nc, snap, digest = image_cache
    os.chown(snap + ".ready", 65534, 65534)
    with pytest.raises(UnverifiedSourceError, match="not ready in its cache"):
        load_state_dict(snap, expected_digest=digest)


def test_a_file_added_next_to_them_is_not_loaded(
    image_cache: tuple[NodeCache, str, str], checkpoint: Path
) -> None:
    _nc, snap, digest = image_cache
    os.chmod(snap, 0o755)
    save_file({"planted.weight": torch.ones(4, 4)}, os.path.join(snap, "planted.safetensors"))
    os.chmod(snap, 0o555)
    stats = LoadStats()
    sd = load_state_dict(snap, expected_digest=digest, stats=stats)
    assert "planted.weight" not in sd
    assert set(sd) == set(reference_tensors(checkpoint))
    assert "planted.safetensors" not in stats.verification


def test_the_vllm_load_format_takes_a_modelcar_snapshot(
    registry: RegistryServer, checkpoint: Path, tmp_path: Path
) -> None:
    """``--load-format modelpack`` with ``--model`` = the snapshot of a modelcar (no vLLM needed
    for the rank load itself: the plugin hands vLLM exactly these checkpoint-shaped tensors)."""
    from modelpack.loader import ShardRule

    from modelpack.serving.weights import open_rank_load
    from modelpack.testdata.synthetic import SyntheticSpec, hf_config

    ref_name = push_with_oci_modelcar(registry, checkpoint, "tarload/vllm", tmp_path)
    _nc, snap, digest = _pull(tmp_path, ref_name)
    ref = reference_tensors(checkpoint)
    log = tmp_path / "serving.jsonl"
    rank = open_rank_load(
        {"expected_digest": digest, "events": str(log)},
        snap,
        hf_config(SyntheticSpec(shards=2)),
        2,
        1,
        environ={},
    )
    got = dict(rank.tensors())
    assert set(got) == set(ref) and rank.plan is not None
    for t in rank.plan.tensors:
        full, want = got[t.name], ref[t.name]
        assert full.shape == want.shape, t.name
        if t.rule is ShardRule.DIM0:
            n = want.shape[0] // 2
            assert torch.equal(full[n:], want[n:]), t.name
        elif t.rule is ShardRule.DIM1:
            n = want.shape[1] // 2
            assert torch.equal(full[:, n:], want[:, n:]), t.name
        else:
            assert torch.equal(full, want), t.name
    assert rank.stats.verification == {w: "hashed" for w in _weights(checkpoint)}
    events = [json.loads(line) for line in log.read_text().splitlines()]
    assert any(e["event"] == "loader.hashing" for e in events)


def test_a_cache_and_reference_pair_loads_a_tar_snapshot(
    image_cache: tuple[NodeCache, str, str], checkpoint: Path
) -> None:
    nc, _snap, digest = image_cache
    stats = LoadStats()
    sd = load_state_dict((nc, digest), expected_digest=digest, stats=stats)
    ref = reference_tensors(checkpoint)
    assert set(sd) == set(ref) and all(torch.equal(sd[k], ref[k]) for k in ref)
    assert stats.state == "hit" and set(stats.verification.values()) == {"hashed"}


def test_an_extracted_config_json_edited_in_place_fails_the_load(
    image_cache: tuple[NodeCache, str, str],
) -> None:
    """config.json decides the fingerprint's quantization: checked against its marker sha256."""
    _nc, snap, digest = image_cache
    cfg = Path(snap) / "config.json"
    text = cfg.read_text()
    os.chmod(cfg, 0o644)
    cfg.write_text(text.replace('"', "'", 1))  # same size, other bytes
    os.chmod(cfg, 0o444)
    with pytest.raises(DigestMismatchError, match=re.escape(str(cfg))):
        load_state_dict(snap, expected_digest=digest)
    os.chmod(cfg, 0o644)
    cfg.write_text(text + " ")  # one byte longer
    os.chmod(cfg, 0o444)
    with pytest.raises(SizeMismatchError, match=re.escape(str(cfg))):
        load_state_dict(snap, expected_digest=digest)
