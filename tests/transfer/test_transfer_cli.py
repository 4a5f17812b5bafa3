"""The push/pull/cp/tag commands as a CI job runs them: stdout, --json and exit codes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from modelpack.cli import main
from tests.fixtures.registry import RegistryServer


@pytest.fixture(autouse=True)
def _upload_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MODELPACK_UPLOAD_STATE_DIR", str(tmp_path / "upload-state"))


def _run(*args: str) -> tuple[int, str, str]:
    r = CliRunner().invoke(main, list(args))
    return r.exit_code, r.stdout, r.stderr


def test_push_prints_the_digest_and_is_idempotent(registry: RegistryServer, checkpoint: Path) -> None:
    ref = registry.ref("cli/push", "v1")
    code, out, err = _run("push", str(checkpoint), ref, "--progress", "off")
    assert code == 0, err
    digest = out.strip()
    assert digest.startswith("sha256:") and len(digest) == 71
    assert "uploaded" in err
    code, out, err = _run("push", str(checkpoint), ref, "--json", "--progress", "off")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["digest"] == digest and doc["reference"] == ref
    assert doc["transfer"]["blobs"]["copied"] == 0 and doc["transfer"]["blobs"]["skipped"] == doc["files"] + 1


def test_pull_cp_tag_commands(registry: RegistryServer, checkpoint: Path, tmp_path: Path) -> None:
    ref = registry.ref("cli/model", "v1")
    code, out, _ = _run("push", str(checkpoint), ref, "--progress", "off")
    digest = out.strip()
    code, out, err = _run("pull", ref, str(tmp_path / "m"), "--json", "--progress", "off")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["digest"] == digest and sorted(doc["directory"]["paths"]) == sorted(
        p.name for p in checkpoint.iterdir()
    )
    code, out, err = _run("cp", ref, f"oci:{tmp_path / 'layout'}:v1", "--progress", "off")
    assert code == 0 and out.strip() == digest, err
    code, out, err = _run(
        "cp", f"oci:{tmp_path / 'layout'}:v1", registry.ref("cli/copy", "v5"), "--progress", "off"
    )
    assert code == 0 and out.strip() == digest, err
    code, out, err = _run("tag", ref, "prod")
    assert code == 0 and out.strip() == digest, err
    code, out, err = _run("pull", registry.ref("cli/model", "prod"), str(tmp_path / "p"), "--progress", "off")
    assert code == 0 and out.strip() == digest, err


def test_errors_have_meaningful_exit_codes(
    registry: RegistryServer, checkpoint: Path, tmp_path: Path
) -> None:
    code, _, err = _run("pull", registry.ref("cli/missing", "v1"), str(tmp_path / "x"))
    assert code == 1 and "cli/missing" in err and "404" in err
    code, _, err = _run("push", str(checkpoint), "Not A//Reference")
    assert code == 2
    code, _, err = _run("push", str(checkpoint), f"{registry.ref('cli/push', None)}@sha256:{'0' * 64}")
    assert code == 2 and "digest" in err


def test_pull_oci_double_slash_reference_reads_the_registry(
    registry: RegistryServer, checkpoint: Path, tmp_path: Path
) -> None:
    """``modelpack pull oci://HOST/REPO:TAG`` pulls from the registry, the meaning the storage
    initializer gives ``oci://``; no local directory is looked for."""
    ref = registry.ref("cli/oci-scheme", "v1")
    code, out, err = _run("push", str(checkpoint), ref, "--progress", "off")
    assert code == 0, err
    code, pulled, err = _run("pull", f"oci://{ref}", str(tmp_path / "m"), "--progress", "off")
    assert code == 0, err
    assert pulled.strip() == out.strip()
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == sorted(p.name for p in checkpoint.iterdir())
