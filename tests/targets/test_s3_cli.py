"""The CLI with ``s3://BUCKET/PREFIX:TAG`` wherever a target goes: push, cp, pull, inspect, sign/verify."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from click.testing import CliRunner

from modelpack.cli import main
from tests.fixtures.s3 import S3Server


def _run(s3: S3Server, *args: str) -> Any:
    res = CliRunner().invoke(
        main,
        list(args),
        env={"MODELPACK_S3_ENDPOINT": s3.endpoint, "MODELPACK_S3_PART_SIZE": str(64 * 1024)},
    )
    return res


def _versions(s3: S3Server, bucket: str) -> list[tuple[str, str]]:
    resp = s3.client().list_object_versions(Bucket=bucket)
    return sorted((v["Key"], v["VersionId"]) for v in resp.get("Versions", []))


def _same_tree(a: Path, b: Path) -> None:
    fa = {p.relative_to(a).as_posix(): p.read_bytes() for p in a.rglob("*") if p.is_file()}
    fb = {p.relative_to(b).as_posix(): p.read_bytes() for p in b.rglob("*") if p.is_file()}
    assert fa.keys() == fb.keys()
    assert all(fa[k] == fb[k] for k in fa)


def test_push_twice_cp_to_registry_and_pull(
    s3: S3Server, registry: Any, checkpoint: Path, tmp_path: Path
) -> None:
    bucket = s3.make_bucket(versioning=True)
    ref = f"s3://{bucket}/models/llama:v1"
    res = _run(s3, "push", str(checkpoint), ref, "--json")
    assert res.exit_code == 0, res.output
    digest = json.loads(res.stdout)["digest"]

    before = _versions(s3, bucket)
    res = _run(s3, "push", str(checkpoint), ref, "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["digest"] == digest
    assert _versions(s3, bucket) == before  # the second push wrote nothing

    res = _run(s3, "inspect", ref, "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["digest"] == digest

    reg_ref = registry.ref("s3-cli/llama", "v1")
    res = _run(s3, "cp", ref, reg_ref, "--plain-http", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["digest"] == digest

    out = tmp_path / "from-registry"
    res = _run(s3, "pull", reg_ref, str(out), "--plain-http")
    assert res.exit_code == 0, res.output
    _same_tree(checkpoint, out)
    out2 = tmp_path / "from-s3"
    res = _run(s3, "pull", ref, str(out2))
    assert res.exit_code == 0, res.output
    _same_tree(checkpoint, out2)


def test_push_from_an_s3_checkpoint_to_the_registry(
    s3: S3Server, registry: Any, checkpoint: Path, tmp_path: Path
) -> None:
    bucket = s3.make_bucket()
    s3.upload_dir(bucket, "raw/ckpt", checkpoint)
    local = _run(s3, "pack", str(checkpoint), f"oci:{tmp_path / 'layout'}:v1", "--json")
    assert local.exit_code == 0, local.output
    reg_ref = registry.ref("s3-cli/from-checkpoint", "v1")
    res = _run(s3, "push", f"s3://{bucket}/raw/ckpt/", reg_ref, "--plain-http", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["digest"] == json.loads(local.stdout)["digest"]


def test_sign_and_verify_an_artifact_in_s3(s3: S3Server, checkpoint: Path, tmp_path: Path) -> None:
    bucket = s3.make_bucket()
    ref = f"s3://{bucket}/signed:v1"
    assert _run(s3, "push", str(checkpoint), ref).exit_code == 0
    keys = tmp_path / "ci"
    assert _run(s3, "keygen", "--out", str(keys)).exit_code == 0
    res = _run(s3, "sign", ref, "--key", f"{keys}.key")
    assert res.exit_code == 0, res.output
    res = _run(s3, "verify", ref, "--key", f"{keys}.pub", "--json")
    assert res.exit_code == 0, res.output
    other = tmp_path / "other"
    assert _run(s3, "keygen", "--out", str(other)).exit_code == 0
    res = _run(s3, "verify", ref, "--key", f"{other}.pub")
    assert res.exit_code == 1, res.output


def test_debug_log_never_shows_credentials(s3: S3Server, checkpoint: Path) -> None:
    """``--debug`` logs every S3 decision, but no access key, secret or session token."""
    import os
    import subprocess
    import sys

    from tests.fixtures.s3 import DUMMY_ENV

    bucket = s3.make_bucket()
    exe = Path(sys.executable).with_name("modelpack")
    env = {**os.environ, "MODELPACK_S3_ENDPOINT": s3.endpoint, "MODELPACK_S3_PART_SIZE": str(64 * 1024)}
    out = subprocess.run(
        [str(exe), "--debug", "push", str(checkpoint), f"s3://{bucket}/dbg:v1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    text = out.stdout + out.stderr
    assert "DEBUG modelpack" in text or "DEBUG urllib3" in text  # debug logging was on
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        assert DUMMY_ENV[name] not in text, name
