"""Interop with skopeo 1.9 (a real second client) through the same registry.

skopeo needs ``--src-tls-verify=false`` / ``--dest-tls-verify=false`` for a plain-HTTP registry
and ``--preserve-digests`` so it refuses to rewrite the manifest rather than converting it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from modelpack import api
from modelpack.api import transfer
from tests.fixtures.registry import RegistryServer

SKOPEO = shutil.which("skopeo") or "/usr/bin/skopeo"


@pytest.fixture(autouse=True)
def _upload_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MODELPACK_UPLOAD_STATE_DIR", str(tmp_path / "upload-state"))


def _skopeo(*args: str) -> None:
    r = subprocess.run(
        [SKOPEO, "copy", "--preserve-digests", *args], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr


def test_skopeo_copies_our_push_with_the_same_manifest_digest(
    registry: RegistryServer, checkpoint: Path, tmp_path: Path
) -> None:
    pushed = transfer.push(str(checkpoint), registry.ref("interop/ours", "v1"), progress="off")
    out = tmp_path / "skopeo-layout"
    _skopeo("--src-tls-verify=false", f"docker://{registry.ref('interop/ours', 'v1')}", f"oci:{out}:v1")
    index = json.loads((out / "index.json").read_text())
    [entry] = index["manifests"]
    assert entry["digest"] == pushed.digest
    # and the bytes skopeo stored are exactly ours
    ours = api.pack(str(checkpoint), f"oci:{tmp_path / 'ours'}:v1").artifact.manifest.raw
    assert (out / "blobs" / "sha256" / pushed.digest.split(":")[1]).read_bytes() == ours
    # the layout skopeo wrote is readable by us, file for file
    res = transfer.pull(f"oci:{out}:v1", str(tmp_path / "from-skopeo-layout"), progress="off")
    for rel in res.files:
        assert (tmp_path / "from-skopeo-layout" / rel).read_bytes() == (checkpoint / rel).read_bytes()


def test_we_pull_what_skopeo_pushed(registry: RegistryServer, checkpoint: Path, tmp_path: Path) -> None:
    packed = api.pack(str(checkpoint), f"oci:{tmp_path / 'layout'}:v1")
    _skopeo(
        "--dest-tls-verify=false",
        f"oci:{tmp_path / 'layout'}:v1",
        f"docker://{registry.ref('interop/theirs', 'v1')}",
    )
    dest = tmp_path / "pulled"
    res = transfer.pull(registry.ref("interop/theirs", "v1"), str(dest), progress="off")
    assert res.digest == str(packed.artifact.digest)
    assert sorted(res.files) == sorted(f.relpath for f in packed.artifact.files)
    for rel in res.files:
        assert (dest / rel).read_bytes() == (checkpoint / rel).read_bytes()
