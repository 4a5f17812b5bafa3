"""vLLM (CPU) started on an index of variants takes the entry for its engine.

Two variants of a tiny Llama with different weights are pushed to a real registry; the index marks
one ``engine=vllm`` and the other ``engine=sglang``. One vLLM process, two engine starts (TP=1):
``source`` = the index pinned by digest, and ``source`` = the vllm entry's own digest. The first
must select that entry (the ``serving.variant_selected`` event names it) and give exactly its
tokens and logprobs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from modelpack import api
from modelpack.api.variants import create_index
from modelpack.events import read_events
from tests.vllm_helpers import EngineRun, run_offline, tail, vllm_available, write_tiny_llama

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not vllm_available(),
        reason=".venv-vllm is absent: build it with .ci/vllm-venv.sh (make test's set-up does)",
    ),
    pytest.mark.timeout(400),
]


def test_vllm_started_on_an_index_streams_the_entry_for_its_engine(registry: Any, tmp_path: Path) -> None:
    repo = "variants/vllm"
    digests = {}
    for name, seed in (("vllm", 0), ("sglang", 1)):
        ckpt = write_tiny_llama(tmp_path / f"ckpt-{name}", seed=seed)
        digests[name] = str(api.pack(str(ckpt), registry.ref(repo, name)).artifact.digest)
    index = create_index(
        registry.ref(repo, "v1"),
        [registry.ref(repo, "vllm"), registry.ref(repo, "sglang")],
        overrides={0: {"engine": "vllm"}, 1: {"engine": "sglang"}},
    ).digest
    config_dir = tmp_path / "config"  # both variants share config and tokenizer files
    api.pull(
        f"{registry.host}/{repo}@{digests['vllm']}",
        str(config_dir),
        exclude=("*.safetensors",),
        progress="off",
    )
    events = tmp_path / "events.jsonl"
    runs = [
        EngineRun("index", config_dir, "modelpack", {"source": f"{registry.host}/{repo}@{index}"}),
        EngineRun("entry", config_dir, "modelpack", {"source": f"{registry.host}/{repo}@{digests['vllm']}"}),
    ]
    proc, results = run_offline(runs, events=events)
    assert set(results) == {"index", "entry"}, tail(proc)
    assert "outputs" in results["index"], results["index"]
    assert "outputs" in results["entry"], results["entry"]
    assert [o["tokens"] for o in results["index"]["outputs"]] == [
        o["tokens"] for o in results["entry"]["outputs"]
    ]
    assert [o["logprobs"] for o in results["index"]["outputs"]] == [
        o["logprobs"] for o in results["entry"]["outputs"]
    ]
    chosen = [e for e in read_events(str(events)) if e["event"] == "serving.variant_selected"]
    assert chosen and {e["chosen"] for e in chosen} == {digests["vllm"]}
    assert chosen[0]["node"]["engine"] == "vllm" and chosen[0]["index"] == index
