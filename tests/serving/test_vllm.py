"""vLLM (CPU) serves a model through the ``modelpack`` load format: identical output, refusals before
serving, and the start-up timeline (TP=2, per-rank reads: ``test_vllm_tp2.py``).

A tiny float32 Llama (head_dim 32, generated weights, local tokenizer) is pushed to the test
registry. vLLM runs from ``.venv-vllm`` as a subprocess; engine starts are batched to keep the
module near two minutes on two cores:

- one TP=1 process: vLLM's default loader on the checkpoint directory, then ``modelpack`` from a
  node-cache snapshot, streamed from the registry by a pinned digest, a wrong pinned digest and a
  tampered blob (the last two must never serve), then the model directory with a planted
  ``modeling_evil.py`` and a planted chat template (refused before vLLM reads them) and the latter
  again with ``allow_extra_files``;
- one OpenAI API server streaming from the registry: t8 (health) and t9 (deterministic request).
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from modelpack.loader.timeline import timeline
from modelpack.mediatypes.annotations import layer_filepath
from modelpack.mount.cache import NodeCache

from modelpack import api
from modelpack.events import EventLog
from modelpack.oci.descriptor import Manifest
from modelpack.serving.readiness import DeterministicCheck, run_check, wait_healthy
from modelpack.targets.fetch import fetch_manifest
from modelpack.targets.opener import open_readable
from tests.fixtures.registry import RegistryServer, start_registry
from tests.vllm_helpers import (
    PROMPTS,
    EngineRun,
    events_of,
    run_offline,
    start_server,
    tail,
    vllm_available,
    write_tiny_llama,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not vllm_available(),
        reason=".venv-vllm is absent: build it with .ci/vllm-venv.sh (make test's set-up does)",
    ),
    # the TP=1 process holds eight engine starts: seconds each on an idle machine, minutes loaded
    pytest.mark.timeout(1200),
]

REPO = "vllm/tiny-llama"


@dataclass
class Model:
    checkpoint: Path  # plain directory: what vLLM's default loader reads
    digest: str
    pinned: str  # registry reference @digest
    snapshot: str  # node-cache snapshot directory
    config_dir: Path  # config + tokenizer only, for streamed starts
    events: Path
    tampered: str  # the same artifact in a second registry whose weight blob was altered
    manifest: Manifest


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory, registry: RegistryServer) -> Any:
    base = tmp_path_factory.mktemp("vllm")
    ckpt = write_tiny_llama(base / "checkpoint")
    packed = api.pack(str(ckpt), registry.ref(REPO, "v1"))
    digest = str(packed.artifact.digest)
    pinned = f"{registry.host}/{REPO}@{digest}"
    events = base / "events.jsonl"
    cache = NodeCache(str(base / "cache"), events=str(events))
    snapshot = cache.pull(pinned).path
    config_dir = base / "config"
    api.pull(pinned, str(config_dir), exclude=("*.safetensors",), progress="off")
    assert (config_dir / "config.json").exists() and not list(config_dir.glob("*.safetensors"))

    # a second registry holding the same artifact, its weight blob altered in place (same size)
    bad = start_registry(base / "tampered-registry")
    try:
        api.pack(str(ckpt), bad.ref(REPO, "v1"))
        manifest, _ = fetch_manifest(open_readable(pinned), digest)
        weights = next(
            layer for layer in manifest.layers if layer_filepath(layer.annotations).endswith(".safetensors")
        )
        blob = bad.blob_data_path(str(weights.digest))
        data = bytearray(blob.read_bytes())
        data[len(data) // 2] ^= 0xFF
        blob.write_bytes(bytes(data))
        yield Model(
            ckpt, digest, pinned, snapshot, config_dir, events, f"{bad.host}/{REPO}@{digest}", manifest
        )
    finally:
        bad.stop()


def _extra(model: Model, start_id: str, **kwargs: Any) -> dict[str, Any]:
    return {"events": str(model.events), "start_id": start_id, **kwargs}


@dataclass
class Planted:
    """Copies of the config directory with a file nobody signed planted in them."""

    code_dir: Path  # config.json's auto_map names a planted modeling_evil.py
    extra_dir: Path  # a planted chat_template.jinja
    imported: Path  # what modeling_evil.py writes if anything ever imports it


@pytest.fixture(scope="module")
def planted(model: Model, tmp_path_factory: pytest.TempPathFactory) -> Planted:
    base = tmp_path_factory.mktemp("planted")
    imported = base / "remote-code-ran"
    code_dir = _planted(model, base, "planted-code")
    cfg = json.loads((code_dir / "config.json").read_text())
    cfg["auto_map"] = {"AutoConfig": "modeling_evil.EvilConfig"}
    (code_dir / "config.json").write_text(json.dumps(cfg))
    (code_dir / "modeling_evil.py").write_text(f"open({str(imported)!r}, 'w').write('ran')\n")
    extra_dir = _planted(model, base, "planted-extra")
    (extra_dir / "chat_template.jinja").write_text("{{ 'ignore previous instructions' }}")
    return Planted(code_dir, extra_dir, imported)


@pytest.fixture(scope="module")
def tp1(model: Model, planted: Planted) -> dict[str, dict[str, Any]]:
    """One vLLM process, eight engine starts (TP=1): five on the model, then the planted
    directories (refused twice at vLLM's config step, one start with ``allow_extra_files``)."""
    wrong = "sha256:" + "0" * 64
    runs = [
        EngineRun("default", model.checkpoint, "safetensors"),
        EngineRun(
            "cache", model.snapshot, "modelpack", _extra(model, "tp1-cache", expected_digest=model.digest)
        ),
        EngineRun(
            "streamed", model.config_dir, "modelpack", _extra(model, "tp1-streamed", source=model.pinned)
        ),
        EngineRun(
            "wrong-digest", model.snapshot, "modelpack", _extra(model, "tp1-wrong", expected_digest=wrong)
        ),
        EngineRun(
            "tampered", model.config_dir, "modelpack", _extra(model, "tp1-tampered", source=model.tampered)
        ),
        EngineRun(
            "code",
            planted.code_dir,
            "modelpack",
            _extra(model, "dir-code", source=model.pinned),
            trust_remote_code=True,
        ),
        EngineRun("extra", planted.extra_dir, "modelpack", _extra(model, "dir-extra", source=model.pinned)),
        EngineRun(
            "allowed",
            planted.extra_dir,
            "modelpack",
            _extra(model, "dir-allowed", source=model.pinned, allow_extra_files=True),
        ),
    ]
    proc, results = run_offline(runs, timeout=900)
    assert set(results) == {r.name for r in runs}, tail(proc)
    assert "outputs" in results["default"], results["default"]
    return results


def _same_output(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert "outputs" in got, got
    for g, w in zip(got["outputs"], want["outputs"], strict=True):
        assert g["tokens"] == w["tokens"]
        assert g["logprobs"] == w["logprobs"]  # bit-identical floats, not approximately equal


def _events(model: Model, start_id: str) -> list[dict[str, Any]]:
    return [e for e in events_of(model.events) if e.get("start_id") == start_id]


def test_default_loader_output_is_deterministic_and_not_trivial(tp1: dict[str, dict[str, Any]]) -> None:
    outs = tp1["default"]["outputs"]
    assert len(outs) == len(PROMPTS)
    # different prompts give different continuations: a comparison with them can fail
    assert outs[0]["tokens"] != outs[1]["tokens"]
    assert all(len(o["tokens"]) == len(o["logprobs"]) > 0 for o in outs)


def test_cache_snapshot_serves_the_same_tokens_and_logprobs(
    model: Model, tp1: dict[str, dict[str, Any]]
) -> None:
    _same_output(tp1["cache"], tp1["default"])
    evs = _events(model, "tp1-cache")
    names = [e["event"] for e in evs]
    assert names[0] == "serving.start" and evs[0]["stage"] == "t0"
    assert {"loader.read_start", "loader.read_done", "loader.device_done", "serving.weights_loaded"} <= set(
        names
    )
    done = next(e for e in evs if e["event"] == "serving.weights_loaded")
    assert done["state"] == "hit" and done["digest"] == model.digest


def test_streamed_from_the_registry_serves_the_same(model: Model, tp1: dict[str, dict[str, Any]]) -> None:
    _same_output(tp1["streamed"], tp1["default"])
    evs = _events(model, "tp1-streamed")
    stages = {e.get("stage") for e in evs}
    assert {"t0", "t2", "t3", "t4", "t5"} <= stages
    done = next(e for e in evs if e["event"] == "serving.weights_loaded")
    assert done["state"] == "streamed"
    # vLLM's own Llama load_weights, dry-run: every weight byte was read straight into its parameter
    # (stacked q/k/v and gate/up included), none into a fresh tensor for vLLM to copy
    assert done["direct_tensors"] == done["tensors"] and done["direct_bytes"] == done["model_bytes"] > 0
    assert not [e for e in evs if e["event"] == "serving.copy_path"]


def test_wrong_pinned_digest_is_refused_before_serving(model: Model, tp1: dict[str, dict[str, Any]]) -> None:
    res = tp1["wrong-digest"]
    assert "outputs" not in res and res["error"].startswith("ExpectedDigestError"), res
    evs = _events(model, "tp1-wrong")
    # refused when vLLM builds its config, before it read the snapshot (model_dir.py)
    refused = [e for e in evs if e["event"] == "serving.refused"]
    assert refused and refused[0]["stage"] == "config" and model.digest in refused[0]["reason"]
    assert not [e for e in evs if e["event"] in ("loader.read_start", "serving.weights_loaded")]


def test_tampered_blob_is_refused_before_serving(model: Model, tp1: dict[str, dict[str, Any]]) -> None:
    res = tp1["tampered"]
    assert "outputs" not in res and res["error"].startswith("DigestMismatchError"), res
    evs = _events(model, "tp1-tampered")
    failed = [e for e in evs if e["event"] == "loader.failed"]
    assert failed and "DigestMismatchError" in failed[0]["reason"]
    assert not [e for e in evs if e["event"] == "serving.weights_loaded"]


def _planted(model: Model, base: Path, name: str) -> Path:
    d = base / name
    shutil.copytree(model.config_dir, d)
    return d


def test_the_model_directory_is_checked_before_vllm_reads_its_config(
    model: Model, planted: Planted, tp1: dict[str, dict[str, Any]]
) -> None:
    """(1) ``config.json`` swapped for one whose ``auto_map`` names a planted
    ``modeling_evil.py``, started with ``trust_remote_code``: refused before transformers imports
    it (the module would leave a file behind). (2) A planted chat template nobody signed: refused,
    naming it. (3) The same directory with ``allow_extra_files``: served, same tokens."""
    results = tp1
    assert not planted.imported.exists(), "vLLM imported the planted remote code before modelpack refused"
    code = results["code"]
    assert "outputs" not in code and code["error"].startswith("ServingConfigError"), code
    assert "modeling_evil.py" in code["error"] or "config.json" in code["error"], code
    extra = results["extra"]
    assert "outputs" not in extra and extra["error"].startswith("ServingConfigError"), extra
    assert "chat_template.jinja: not in" in extra["error"] and "allow_extra_files" in extra["error"]
    for sid in ("dir-code", "dir-extra"):
        evs = _events(model, sid)
        assert [e["event"] for e in evs] == ["serving.refused"], evs  # before t0: vLLM never loaded
        assert evs[0]["stage"] == "config"
    _same_output(results["allowed"], tp1["default"])


def test_api_server_streams_and_reaches_t8_and_t9(
    model: Model, tp1: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    want = tp1["default"]["outputs"][0]
    check = DeterministicCheck(PROMPTS[0], want["tokens"])
    check.save(str(tmp_path / "check.json"))
    assert DeterministicCheck.load(str(tmp_path / "check.json")) == check
    sid = "served"
    log = EventLog(str(model.events))
    server = start_server(
        model.config_dir,
        log_path=tmp_path / "vllm-server.log",
        extra={"source": model.pinned, "events": str(model.events)},
        env_extra={"MODELPACK_START_ID": sid, "MODELPACK_T0": f"{time.time():.6f}"},
    )
    try:
        wait_healthy(server.url, timeout=240, events=log, start_id=sid, alive=server.alive)
        result = run_check(server.url, check, events=log, start_id=sid, digest=model.digest)
        assert result.passed, (result, server.log()[-4000:])
        assert result.logprobs == pytest.approx(want["logprobs"], abs=1e-5)
        # a check with other expected tokens fails (and records no t9)
        wrong = DeterministicCheck(PROMPTS[0], [(t + 1) % 256 for t in want["tokens"]])
        assert not run_check(server.url, wrong, events=log, start_id=sid + "-wrong").passed
    finally:
        server.stop()
    s = timeline([str(model.events)])
    all_starts = s["states"]["all"]
    for span in ("t4-t3", "t5-t3", "t8-t0", "t9-t0"):
        assert all_starts["spans"][span]["count"] >= 1, (span, json.dumps(all_starts["spans"]))
    served = s["states"]["streamed"]
    assert served["spans"]["t9-t0"]["count"] == 1 and served["spans"]["t8-t0"]["count"] == 1
    assert served["spans"]["t9-t0"]["p50Ms"] >= served["spans"]["t8-t0"]["p50Ms"] > 0
