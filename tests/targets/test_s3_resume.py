"""Interrupted multipart uploads: invisible while incomplete, resumed (re-verified) or aborted on rerun."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from modelpack.errors import DigestMismatchError
from modelpack.oci.descriptor import Descriptor
from modelpack.oci.digest import Digest
from modelpack.targets.base import bytes_blob_source
from modelpack.targets.s3 import S3Settings, S3Target
from tests.fixtures.s3 import S3Server
from tests.paths import REPO_ROOT

PART = 64 * 1024

CHILD = textwrap.dedent(
    """
    import sys, time
    from modelpack.oci.descriptor import Descriptor
    from modelpack.oci.digest import Digest
    from modelpack.targets.s3 import S3Settings, S3Target
    from modelpack.targets.base import BlobSource

    endpoint, bucket, path, digest, size = sys.argv[1:6]

    class Slow:
        # a source that trickles (the parent kills us mid-upload)
        def __init__(self):
            self.f = open(path, "rb")
        def read(self, n=-1):
            time.sleep(0.4)
            return self.f.read(n)
        def close(self):
            self.f.close()
        def __enter__(self):
            return self
        def __exit__(self, *a):
            self.close()

    t = S3Target(bucket, "m", endpoint=endpoint, settings=S3Settings(part_size=int(sys.argv[6]), concurrency=1))
    t.push_blob(BlobSource(Descriptor("application/octet-stream", Digest(digest), int(size)), lambda off: Slow()))
    print("completed")
    """
)


def _target(s3: S3Server, bucket: str) -> S3Target:
    return S3Target(bucket, "m", endpoint=s3.endpoint, settings=S3Settings(part_size=PART, concurrency=2))


def _uploads(s3: S3Server, bucket: str) -> list[dict[str, object]]:
    return list(s3.client().list_multipart_uploads(Bucket=bucket).get("Uploads", []))


def _blob(n_parts: float, seed: int = 0) -> tuple[bytes, Descriptor]:
    data = os.urandom(int(n_parts * PART))
    return data, Descriptor("application/octet-stream", Digest.from_bytes(data), len(data))


def test_killed_upload_is_invisible_and_resumed_on_rerun(s3: S3Server, tmp_path: Path) -> None:
    bucket = s3.make_bucket()
    data, desc = _blob(12.5)
    src = tmp_path / "blob"
    src.write_bytes(data)
    c = s3.client()
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, s3.endpoint, bucket, str(src), desc.digest, str(desc.size), str(PART)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 60
        stored = 0
        while time.monotonic() < deadline and stored < 4:
            ups = _uploads(s3, bucket)
            if ups:
                parts = c.list_parts(Bucket=bucket, Key=ups[0]["Key"], UploadId=ups[0]["UploadId"])
                stored = len(parts.get("Parts", []))
            time.sleep(0.05)
        assert stored >= 4, "the child never stored parts"
    finally:
        child.send_signal(signal.SIGKILL)
        out, err = child.communicate(timeout=30)
    assert b"completed" not in out, err.decode()

    target = _target(s3, bucket)
    key = target.blob_key(desc.digest)
    # interrupted: no object under the blob key, the upload is pending
    assert not target.exists(desc)
    listed = [o["Key"] for o in c.list_objects_v2(Bucket=bucket).get("Contents", [])]
    assert key not in listed
    assert [u["Key"] for u in _uploads(s3, bucket)] == [key]

    target.push_blob(bytes_blob_source(desc, data))
    assert target.stats["uploads_resumed"] == 1
    assert target.stats["parts_reused"] >= 4
    assert target.stats["parts_reused"] + target.stats["parts_uploaded"] == 13
    assert _uploads(s3, bucket) == []
    assert c.get_object(Bucket=bucket, Key=key)["Body"].read() == data


def test_resume_resends_stored_parts_that_do_not_match_the_source(s3: S3Server) -> None:
    bucket = s3.make_bucket()
    data, desc = _blob(4)
    target = _target(s3, bucket)
    key = target.blob_key(desc.digest)
    c = s3.client()
    up = c.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    c.upload_part(Bucket=bucket, Key=key, UploadId=up, PartNumber=1, Body=data[:PART])
    wrong = bytes(b ^ 0x55 for b in data[PART : 2 * PART])
    c.upload_part(Bucket=bucket, Key=key, UploadId=up, PartNumber=2, Body=wrong)

    target.push_blob(bytes_blob_source(desc, data))
    assert target.stats["uploads_resumed"] == 1
    assert target.stats["parts_reused"] == 1  # part 2 was re-sent, not trusted
    assert target.stats["parts_uploaded"] == 3
    assert c.get_object(Bucket=bucket, Key=key)["Body"].read() == data
    assert _uploads(s3, bucket) == []


def test_unusable_and_duplicate_uploads_are_aborted(s3: S3Server) -> None:
    bucket = s3.make_bucket()
    data, desc = _blob(4)
    target = _target(s3, bucket)
    key = target.blob_key(desc.digest)
    c = s3.client()
    # an upload whose stored parts cannot be a layout of this blob (a short non-final part)
    bad = c.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    c.upload_part(Bucket=bucket, Key=key, UploadId=bad, PartNumber=1, Body=data[:PART])
    c.upload_part(Bucket=bucket, Key=key, UploadId=bad, PartNumber=2, Body=data[PART : PART + 100])
    c.upload_part(Bucket=bucket, Key=key, UploadId=bad, PartNumber=3, Body=data[:PART])
    time.sleep(1.1)  # Initiated has one-second resolution: make the next one the newest
    good = c.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    c.upload_part(Bucket=bucket, Key=key, UploadId=good, PartNumber=1, Body=data[:PART])

    target.push_blob(bytes_blob_source(desc, data))
    assert target.stats["uploads_resumed"] == 1 and target.stats["parts_reused"] == 1
    assert target.stats["uploads_aborted"] == 1
    assert _uploads(s3, bucket) == []
    assert c.get_object(Bucket=bucket, Key=key)["Body"].read() == data


def test_pending_upload_with_wrong_source_is_aborted(s3: S3Server) -> None:
    bucket = s3.make_bucket()
    data, desc = _blob(3)
    target = _target(s3, bucket)
    key = target.blob_key(desc.digest)
    c = s3.client()
    up = c.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    c.upload_part(Bucket=bucket, Key=key, UploadId=up, PartNumber=1, Body=data[:PART])
    tampered = data[: 2 * PART] + bytes(PART)
    with pytest.raises(DigestMismatchError, match=desc.digest):
        target.push_blob(bytes_blob_source(desc, tampered))
    assert _uploads(s3, bucket) == []
    assert not target.exists(desc)
