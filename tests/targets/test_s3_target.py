"""S3Target against a real S3 endpoint (moto in server mode on 127.0.0.1).

Small generated checkpoints; a 64 KiB part size (moto started with that floor) so every weight
file goes through a multipart upload of several parts.
"""

from __future__ import annotations

import hashlib
import io
import os
import random
import threading
from pathlib import Path
from typing import Any

import pytest

from modelpack import api
from modelpack.errors import DigestMismatchError, NotFoundError, S3Error, SizeMismatchError
from modelpack.oci.descriptor import Descriptor
from modelpack.oci.digest import Digest
from modelpack.oci.reference import parse_reference
from modelpack.packing.packer import build_artifact
from modelpack.targets.base import BlobSource, bytes_blob_source
from modelpack.targets.layout import OCILayoutTarget
from modelpack.targets.opener import TargetOptions, open_target
from modelpack.targets.s3 import S3Settings, S3Target
from modelpack.transfer.copy import copy
from tests.fixtures.s3 import S3Server

PART = 64 * 1024
OPTS = TargetOptions(extra={"s3_part_size": PART})


def _target(s3: S3Server, bucket: str, prefix: str = "models/m", **settings: Any) -> S3Target:
    return S3Target(bucket, prefix, endpoint=s3.endpoint, settings=S3Settings(part_size=PART, **settings))


def _versions(s3: S3Server, bucket: str) -> list[tuple[str, str, str]]:
    resp = s3.client().list_object_versions(Bucket=bucket)
    return sorted(
        (v["Key"], v["VersionId"], v["ETag"])
        for v in resp.get("Versions", []) + resp.get("DeleteMarkers", [])
    )


def _uploads(s3: S3Server, bucket: str) -> list[dict[str, Any]]:
    return list(s3.client().list_multipart_uploads(Bucket=bucket).get("Uploads", []))


def test_push_to_s3_is_an_oci_layout_with_the_local_digest(
    s3: S3Server, checkpoint: Path, tmp_path: Path
) -> None:
    bucket = s3.make_bucket()
    result = api.pack(str(checkpoint), f"s3://{bucket}/models/llama:v1", target_options=OPTS)
    local = api.pack(str(checkpoint), f"oci:{tmp_path / 'layout'}:v1")
    assert result.artifact.digest == local.artifact.digest

    keys = {o["Key"]: o["Size"] for o in s3.client().list_objects_v2(Bucket=bucket)["Contents"]}
    assert "models/llama/oci-layout" in keys and "models/llama/index.json" in keys
    manifest = result.artifact.manifest
    for d in [manifest.config, *manifest.layers]:
        assert keys[f"models/llama/blobs/sha256/{d.digest.hex}"] == d.size
    assert keys[f"models/llama/blobs/sha256/{manifest.digest.hex}"] == manifest.size
    # every blob is the file's bytes, exactly
    c = s3.client()
    for f in result.artifact.files:
        body = c.get_object(Bucket=bucket, Key=f"models/llama/blobs/sha256/{f.digest.hex}")["Body"].read()
        assert body == (checkpoint / f.relpath).read_bytes()

    summary = api.inspect(f"s3://{bucket}/models/llama:v1", OPTS)
    assert summary.digest == str(local.artifact.digest)
    assert [layer.path for layer in summary.layers] == [f.relpath for f in result.artifact.files]
    assert summary.config and summary.config["descriptor"]["name"] == "ckpt"
    tags = api.list_tags(f"s3://{bucket}/models/llama", OPTS)
    assert [(t["tag"], t["digest"]) for t in tags] == [("v1", str(local.artifact.digest))]
    assert _uploads(s3, bucket) == []


