"""A push into a new repository of a registry that already holds the blobs mounts
them instead of uploading them again — from where the same user pushed them before (a per-user
record), or from ``--mount-from REPO``. Counted from the registry's own access log: an upload ends
with ``PUT …/blobs/uploads/…?digest=`` (201), a mount is ``POST …/blobs/uploads/?mount=…&from=…`` (201).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from modelpack.api import transfer
from modelpack.cli import main
from modelpack.transfer.pushed_blobs import MAX_ENTRIES, PushedBlobs, record_path
from tests.fixtures.registry import RegistryServer


def _counts(registry: RegistryServer, mark: int, repo: str) -> tuple[int, int]:
    """(uploads, mounts) into ``repo`` since ``mark``, as the registry logged them."""
    uploads = mounts = 0
    for method, path, status in registry.requests_since(mark):
        if not path.startswith(f"/v2/{repo}/blobs/uploads/") or status != 201:
            continue
        if method == "PUT":
            uploads += 1
        elif method == "POST" and "mount=" in path:
            mounts += 1
    return uploads, mounts


@pytest.fixture
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "upload-state"
    monkeypatch.setenv("MODELPACK_UPLOAD_STATE_DIR", str(d))
    monkeypatch.delenv("MODELPACK_PUSH_RECORD", raising=False)  # the default place, in the state dir
    return d


def _blob_count(checkpoint: Path) -> int:
    return len([p for p in checkpoint.iterdir() if p.is_file()]) + 1  # files + config


def test_a_push_into_a_new_repository_mounts_what_this_user_pushed_before(
    registry: RegistryServer, checkpoint: Path, state: Path
) -> None:
    n = _blob_count(checkpoint)
    mark = registry.log_mark()
    first = transfer.push(str(checkpoint), registry.ref("mount/first", "v1"), progress="off")
    assert _counts(registry, mark, "mount/first") == (n, 0)
    assert first.copy.blobs_copied == n

    mark = registry.log_mark()
    second = transfer.push(str(checkpoint), registry.ref("mount/second", "v1"), progress="off")
    # before: "uploaded 7 of 7 blobs, 0 mounted"
    assert _counts(registry, mark, "mount/second") == (0, n)
    assert (second.copy.blobs_copied, second.copy.blobs_mounted) == (0, n)
    assert second.digest == first.digest
    assert os.stat(record_path()).st_mode & 0o777 == 0o600


def test_mount_from_names_the_source_repository(
    registry: RegistryServer, checkpoint: Path, state: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    n = _blob_count(checkpoint)
    transfer.push(str(checkpoint), registry.ref("mount/src", "v1"), progress="off")
    monkeypatch.setenv("MODELPACK_PUSH_RECORD", str(tmp_path / "another-machine.json"))  # no record
    mark = registry.log_mark()
    r = CliRunner().invoke(
        main,
        ["push", str(checkpoint), registry.ref("mount/hinted", "v1"), "--mount-from", "mount/src", "--json"],
    )
    assert r.exit_code == 0, r.output
    assert _counts(registry, mark, "mount/hinted") == (0, n)
    assert json.loads(r.stdout)["transfer"]["blobs"]["mounted"] == n


def test_a_stale_record_or_a_wrong_hint_falls_back_to_uploading(
    registry: RegistryServer, checkpoint: Path, state: Path
) -> None:
    n = _blob_count(checkpoint)
    record = PushedBlobs()
    from modelpack.packing.packer import build_artifact

    art = build_artifact(str(checkpoint))
    digests = [str(d.digest) for d in (art.manifest.config, *art.manifest.layers)]
    record.remember(registry.host, "mount/never-pushed", digests)
    record.save()
    mark = registry.log_mark()
    pushed = transfer.push(
        str(checkpoint), registry.ref("mount/fresh", "v1"), progress="off", mount_from=["mount/also-empty"]
    )
    assert _counts(registry, mark, "mount/fresh") == (n, 0)
    assert pushed.copy.blobs_copied == n and pushed.copy.blobs_mounted == 0
    out = transfer.pull(registry.ref("mount/fresh", "v1"), str(state.parent / "pulled"), progress="off")
    assert len(out.files) == n - 1


def test_the_record_is_bounded_and_a_corrupt_one_is_ignored(state: Path) -> None:
    record = PushedBlobs()
    record.remember("r.example", "a", [f"sha256:{i:064x}" for i in range(MAX_ENTRIES + 10)])
    record.save()
    again = PushedBlobs()
    assert again.repositories("r.example", f"sha256:{0:064x}") == []  # the oldest were forgotten
    assert again.repositories("r.example", f"sha256:{MAX_ENTRIES + 9:064x}") == ["a"]
    Path(record_path()).write_bytes(b'{"registries": {"r.example": {"x": "a", "x": "b"}}}')
    assert PushedBlobs().repositories("r.example", "x") == []
