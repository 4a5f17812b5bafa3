"""``modelpack pack s3://BUCKET/CHECKPOINT/ DEST``: a checkpoint in S3 packed by streaming."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from modelpack import api
from modelpack.cli import main
from modelpack.errors import PackError, S3Error, SafetensorsError
from modelpack.packing.packer import PackOptions
from modelpack.packing.s3_checkpoint import build_s3_artifact
from modelpack.targets.layout import OCILayoutTarget
from modelpack.targets.opener import TargetOptions
from modelpack.targets.options import S3Tuning
from modelpack.transfer.copy import copy
from tests.fixtures.s3 import S3Server

OPTS = TargetOptions(s3=S3Tuning(part_size=64 * 1024))


def _upload_checkpoint(s3: S3Server, checkpoint: Path, bucket: str, prefix: str = "ckpts/ckpt") -> None:
    s3.upload_dir(bucket, prefix, checkpoint)


def test_pack_from_s3_matches_local_pack_and_lands_nothing_on_disk(
    s3: S3Server, checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bucket = s3.make_bucket()
    _upload_checkpoint(s3, checkpoint, bucket)
    c = s3.client()
    c.put_object(Bucket=bucket, Key="ckpts/ckpt/sub/", Body=b"")  # a "directory" marker
    c.put_object(Bucket=bucket, Key="ckpts/ckpt/.cache/x.lock", Body=b"junk")  # hidden: skipped
    c.put_object(Bucket=bucket, Key="ckpts/ckpt-other/config.json", Body=b"{}")  # sibling prefix
    local = api.pack(str(checkpoint), f"oci:{tmp_path / 'local'}:v1")

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))
    monkeypatch.chdir(scratch)
    result = api.pack(f"s3://{bucket}/ckpts/ckpt/", f"s3://{bucket}/models/m:v1", target_options=OPTS)
    assert os.listdir(scratch) == []
    assert result.artifact.digest == local.artifact.digest
    assert [f.relpath for f in result.artifact.files] == [f.relpath for f in local.artifact.files]

    pulled = OCILayoutTarget(tmp_path / "pulled", create=True)
    from modelpack.targets.opener import open_target

    copy(open_target(f"s3://{bucket}/models/m:v1", OPTS), pulled, "v1", "v1")
    for f in local.artifact.files:
        desc = next(d for d in local.artifact.manifest.layers if d.digest == f.digest)
        assert Path(pulled.blob_path(desc.digest)).read_bytes() == (checkpoint / f.relpath).read_bytes()


def test_cli_pack_from_s3_and_inspect(s3: S3Server, checkpoint: Path) -> None:
    bucket = s3.make_bucket()
    _upload_checkpoint(s3, checkpoint, bucket, "llama")
    runner = CliRunner()
    res = runner.invoke(
        main,
        ["pack", f"s3://{bucket}/llama", f"s3://{bucket}/oci/llama:v1", "--json", "--version", "1.0"],
        env={"MODELPACK_S3_ENDPOINT": s3.endpoint},
    )
    assert res.exit_code == 0, res.output
    packed = json.loads(res.output)
    assert packed["files"] == len(list(checkpoint.iterdir()))
    res = runner.invoke(
        main, ["inspect", f"s3://{bucket}/oci/llama:v1", "--json", "--s3-endpoint", s3.endpoint]
    )
    assert res.exit_code == 0, res.output
    summary = json.loads(res.output)
    assert summary["digest"] == packed["digest"]
    assert summary["config"]["descriptor"]["name"] == "llama"
    assert summary["config"]["descriptor"]["version"] == "1.0"
    # a local path that does not exist is still a usage error
    res = runner.invoke(main, ["pack", "/no/such/dir", f"s3://{bucket}/oci/x:v1"])
    assert res.exit_code == 2 and "/no/such/dir" in res.output and "does not exist" in res.output


def test_bad_safetensors_header_in_s3_is_refused_by_name(s3: S3Server, checkpoint: Path) -> None:
    bucket = s3.make_bucket()
    _upload_checkpoint(s3, checkpoint, bucket)
    shard = sorted(checkpoint.glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    n = int.from_bytes(data[:8], "little")
    header = bytes(data[8 : 8 + n]).replace(b'"BF16"', b'"BF17"', 1)
    s3.client().put_object(
        Bucket=bucket, Key=f"ckpts/ckpt/{shard.name}", Body=bytes(data[:8]) + header + bytes(data[8 + n :])
    )
    with pytest.raises(SafetensorsError, match=f"s3://{bucket}/ckpts/ckpt/{shard.name}"):
        build_s3_artifact(f"s3://{bucket}/ckpts/ckpt", PackOptions(), OPTS)
    truncated = bytes(data[:8]) + bytes(data[8:100])
    s3.client().put_object(Bucket=bucket, Key=f"ckpts/ckpt/{shard.name}", Body=truncated)
    with pytest.raises(SafetensorsError, match="runs past the end"):
        build_s3_artifact(f"s3://{bucket}/ckpts/ckpt", PackOptions(), OPTS)


def test_object_replaced_after_hashing_is_not_published(
    s3: S3Server, checkpoint: Path, tmp_path: Path
) -> None:
    bucket = s3.make_bucket()
    _upload_checkpoint(s3, checkpoint, bucket)
    artifact = build_s3_artifact(f"s3://{bucket}/ckpts/ckpt", PackOptions(), OPTS)
    victim = max(artifact.files, key=lambda f: f.size)
    body = bytearray((checkpoint / victim.relpath).read_bytes())
    body[-1] ^= 0xFF
    s3.client().put_object(Bucket=bucket, Key=f"ckpts/ckpt/{victim.relpath}", Body=bytes(body))
    dst = OCILayoutTarget(tmp_path / "out", create=True)
    with pytest.raises(S3Error, match="changed while it was being read"):
        copy(artifact, dst, "latest", "v1")
    assert list(dst.list_tags()) == []
    assert not os.path.exists(dst.blob_path(victim.digest))


def test_empty_prefix_unsafe_keys_and_reshard_are_refused(s3: S3Server, checkpoint: Path) -> None:
    bucket = s3.make_bucket()
    with pytest.raises(PackError, match="no objects to pack"):
        build_s3_artifact(f"s3://{bucket}/nothing/", PackOptions(), OPTS)
    _upload_checkpoint(s3, checkpoint, bucket)
    with pytest.raises(PackError, match="re-sharding needs local files"):
        build_s3_artifact(f"s3://{bucket}/ckpts/ckpt", PackOptions(max_file_size=1024 * 1024), OPTS)
    s3.client().put_object(Bucket=bucket, Key="ckpts/ckpt/a//b.json", Body=b"{}")
    with pytest.raises(PackError, match=r"a//b\.json"):
        build_s3_artifact(f"s3://{bucket}/ckpts/ckpt", PackOptions(), OPTS)


@pytest.mark.parametrize(
    "key",
    [
        "sub/../model.safetensors",
        "./config.json",
        "../escape.json",
        "sub/./x.json",
        "sub/..",
        "a//b.json",
        "sub//",  # a "directory" marker with an empty component
        "notes\x1b[2J.txt",
    ],
)
def test_keys_with_dot_dotdot_or_empty_components_are_refused_by_name(
    s3: S3Server, checkpoint: Path, key: str
) -> None:
    """Such keys were silently skipped (``.``/``..`` start with a dot, like a
    hidden file); a checkpoint whose listing holds one is refused, naming the key."""
    bucket = s3.make_bucket()
    _upload_checkpoint(s3, checkpoint, bucket)
    c = s3.client()
    c.put_object(Bucket=bucket, Key=f"ckpts/ckpt/{key}", Body=b"{}")
    assert any(o["Key"] == f"ckpts/ckpt/{key}" for o in c.list_objects_v2(Bucket=bucket)["Contents"])
    with pytest.raises(PackError) as exc:
        build_s3_artifact(f"s3://{bucket}/ckpts/ckpt", PackOptions(), OPTS)
    assert repr(key)[1:-1] in str(exc.value) or key in str(exc.value), str(exc.value)
    r = CliRunner().invoke(
        main,
        ["pack", f"s3://{bucket}/ckpts/ckpt/", f"oci:{checkpoint.parent / 'out'}:v1"],
        env={"MODELPACK_S3_ENDPOINT": s3.endpoint},
    )
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit), r.output
    assert "ckpts/ckpt/" in r.output and "refus" in r.output, r.output


def test_the_same_files_from_s3_and_a_differently_named_directory_agree_given_a_name(
    s3: S3Server, checkpoint: Path, tmp_path: Path
) -> None:
    """``aws s3 sync s3://B/ckpts/llama-8b ./checkpoint`` gives the same files under another name:
    the default model name (the prefix's or the directory's last component) then differs, and so
    does the digest, as docs/s3.md says; with ``--name`` the digest depends on the files alone."""
    bucket = s3.make_bucket()
    _upload_checkpoint(s3, checkpoint, bucket, "ckpts/llama-8b")
    synced = tmp_path / "checkpoint"
    os.rename(checkpoint, synced)
    remote = f"s3://{bucket}/ckpts/llama-8b/"
    by_default = api.pack(remote, f"oci:{tmp_path / 'a'}:v1", target_options=OPTS)
    assert by_default.artifact.digest != api.pack(str(synced), f"oci:{tmp_path / 'b'}:v1").artifact.digest
    named = PackOptions(name="llama-8b")
    from_s3 = api.pack(remote, f"oci:{tmp_path / 'c'}:v1", named, OPTS)
    from_dir = api.pack(str(synced), f"oci:{tmp_path / 'd'}:v1", named)
    assert from_s3.artifact.digest == from_dir.artifact.digest == by_default.artifact.digest
