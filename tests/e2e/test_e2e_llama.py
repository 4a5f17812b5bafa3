"""End-to-end t9 check: a real transformers Llama, packed, pushed, pulled, loaded, identical logits.

No hub download: the model is built from a ``LlamaConfig`` with a fixed seed. The chain is the
production one — pack → push to a real registry → pull into the node cache → ``load_into`` a
fresh model — and the same again streamed from the registry by range reads (no cache), with a
signed chunk table. The first deterministic check (t9) is recorded and shows up in the timeline.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from modelpack.loader import LoadStats, emit_check, load_into
from modelpack.loader.timeline import timeline
from modelpack.mount.cache import NodeCache
from modelpack.signing.chunks import compute_chunk_table, push_chunk_table
from modelpack.signing.keys import generate_key

from modelpack import api
from modelpack.events import EventLog
from modelpack.targets.fetch import fetch_manifest
from modelpack.targets.opener import open_target

pytestmark = pytest.mark.slow


def _config() -> Any:
    return transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )


def _fresh(seed: int) -> Any:
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(_config()).eval()


INPUT = torch.tensor([[1, 17, 42, 7, 99, 3, 250, 64]])


def _logits(model: Any) -> torch.Tensor:
    with torch.no_grad():
        return model(INPUT).logits


@pytest.fixture(scope="module")
def original(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path, torch.Tensor]:
    model = _fresh(0)
    d = tmp_path_factory.mktemp("llama")
    model.save_pretrained(str(d))
    assert list(d.glob("*.safetensors")), "save_pretrained wrote no safetensors file"
    return model, d, _logits(model)


def _check(model: Any, want: torch.Tensor, log: EventLog, sid: str, digest: str) -> None:
    t = time.time()
    got = _logits(model)
    ok = torch.equal(got, want)
    emit_check(log, start_id=sid, digest=digest, passed=ok, duration_ms=(time.time() - t) * 1000)
    assert ok, (got - want).abs().max()


def test_llama_through_registry_cache_and_streaming(
    original: tuple[Any, Path, torch.Tensor], registry: Any, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    _, ckpt, want = original
    repo = "loader/e2e-" + re.sub(r"[^a-z0-9]+", "-", request.node.name.lower())[:40].strip("-")
    packed = api.pack(str(ckpt), registry.ref(repo, "v1"))
    digest = str(packed.artifact.digest)
    pinned = f"{registry.host}/{repo}@{digest}"
    events = tmp_path / "events.jsonl"
    log = EventLog(str(events))

    # a fresh model with other weights really differs before the load
    assert not torch.equal(_logits(_fresh(1)), want)

    # 1) pull into the node cache (cold), load the snapshot directory it printed
    cache = NodeCache(str(tmp_path / "cache"), events=str(events))
    pulled = cache.pull(pinned, start_id="cold")
    model = _fresh(1)
    stats = load_into(model, pulled.path, expected_digest=digest, events=log, start_id="cold")
    assert stats.digest == digest and stats.tensors == len(model.state_dict())
    _check(model, want, log, "cold", digest)

    # 2) a second start: cache hit, loaded through the (cache, reference) pair
    hit = cache.pull(pinned, start_id="hit")
    assert hit.state == "hit"
    model = _fresh(2)
    load_into(model, (cache, pinned), expected_digest=digest, events=log, start_id="hit")
    _check(model, want, log, "hit", digest)

    # 3) streamed from the registry by range reads, no cache, chunks checked against a signed table
    target = open_target(pinned, for_write=True)
    manifest, _ = fetch_manifest(target, digest)
    key = generate_key()
    push_chunk_table(
        target, manifest.descriptor(), compute_chunk_table(target, manifest, chunk_size=64 * 1024), key
    )
    model = _fresh(3)
    stats = LoadStats()
    load_into(model, pinned, trusted_keys=[key.public], events=log, start_id="streamed", stats=stats)
    assert stats.state == "streamed"
    _check(model, want, log, "streamed", digest)

    # 4) streamed without a table: whole-layer reads, committed after the layer digest matched
    model = _fresh(4)
    load_into(model, pinned, events=log, start_id="streamed-whole")
    _check(model, want, log, "streamed-whole", digest)

    s = timeline([str(events)])
    assert s["states"]["cold"]["starts"] == 1 and s["states"]["hit"]["starts"] == 1
    assert s["states"]["streamed"]["starts"] == 2
    for state in ("cold", "hit", "streamed"):
        assert s["states"][state]["stages"]["t9"]["at"]["count"] == s["states"][state]["starts"]
        assert s["states"][state]["stages"]["t5"]["at"]["count"] == s["states"][state]["starts"]


def test_llama_through_an_oci_layout(original: tuple[Any, Path, torch.Tensor], tmp_path: Path) -> None:
    """The embedded default (no server): layout → fresh model, whole-layer verified."""
    _, ckpt, want = original
    packed = api.pack(str(ckpt), f"oci:{tmp_path / 'layout'}:v1")
    model = _fresh(5)
    load_into(model, f"oci:{tmp_path / 'layout'}:v1", expected_digest=str(packed.artifact.digest))
    assert torch.equal(_logits(model), want)
