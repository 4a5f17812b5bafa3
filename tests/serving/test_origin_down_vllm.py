"""vLLM (CPU) starts with ``--load-format modelpack`` while the origin is down.

One vLLM process, two engine starts (TP=1), the origin registry killed before it starts:

- streamed: ``source`` = the pinned reference, ``MODELPACK_MIRRORS`` = a real ``modelpack cache
  serve`` peer holding the model (the manifest and every weight byte come from the peer,
  verified against their digests);
- offline: ``--model`` = this node's own cache snapshot, with nothing reachable at all.

Both must serve, with the same tokens and logprobs. Before the peers existed the streamed start
failed fetching the manifest from the dead origin.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from modelpack.mount.cache import NodeCache

from modelpack import api
from tests.origin_down_support import serve  # noqa: F401 (the fixture)
from tests.vllm_helpers import EngineRun, run_offline, tail, vllm_available, write_tiny_llama

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not vllm_available(),
        reason=".venv-vllm is absent: build it with .ci/vllm-venv.sh (make test's set-up does)",
    ),
    pytest.mark.timeout(400),
]


def test_vllm_serves_from_a_peer_and_from_the_local_cache_with_the_origin_down(
    registry_factory: Any,
    tmp_path: Path,
    serve: Any,  # noqa: F811
) -> None:
    origin = registry_factory.start()
    ckpt = write_tiny_llama(tmp_path / "checkpoint")
    digest = str(api.pack(str(ckpt), origin.ref("down/tiny-llama", "v1")).artifact.digest)
    pinned = f"{origin.host}/down/tiny-llama@{digest}"
    node = NodeCache(str(tmp_path / "node"))
    snapshot = node.pull(pinned).path
    config_dir = tmp_path / "config"
    api.pull(pinned, str(config_dir), exclude=("*.safetensors",), progress="off")
    peer = serve(tmp_path / "node")
    origin.kill()

    runs = [
        EngineRun("streamed-from-peer", config_dir, "modelpack", {"source": pinned}),
        EngineRun("offline-snapshot", snapshot, "modelpack", {"expected_digest": digest}),
    ]
    proc, results = run_offline(runs, env_extra={"MODELPACK_MIRRORS": peer.url})
    assert set(results) == {"streamed-from-peer", "offline-snapshot"}, tail(proc)
    streamed, offline = results["streamed-from-peer"], results["offline-snapshot"]
    assert "outputs" in streamed, streamed
    assert "outputs" in offline, offline
    assert [o["tokens"] for o in streamed["outputs"]] == [o["tokens"] for o in offline["outputs"]]
    assert [o["logprobs"] for o in streamed["outputs"]] == [o["logprobs"] for o in offline["outputs"]]
    assert streamed["outputs"][0]["tokens"] != streamed["outputs"][1]["tokens"]  # not trivial
