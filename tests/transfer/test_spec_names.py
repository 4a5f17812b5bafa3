"""``--spec-names cncf|cnai``: pack, push and cp write the ModelPack media types in either naming.

Released Harbor recognises only the ``vnd.cnai`` names (modctl writes them); Docker Hub's model
catalog, KServe and the spec since v0.0.7 use ``vnd.cncf`` (the default). The naming is an input
of the pack like any other: the same files give one digest per naming. Either form is pulled,
cached, verified and loaded alike. ``cp --spec-names`` respells a stored manifest (the blobs are
untouched, the manifest digest is new, signatures of the old digest do not carry over).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from modelpack.signing import generate_key
from modelpack.signing.keys import write_keypair

from modelpack.cli import main
from tests.fixtures.registry import RegistryServer

CNAI = "application/vnd.cnai.model."
CNCF = "application/vnd.cncf.model."


@pytest.fixture(autouse=True)
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MODELPACK_UPLOAD_STATE_DIR", str(tmp_path / "upload-state"))
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "no-docker-config"))


def _run(*args: str) -> Any:
    res = CliRunner().invoke(main, list(args))
    return res


def _ok(*args: str) -> str:
    res = _run(*args)
    assert res.exit_code == 0, res.output
    return str(res.stdout)


def _files(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.name.startswith(".")
    }


def _manifest(layout: Path, digest: str) -> dict[str, Any]:
    return dict(json.loads((layout / "blobs" / "sha256" / digest.removeprefix("sha256:")).read_bytes()))


def _media_types(doc: dict[str, Any]) -> list[str]:
    return [doc["artifactType"], doc["config"]["mediaType"], *(layer["mediaType"] for layer in doc["layers"])]


def _pack(checkpoint: Path, layout: Path, *extra: str) -> str:
    return json.loads(_ok("pack", str(checkpoint), f"oci:{layout}:v1", "--json", *extra))["digest"]


def test_the_same_files_give_one_digest_per_naming(checkpoint: Path, tmp_path: Path) -> None:
    """Two packs with cnai names give the same digest; cncf and cnai differ only in media types."""
    cnai_a = _pack(checkpoint, tmp_path / "a", "--spec-names", "cnai")
    cnai_b = _pack(checkpoint, tmp_path / "b", "--spec-names", "cnai")
    cncf = _pack(checkpoint, tmp_path / "c")
    assert cnai_a == cnai_b != cncf
    assert _pack(checkpoint, tmp_path / "d", "--spec-names", "cncf") == cncf
    doc_cnai, doc_cncf = _manifest(tmp_path / "a", cnai_a), _manifest(tmp_path / "c", cncf)
    assert all(mt.startswith(CNAI) for mt in _media_types(doc_cnai)), _media_types(doc_cnai)
    assert all(mt.startswith(CNCF) for mt in _media_types(doc_cncf)), _media_types(doc_cncf)
    # the blobs and the annotations are the same: only the names differ
    assert doc_cnai["config"]["digest"] == doc_cncf["config"]["digest"]
    for la, lb in zip(doc_cnai["layers"], doc_cncf["layers"], strict=True):
        assert (la["digest"], la["annotations"]) == (lb["digest"], lb["annotations"])
        assert la["mediaType"].removeprefix(CNAI) == lb["mediaType"].removeprefix(CNCF)
    assert doc_cnai.get("annotations") == doc_cncf.get("annotations")


def test_an_unknown_naming_and_an_image_with_cnai_names_are_usage_errors(
    checkpoint: Path, tmp_path: Path
) -> None:
    bad = _run("pack", str(checkpoint), f"oci:{tmp_path / 'l'}:v1", "--spec-names", "harbor")
    assert bad.exit_code == 2 and "harbor" in bad.output
    image = _run(
        "pack", str(checkpoint), f"oci:{tmp_path / 'l'}:v1", "--format", "image", "--spec-names", "cnai"
    )
    assert image.exit_code == 2 and "--spec-names" in image.output
    assert not (tmp_path / "l" / "index.json").exists()


def test_a_manifest_in_either_naming_is_pulled_cached_verified_and_loaded_alike(
    registry: RegistryServer, checkpoint: Path, tmp_path: Path
) -> None:
    priv, pub = write_keypair(str(tmp_path / "k"), generate_key())
    seen: dict[str, Any] = {}
    for names in ("cncf", "cnai"):
        ref = registry.ref(f"spec-names/read-{names}", "v1")
        pushed = json.loads(
            _ok("push", str(checkpoint), ref, "--spec-names", names, "--sign-key", priv, "--json")
        )
        digest = pushed["digest"]
        pinned = ref.rsplit(":", 1)[0] + "@" + digest
        # a directory
        out = tmp_path / f"dir-{names}"
        _ok("pull", pinned, str(out))
        assert _files(out) == _files(checkpoint)
        # the node cache, then the loader on the snapshot and by range reads with the chunk table
        cached = json.loads(_ok("pull", pinned, "--cache", str(tmp_path / f"cache-{names}"), "--json"))
        assert _files(Path(cached["path"])) == _files(checkpoint)
        loaded = json.loads(_ok("load", cached["path"], "--expected-digest", digest, "--json"))
        streamed = json.loads(_ok("load", pinned, "--trusted-key", pub, "--json"))
        # the signature
        verified = _run("verify", pinned, "--key", pub)
        assert verified.exit_code == 0 and "chunk table: verified" in verified.output, verified.output
        inspected = json.loads(_ok("inspect", pinned, "--json"))
        seen[names] = {
            "digest": digest,
            "config": inspected["config"],
            "layers": [(layer["path"], layer["kind"], layer["digest"]) for layer in inspected["layers"]],
            "tensors": (loaded["tensors"], loaded["bytesRead"], streamed["tensors"]),
            "verification": (loaded["verification"], streamed["verification"]),
        }
    assert seen["cncf"]["digest"] != seen["cnai"]["digest"]
    for key in ("config", "layers", "tensors", "verification"):
        assert seen["cncf"][key] == seen["cnai"][key], key


def test_cp_respells_the_manifest_and_keeps_every_blob(
    registry: RegistryServer, checkpoint: Path, tmp_path: Path
) -> None:
    """``cp --spec-names cnai`` of a cncf artifact gives the digest a cnai pack of the same files
    has: the config and layers are the same blobs, only the manifest is new; back again with
    ``--spec-names cncf`` gives the original digest; a manifest already in that naming is copied
    byte for byte."""
    cnai_digest = _pack(checkpoint, tmp_path / "cnai", "--spec-names", "cnai")
    src = registry.ref("spec-names/cp-src", "v1")
    cncf_digest = json.loads(_ok("push", str(checkpoint), src, "--json"))["digest"]
    dst = registry.ref("spec-names/cp-cnai", "v1")
    copied = json.loads(_ok("cp", src, dst, "--spec-names", "cnai", "--json"))
    assert copied["digest"] == cnai_digest != cncf_digest
    assert copied["blobs"]["copied"] == 0  # every blob mounted or already there: none re-sent
    out = tmp_path / "out"
    _ok("pull", dst, str(out))
    assert _files(out) == _files(checkpoint)
    back = json.loads(
        _ok("cp", dst, registry.ref("spec-names/cp-back", "v1"), "--spec-names", "cncf", "--json")
    )
    assert back["digest"] == cncf_digest
    same = json.loads(
        _ok("cp", dst, registry.ref("spec-names/cp-same", "v1"), "--spec-names", "cnai", "--json")
    )
    assert same["digest"] == cnai_digest
    # into a layout too: the rewritten manifest is what is stored and tagged
    _ok("cp", src, f"oci:{tmp_path / 'copy'}:v1", "--spec-names", "cnai")
    index = json.loads((tmp_path / "copy" / "index.json").read_text())
    assert [m["digest"] for m in index["manifests"]] == [cnai_digest]
    assert all(mt.startswith(CNAI) for mt in _media_types(_manifest(tmp_path / "copy", cnai_digest)))


def test_cp_respelling_refuses_referrers_whose_signatures_name_the_old_digest(
    registry: RegistryServer, checkpoint: Path, tmp_path: Path
) -> None:
    src = registry.ref("spec-names/refs-src", "v1")
    _ok("push", str(checkpoint), src)
    res = _run("cp", src, f"oci:{tmp_path / 'dst'}:v1", "--spec-names", "cnai", "--referrers")
    assert res.exit_code == 2 and "--referrers" in res.output and "sign" in res.output
    assert not (tmp_path / "dst").exists()


def test_cp_respelling_refuses_what_is_not_a_modelpack_manifest(checkpoint: Path, tmp_path: Path) -> None:
    """An image (the image-shaped variant) has no ModelPack names: nothing to respell, refused
    rather than copied under a flag that did nothing."""
    layout = tmp_path / "img"
    _ok("pack", str(checkpoint), f"oci:{layout}:v1", "--format", "image")
    res = _run("cp", f"oci:{layout}:v1", f"oci:{tmp_path / 'dst'}:v1", "--spec-names", "cnai")
    assert res.exit_code == 1 and "not a ModelPack" in res.output, res.output
    assert json.loads((tmp_path / "dst" / "index.json").read_text())["manifests"] == []


def test_push_from_a_layout_respells_like_cp(
    registry: RegistryServer, checkpoint: Path, tmp_path: Path
) -> None:
    cnai_digest = _pack(checkpoint, tmp_path / "cnai", "--spec-names", "cnai")
    _pack(checkpoint, tmp_path / "cncf")
    dst = registry.ref("spec-names/push-layout", "v1")
    pushed = json.loads(_ok("push", f"oci:{tmp_path / 'cncf'}:v1", dst, "--spec-names", "cnai", "--json"))
    assert pushed["digest"] == cnai_digest
