"""The `modelpack` load format's streamed ``source`` through a node cache (``cache`` in the extra
config): the first start fills the cache from the one registry read, the next one is a hit.

vLLM itself is not needed: ``open_rank_load`` is what the load format runs for each rank, and the
counting proxy in front of a real registry says what crossed the wire.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from modelpack.mount import NodeCache
from safetensors.torch import load_file

from modelpack.errors import ServingConfigError
from modelpack.serving.settings import ServingSettings
from modelpack.serving.weights import open_rank_load
from modelpack.testdata.synthetic import SyntheticSpec, write_checkpoint
from tests.fixtures.faultproxy import FaultProxy
from tests.mount.test_cache_support import push_model

pytestmark = pytest.mark.timeout(180)


def test_a_streamed_source_with_a_cache_fills_it_and_the_next_start_is_a_hit(
    registry, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    ckpt = tmp_path / "ckpt"
    write_checkpoint(str(ckpt), SyntheticSpec(hidden=64, intermediate=128, heads=2, kv_heads=2, vocab=128))
    digest = push_model(ckpt, registry.host, "serve/stream")
    proxy = FaultProxy(registry.host)
    try:
        cache_dir = tmp_path / "cache"
        extra = {"source": f"{proxy.host}/serve/stream@{digest}", "plain_http": True, "cache": str(cache_dir)}
        rank = open_rank_load(extra, str(ckpt), {}, 1, 0, environ={})
        got = dict(rank.tensors())
        expected = load_file(str(next(ckpt.glob("*.safetensors"))))
        assert all(torch.equal(got[k], expected[k]) for k in expected)
        # the engine's start does not wait for the cache's commit: published in the background
        assert rank.summary()["cache"]["state"] in ("publishing", "filled")
        rank.source.wait(timeout=60)
        first = rank.summary()["cache"]
        assert first["state"] == "filled" and first["published"]
        assert NodeCache(str(cache_dir)).snapshots.ready(digest) is not None
        assert proxy.blob_gets and all(n == 1 for n in proxy.blob_gets.values())

        proxy.clear()
        again = open_rank_load(extra, str(ckpt), {}, 1, 0, environ={})
        assert len(dict(again.tensors())) == len(got)
        assert again.summary()["cache"]["state"] == "hit"
        assert proxy.total_blob_bytes() == 0
    finally:
        proxy.close()


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ({"expected_digest": "sha256:" + "ab" * 32, "cache": "/c"}, "without source"),
        ({"source": "r.example/m@sha256:" + "ab" * 32, "cache": "/c", "cache_fill": "later"}, "cache_fill"),
    ],
)
def test_cache_settings_that_cannot_work_are_refused(extra: dict[str, str], needle: str) -> None:
    with pytest.raises(ServingConfigError, match=needle):
        ServingSettings.from_extra_config(extra, {})
