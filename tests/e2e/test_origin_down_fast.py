"""With the origin down, a pinned start under a policy goes to the peers at once.

Found in the storm work: a pinned pull under a trust policy with the origin down (connection
refused) and a peer holding the model and its signatures waited the whole ``--retry-for`` (60 s,
the default; the vLLM path has no setting for it) on the origin's referrers before asking the
peer. By-digest reads are verified whatever their source, so an unreachable origin must not hold
them up: they fall through to the peers after a short budget. Tags still resolve only at the
origin (a peer never chooses a version).

Real parts: a real origin registry killed for the outage, ``modelpack push --sign-key``, a node
cache that pulled under the key, a real ``modelpack cache serve`` peer, the CLI as a subprocess.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from tests.origin_down_support import run, serve, signed_peer  # noqa: F401 (the fixture)

pytestmark = pytest.mark.timeout(240)


def test_origin_down_a_pinned_pull_under_a_policy_uses_the_peer_well_within_the_retry_budget(
    registry_factory: Any,
    checkpoint: Path,
    tmp_path: Path,
    serve: Any,  # noqa: F811
) -> None:
    origin, model, peer = signed_peer(registry_factory, checkpoint, tmp_path, serve, "down/fast")
    origin.kill()  # connection refused from now on
    policy = tmp_path / "policy.yaml"
    policy.write_text(model.key_policy(f"{model.host}/down/*"))

    started = time.monotonic()
    got = run(
        tmp_path,
        "pull", "--cache", str(tmp_path / "node-b"), "--policy", str(policy), "--mirror", peer.url,
        "--retry-for", "60s", "--json", model.pinned,
        timeout=120,
    )  # fmt: skip
    took = time.monotonic() - started
    assert got.returncode == 0, got.stderr
    assert json.loads(got.stdout)["signature"] == "verified"
    # before: about 60 s (the whole --retry-for on the dead origin's referrers first)
    assert took < 15, took
    for f in checkpoint.glob("*.safetensors"):
        assert (Path(json.loads(got.stdout)["path"]) / f.name).read_bytes() == f.read_bytes()