def test_weights_go_multipart_and_read_back_by_stream_and_range(s3: S3Server, checkpoint: Path) -> None:
    bucket = s3.make_bucket()
    target = _target(s3, bucket)
    artifact = build_artifact(str(checkpoint))
    copy(artifact, target, "latest", "v1")
    weights = [f for f in artifact.files if f.relpath.endswith(".safetensors")]
    expected_parts = sum(-(-f.size // PART) for f in weights)
    assert target.stats["parts_uploaded"] >= expected_parts > len(weights)

    rng = random.Random(7)
    for f in weights:
        data = (checkpoint / f.relpath).read_bytes()
        desc = next(lyr for lyr in artifact.manifest.layers if lyr.digest == f.digest)
        with target.fetch_blob(desc) as stream:
            assert stream.read() == data
        with target.fetch_blob(desc, 12345) as stream:
            assert stream.read() == data[12345:]
        for _ in range(5):
            off = rng.randrange(0, f.size)
            n = rng.randrange(0, f.size - off + 1)
            assert target.fetch_range(desc, off, n) == data[off : off + n]
        assert target.fetch_range(desc, f.size - 3, 3) == data[-3:]
        with pytest.raises(S3Error, match="outside blob"):
            target.fetch_range(desc, f.size - 3, 4)
        # a descriptor claiming a different size is refused on read
        lying = Descriptor(desc.media_type, desc.digest, desc.size + 1)
        with pytest.raises(SizeMismatchError, match=desc.digest):
            target.fetch_range(lying, 0, 10)


def test_second_push_writes_nothing(s3: S3Server, checkpoint: Path) -> None:
    bucket = s3.make_bucket(versioning=True)
    ref = f"s3://{bucket}/models/m:v1"
    first = api.pack(str(checkpoint), ref, target_options=OPTS)
    before = _versions(s3, bucket)
    second = api.pack(str(checkpoint), ref, target_options=OPTS)
    assert second.artifact.digest == first.artifact.digest
    assert second.copy.blobs_copied == 0 and second.copy.blobs_skipped == first.copy.blobs_total
    # with versioning on, any PUT (even of identical bytes) would add a version
    assert _versions(s3, bucket) == before
    assert _uploads(s3, bucket) == []


def test_blob_with_wrong_bytes_is_aborted_never_completed(s3: S3Server) -> None:
    bucket = s3.make_bucket()
    target = _target(s3, bucket)
    good = os.urandom(5 * PART + 17)
    bad = bytearray(good)
    bad[3 * PART + 5] ^= 0xFF
    desc = Descriptor("application/octet-stream", Digest.from_bytes(good), len(good))
    with pytest.raises(DigestMismatchError) as err:
        target.push_blob(bytes_blob_source(desc, bytes(bad)))
    assert desc.digest in str(err.value)
    assert not target.exists(desc)
    assert _uploads(s3, bucket) == []
    assert target.stats["uploads_aborted"] == 1
    # short stream: refused the same way
    with pytest.raises(SizeMismatchError):
        target.push_blob(bytes_blob_source(desc, good[:-1]))
    assert _uploads(s3, bucket) == [] and not target.exists(desc)
    # small (single PutObject) blob with wrong bytes: nothing is sent
    small = Descriptor("application/octet-stream", Digest.from_bytes(b"hello"), 5)
    with pytest.raises(DigestMismatchError):
        target.push_blob(bytes_blob_source(small, b"hellO"))
    assert not target.exists(small)
    target.push_blob(bytes_blob_source(desc, good))
    assert target.fetch_range(desc, 0, len(good)) == good


def test_corrupted_blob_in_bucket_is_refused_on_read(s3: S3Server, checkpoint: Path, tmp_path: Path) -> None:
    bucket = s3.make_bucket()
    result = api.pack(str(checkpoint), f"s3://{bucket}/m:v1", target_options=OPTS)
    layer = max(result.artifact.manifest.layers, key=lambda d: d.size)
    key = f"m/blobs/sha256/{layer.digest.hex}"
    c = s3.client()
    data = bytearray(c.get_object(Bucket=bucket, Key=key)["Body"].read())
    data[len(data) // 2] ^= 0x01
    c.put_object(Bucket=bucket, Key=key, Body=bytes(data))  # same size, one bit flipped

    dst = OCILayoutTarget(tmp_path / "pulled", create=True)
    src = open_target(f"s3://{bucket}/m:v1", OPTS)
    with pytest.raises(DigestMismatchError) as err:
        copy(src, dst, "v1", "v1")
    assert layer.digest in str(err.value)
    assert not dst.exists(layer)
    with pytest.raises(NotFoundError):
        dst.resolve("v1")

    # a corrupted manifest is refused by inspect (and every other reader)
    mkey = f"m/blobs/sha256/{result.artifact.digest.hex}"
    raw = c.get_object(Bucket=bucket, Key=mkey)["Body"].read()
    c.put_object(Bucket=bucket, Key=mkey, Body=raw.replace(b'"size":', b'"size" :', 1)[:-1])
    with pytest.raises(DigestMismatchError, match=result.artifact.digest):
        api.inspect(f"s3://{bucket}/m:v1", OPTS)


def test_existing_object_of_wrong_size_is_never_overwritten(s3: S3Server) -> None:
    bucket = s3.make_bucket()
    target = _target(s3, bucket, prefix="")
    payload = b"x" * 1000
    desc = Descriptor("application/octet-stream", Digest.from_bytes(payload), len(payload))
    s3.client().put_object(Bucket=bucket, Key=target.blob_key(desc.digest), Body=b"truncated")
    with pytest.raises(S3Error, match="never overwritten"):
        target.push_blob(bytes_blob_source(desc, payload))
    body = s3.client().get_object(Bucket=bucket, Key=target.blob_key(desc.digest))["Body"].read()
    assert body == b"truncated"


def test_conditional_put_loses_race_without_overwriting(s3: S3Server) -> None:
    """A blob that appears between our HEAD and our PUT is kept (If-None-Match: *)."""
    bucket = s3.make_bucket(versioning=True)
    target = _target(s3, bucket, prefix="")
    payload = os.urandom(3 * PART)
    desc = Descriptor("application/octet-stream", Digest.from_bytes(payload), len(payload))
    c = s3.client()
    key = target.blob_key(desc.digest)

    def racing_opener(offset: int) -> io.BytesIO:
        # another writer completes the same blob while we stream ours
        c.put_object(Bucket=bucket, Key=key, Body=payload)
        return io.BytesIO(payload[offset:])

    target.push_blob(BlobSource(desc, racing_opener))
    versions = [v for v in _versions(s3, bucket) if v[0] == key]
    assert len(versions) == 1
    assert _uploads(s3, bucket) == []


def test_concurrent_tagging_loses_no_tag(s3: S3Server, checkpoint: Path) -> None:
    bucket = s3.make_bucket()
    result = api.pack(str(checkpoint), f"s3://{bucket}/m:base", target_options=OPTS)
    desc = result.artifact.manifest.descriptor()
    errors: list[BaseException] = []

    def tag(i: int) -> None:
        try:
            _target(s3, bucket, prefix="m").tag(desc, f"t{i}")
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=tag, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    tags = set(_target(s3, bucket, prefix="m").list_tags())
    assert tags == {"base"} | {f"t{i}" for i in range(8)}


def test_missing_layout_bucket_and_credentials_are_typed_errors(
    s3: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    bucket = s3.make_bucket()
    with pytest.raises(NotFoundError, match=f"s3://{bucket}/nothing-here is not an OCI layout"):
        api.inspect(f"s3://{bucket}/nothing-here:v1", OPTS)
    with pytest.raises(NotFoundError, match="bucket does not exist"):
        api.inspect("s3://no-such-bucket-here/x:v1", OPTS)
    secret = "testing-secret-key"
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "")
    monkeypatch.delenv("AWS_SESSION_TOKEN")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(S3Error, match="no AWS credentials") as err:
        api.inspect(f"s3://{bucket}/m:v1", OPTS)
    assert secret not in str(err.value)


def test_reference_forms_reach_the_s3_target(s3: S3Server, checkpoint: Path) -> None:
    bucket = s3.make_bucket()
    result = api.pack(str(checkpoint), f"s3://{bucket}/a/b/c:v2", target_options=OPTS)
    pinned = f"s3://{bucket}/a/b/c@{result.artifact.digest}"
    ref = parse_reference(pinned)
    target = open_target(ref, OPTS)
    assert isinstance(target, S3Target) and target.name == f"s3://{bucket}/a/b/c"
    assert api.inspect(pinned, OPTS).digest == str(result.artifact.digest)
    raw, _ = target.fetch_manifest(str(result.artifact.digest))
    assert hashlib.sha256(raw).hexdigest() == result.artifact.digest.hex


def test_without_conditional_writes_push_still_skips_and_verifies(s3: S3Server, checkpoint: Path) -> None:
    """The HEAD-then-write fallback (endpoints without If-None-Match) keeps the same results."""
    bucket = s3.make_bucket(versioning=True)
    target = _target(s3, bucket, conditional_writes="off")
    artifact = build_artifact(str(checkpoint))
    copy(artifact, target, "latest", "v1")
    before = _versions(s3, bucket)
    again = copy(artifact, _target(s3, bucket, conditional_writes="off"), "latest", "v1")
    assert again.blobs_copied == 0
    assert _versions(s3, bucket) == before
    desc = Descriptor("application/octet-stream", Digest.from_bytes(b"abc"), 3)
    with pytest.raises(DigestMismatchError):
        target.push_blob(bytes_blob_source(desc, b"abd"))
    assert not target.exists(desc)
    assert target.resolve("v1").digest == artifact.digest
