"""The loader streaming a model straight from S3 with per-rank range reads (real torch tensors)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from modelpack.loader import LoadStats, load_state_dict
from modelpack.signing.chunks import compute_chunk_table, push_chunk_table
from modelpack.signing.keys import generate_key

from modelpack import api
from modelpack.errors import ChunkDigestMismatch
from modelpack.packing.safetensors_format import parse_header_bytes
from modelpack.targets.fetch import fetch_manifest
from modelpack.targets.opener import TargetOptions, open_readable, open_target
from tests.fixtures.s3 import S3Server
from tests.loader_helpers import expected_shard, reference_tensors

CHUNK = 64 * 1024
OPTS = TargetOptions(extra={"s3_part_size": 64 * 1024})


def test_ranks_stream_their_shards_from_s3(s3: S3Server, checkpoint: Path) -> None:
    bucket = s3.make_bucket()
    res = api.pack(str(checkpoint), f"s3://{bucket}/m:v1", target_options=OPTS)
    digest = str(res.artifact.digest)
    ref = f"s3://{bucket}/m@{digest}"
    target = open_target(ref, OPTS, for_write=True)
    manifest, _ = fetch_manifest(target, digest)
    key = generate_key()
    push_chunk_table(
        target, manifest.descriptor(), compute_chunk_table(target, manifest, chunk_size=CHUNK), key
    )
    full = reference_tensors(checkpoint)
    tp = 2
    for rank in range(tp):
        stats = LoadStats()
        sd = load_state_dict(ref, tp_size=tp, tp_rank=rank, trusted_keys=[key.public], stats=stats)
        assert stats.state == "streamed" and stats.plan is not None
        for t in stats.plan.tensors:
            assert torch.equal(sd[t.name], expected_shard(full[t.name], t.rule, tp, rank)), t.name
        # each rank ranged over its part of the blobs, not whole layers
        assert stats.bytes_read < stats.plan.total_bytes


def test_chunk_corrupted_in_the_bucket_is_refused(s3: S3Server, checkpoint: Path) -> None:
    bucket = s3.make_bucket()
    res = api.pack(str(checkpoint), f"s3://{bucket}/m:v1", target_options=OPTS)
    digest = str(res.artifact.digest)
    ref = f"s3://{bucket}/m@{digest}"
    target = open_readable(ref, OPTS)
    manifest, _ = fetch_manifest(target, digest)
    table = compute_chunk_table(target, manifest, chunk_size=CHUNK)
    layer = next(
        x for x in manifest.layers if "00001" in (x.annotations or {}).get("org.cncf.model.filepath", "")
    )
    c = s3.client()
    key = f"m/blobs/sha256/{layer.digest.hex}"
    data = bytearray(c.get_object(Bucket=bucket, Key=key)["Body"].read())
    n = int.from_bytes(data[:8], "little")
    hdr = parse_header_bytes(key, bytes(data[:8]), bytes(data[8 : 8 + n]), len(data))
    victim = hdr.tensors[len(hdr.tensors) // 2]
    start, end = hdr.absolute(victim)
    data[(start + end) // 2] ^= 0x40
    c.put_object(Bucket=bucket, Key=key, Body=bytes(data))
    with pytest.raises(ChunkDigestMismatch):
        load_state_dict(ref, chunk_table=table)
