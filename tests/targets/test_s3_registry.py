"""S3 (authoritative copy) → registry → node: byte-identical, same manifest digest."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from modelpack import api
from modelpack.targets.layout import OCILayoutTarget
from modelpack.targets.opener import TargetOptions, open_target
from modelpack.transfer.copy import copy
from tests.fixtures.s3 import S3Server

OPTS = TargetOptions(extra={"s3_part_size": 64 * 1024})


def test_s3_to_registry_to_layout_is_byte_identical(
    s3: S3Server, registry: Any, checkpoint: Path, tmp_path: Path
) -> None:
    bucket = s3.make_bucket()
    pushed = api.pack(str(checkpoint), f"s3://{bucket}/models/llama:v1", target_options=OPTS)
    digest = pushed.artifact.digest

    src = open_target(f"s3://{bucket}/models/llama:v1", OPTS)
    reg_ref = registry.ref("s3-test/llama", "v1")
    dst = open_target(reg_ref, TargetOptions(plain_http=True), for_write=True)
    result = copy(src, dst, "v1", "v1")
    assert result.descriptor.digest == digest
    assert result.blobs_copied == len(pushed.artifact.manifest.layers) + 1
    assert api.inspect(reg_ref, TargetOptions(plain_http=True)).digest == str(digest)

    # the node side: registry → local layout, then compare every file's bytes
    node = OCILayoutTarget(tmp_path / "node", create=True)
    pulled = copy(open_target(reg_ref, TargetOptions(plain_http=True)), node, "v1", "v1")
    assert pulled.descriptor.digest == digest
    raw, _ = node.fetch_manifest("v1")
    assert raw == pushed.artifact.manifest.raw
    for f in pushed.artifact.files:
        assert Path(node.blob_path(f.digest)).read_bytes() == (checkpoint / f.relpath).read_bytes()

    # a second cp moves no blob
    again = copy(src, dst, "v1", "v1")
    assert again.blobs_copied == 0 and again.blobs_skipped == result.blobs_total


def test_registry_to_s3_keeps_the_manifest_bytes(s3: S3Server, registry: Any, checkpoint: Path) -> None:
    reg_ref = registry.ref("s3-test/back", "v1")
    pushed = api.pack(str(checkpoint), reg_ref, target_options=TargetOptions(plain_http=True))
    bucket = s3.make_bucket()
    dst = open_target(f"s3://{bucket}/mirror:v1", OPTS, for_write=True)
    copy(open_target(reg_ref, TargetOptions(plain_http=True)), dst, "v1", "v1")
    raw, _ = dst.fetch_manifest("v1")
    assert raw == pushed.artifact.manifest.raw
