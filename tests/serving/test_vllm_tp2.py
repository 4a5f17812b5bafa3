"""vLLM-CPU at TP=2 through the ``modelpack`` load format: each rank's share, reads shared over
vLLM's own TP group, a mixture-of-experts model, and the ``sharded_state`` variant.

Every TP=2 start of the suite lives here, batched into two ``.venv-vllm`` processes (an engine
start is tens of seconds on two cores; a process and its vLLM import per check cost as much):

1. one process, nine engine starts:

   - vLLM's default loader on the node-cache snapshot of a Llama (float32, head_dim 32, 34 MB),
     chunk-signed in the registry: the reference tokens for the Llama checks below; then each TP
     worker writes its rank's ``sharded_state`` files with vLLM's own
     ``ShardedStateLoader.save_model`` (``tests/sharded_state_saver.py`` says why not the
     engine's ``save_sharded_state`` on vllm-cpu); the config and tokenizer files are copied
     next to them, as vLLM's ``save_sharded_state_offline.py`` example does;
   - ``modelpack`` from that snapshot: same output, each rank reads exactly its share;
   - ``modelpack`` streaming it from the registry with vLLM's TP gloo ``cpu_group``: each rank
     fetches its own share plus half of the chunks both need and receives the other half from
     its peer, verified against the signed chunk table;
   - for each of three mixture-of-experts families, a tiny one (4 routed experts, 2 per token):
     Qwen2-MoE (a shared expert and its gate), Qwen3-MoE (q_norm / k_norm, no shared expert) and
     Mixtral (experts ``block_sparse_moe.experts.{i}.w1/w2/w3``): the default loader, then
     ``modelpack`` from its checkpoint directory as an image volume (``trust: runtime``): same
     tokens and logprobs, each rank reads half of every expert (vLLM's ``FusedMoE`` splits experts
     over TP ranks). Not from a node-cache snapshot: on the CPU a hit hands vLLM each tensor as a
     whole view of the mapped blob whatever the rule (``loader/mapped.py``), so a wrong ``dim0`` /
     ``dim1`` rule would still serve the right tokens there; a plain directory is read, and only
     the rank's slices are, so a wrong rule changes the output (seen: Mixtral's ``w2`` as ``dim0``
     serves other tokens). vLLM-CPU 0.32 has no working expert
     parallelism (``--enable-expert-parallel`` at TP=2 dies with SIGSEGV in ``cpu_fused_moe``
     at the first forward pass), so the load format's EP layout is tested without vLLM
     (``test_vllm_experts.py``) and the plan's EP reads with a gloo group in
     ``tests/loader/test_experts_group.py``;

2. the ``sharded_state`` directory written in 1 is packed (a sharded_state variant) and pulled
   into the node cache; one process starts vLLM on the snapshot twice: ``--load-format
   sharded_state`` (vLLM reads the snapshot as it is) and ``--load-format modelpack`` with
   ``layout: sharded_state`` (each rank reads, verified, only its own rank's files). Both must
   give exactly the canonical tokens and logprobs; each rank's ``serving.weights_loaded`` event
   must count only its own files' bytes (≈ 1/TP of the sharded model). A third start, on a
   snapshot of the same blobs whose manifest says ``tp-size: 1``, must be refused when vLLM
   builds its config, before any worker starts. The other refusals (other TP size, other layout,
   a lying rank annotation, swapped rank files) are tested without vLLM in
   ``tests/packing/test_sharded_state.py``.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from modelpack.mediatypes.variants import ANNOTATION_VARIANT_TP_SIZE
from modelpack.mount.cache import NodeCache
from modelpack.signing.chunks import compute_chunk_table, push_chunk_table
from modelpack.signing.keys import generate_key, write_keypair

from modelpack import api
from modelpack.oci.descriptor import Manifest
from modelpack.targets.fetch import fetch_manifest
from modelpack.targets.layout import OCILayoutTarget
from modelpack.targets.opener import TargetOptions, open_target
from tests.fixtures.registry import RegistryServer
from tests.vllm_helpers import (
    PROMPTS,
    EngineRun,
    events_of,
    run_offline,
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
    # two processes of engine starts of ~30 s each on an idle 2-core machine, minutes each when
    # other vLLM runs share it; the subprocess timeouts below bound each process
    pytest.mark.timeout(3600),
]

TP = 2
# small parts, so every rank has several files (vLLM's max_size): 5 per rank for this Llama
PART_BYTES = 4 * 1024 * 1024
# the Llama's chunk-signed table: the ranks share the chunk-verified reads of CHUNK bytes
CHUNK = 64 * 1024
LLAMA = {"hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 2, "num_attention_heads": 16,
        "num_key_value_heads": 4, "vocab_size": 4096}  # fmt: skip


# the mixture-of-experts families served at TP=2, and the architecture each one's config names
MOE_FAMILIES = {
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
}


@dataclass
class MoeModel:
    checkpoint: Path  # its checkpoint directory
    digest: str


@dataclass
class Models:
    base: Path
    events: Path
    llama: Path  # the Llama's checkpoint directory
    llama_digest: str
    llama_snapshot: str  # its node-cache snapshot (pulled from the registry)
    llama_config: Path  # its config and tokenizer only, for the streamed start
    sharded_dir: Path  # where the default start's workers write the sharded_state files
    moe: dict[str, MoeModel]  # by family (MOE_FAMILIES)


def _push(ckpt: Path, registry: RegistryServer, repo: str) -> tuple[str, str]:
    digest = str(api.pack(str(ckpt), registry.ref(repo, "v1")).artifact.digest)
    return digest, f"{registry.host}/{repo}@{digest}"


def _config_only(pinned: str, where: Path) -> Path:
    api.pull(pinned, str(where), exclude=("*.safetensors",), progress="off")
    assert (where / "config.json").exists() and not list(where.glob("*.safetensors"))
    return where


@pytest.fixture(scope="module")
def engines(
    tmp_path_factory: pytest.TempPathFactory, registry: RegistryServer
) -> tuple[Models, dict[str, dict[str, Any]]]:
    """One TP=2 process, nine engine starts: (models, {run name: result})."""
    base = tmp_path_factory.mktemp("vllm-tp2")
    events = base / "events.jsonl"
    cache = NodeCache(str(base / "cache"), events=str(events))

    llama = write_tiny_llama(base / "llama", config=LLAMA)
    llama_digest, llama_pinned = _push(llama, registry, "vllm/tp2-llama")
    target = open_target(llama_pinned, TargetOptions(plain_http=True), for_write=True)
    manifest, _ = fetch_manifest(target, llama_digest)
    key = generate_key()
    push_chunk_table(
        target, manifest.descriptor(), compute_chunk_table(target, manifest, chunk_size=CHUNK), key
    )
    _, public = write_keypair(str(base / "signer"), key)
    llama_snapshot = cache.pull(llama_pinned).path

    moe: dict[str, MoeModel] = {}
    for family in MOE_FAMILIES:
        checkpoint = write_tiny_llama(base / family, family=family)
        digest, _ = _push(checkpoint, registry, f"vllm/tp2-{family.replace('_', '-')}")
        moe[family] = MoeModel(checkpoint, digest)

    models = Models(
        base,
        events,
        llama,
        llama_digest,
        llama_snapshot,
        _config_only(llama_pinned, base / "llama-config"),
        base / "sharded",
        moe,
    )
    models.sharded_dir.mkdir()
    ev = {"events": str(events)}
    runs = [
        EngineRun(
            "default", llama_snapshot, "safetensors", save_sharded=(str(models.sharded_dir), PART_BYTES)
        ),
        EngineRun(
            "modelpack",
            llama_snapshot,
            "modelpack",
            {**ev, "start_id": "tp2", "expected_digest": llama_digest},
        ),
        EngineRun(
            "shared",
            models.llama_config,
            "modelpack",
            {**ev, "start_id": "shared", "source": llama_pinned, "trusted_keys": [public]},
        ),
    ]
    for family, m in moe.items():
        runs += [
            EngineRun(f"{family}-default", m.checkpoint, "safetensors"),
            # the directory read, not mapped: what vLLM gets of each tensor is what the rules read
            EngineRun(
                family,
                m.checkpoint,
                "modelpack",
                {**ev, "start_id": family, "expected_digest": m.digest, "trust": "runtime"},
            ),
        ]
    proc, results = run_offline(runs, tp_size=TP, timeout=2400)
    # a second TP=2 engine in one process once failed to start its workers on a loaded machine,
    # before any loader ran (no event for its start): those starts again, in a fresh process, logged
    loaded = {e.get("start_id") for e in events_of(events) if e["event"] == "serving.start"}
    again = [
        r
        for r in runs
        if r.name not in results
        or ("outputs" not in results[r.name] and (r.extra or {}).get("start_id") not in loaded)
    ]
    if again:
        print(f"{[r.name for r in again]} did not start; again in a fresh process:\n" + tail(proc, 8000))
        proc, retried = run_offline(again, tp_size=TP, timeout=1800)
        results.update(retried)
    assert set(results) == {r.name for r in runs}, tail(proc, 12000)
    for name in ("default", *(f"{family}-default" for family in MOE_FAMILIES)):
        assert "outputs" in results[name], (name, results[name], tail(proc, 12000))
    return models, results


def _same_output(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert "outputs" in got, got
    assert len(got["outputs"]) == len(want["outputs"]) == len(PROMPTS)
    for g, w in zip(got["outputs"], want["outputs"], strict=True):
        assert g["tokens"] == w["tokens"]
        assert g["logprobs"] == w["logprobs"]  # bit-identical floats, not approximately equal


def _loaded(models: Models, start_id: str) -> dict[int, dict[str, Any]]:
    return {
        e["tp_rank"]: e
        for e in events_of(models.events)
        if e.get("start_id") == start_id and e["event"] == "serving.weights_loaded"
    }


# --------------------------------------------------------------------------- each rank's share
def test_tp2_ranks_read_their_share_and_match_the_default_loader(
    engines: tuple[Models, dict[str, dict[str, Any]]],
) -> None:
    models, results = engines
    assert "outputs" in results["modelpack"], results["modelpack"]
    _same_output(results["modelpack"], results["default"])
    outs = results["default"]["outputs"]
    assert outs[0]["tokens"] != outs[1]["tokens"]  # the comparison can fail: prompts differ
    ranks = _loaded(models, "tp2")
    assert sorted(ranks) == [0, 1]
    file_size = (models.llama / "model.safetensors").stat().st_size
    for rank, e in ranks.items():
        model_bytes, replicated = e["model_bytes"], e["replicated_bytes"]
        share = (model_bytes - replicated) // 2 + replicated
        assert e["bytes_to_read"] == share, (rank, e)
        header = file_size - model_bytes
        # what the rank really read: its share, the header, nothing of the other rank's half
        assert share <= e["bytes_read"] <= share + header, (rank, e)
        assert e["bytes_read"] < 0.55 * file_size


# --------------------------------------------------------------------------- shared chunk-verified reads
def test_tp2_ranks_share_chunk_verified_reads_and_match_the_default_loader(
    engines: tuple[Models, dict[str, dict[str, Any]]],
) -> None:
    models, results = engines
    assert "outputs" in results["shared"], results["shared"]
    _same_output(results["shared"], results["default"])
    loaded = _loaded(models, "shared")
    assert sorted(loaded) == [0, 1], json.dumps(loaded)[:2000]
    files = sum(f.stat().st_size for f in models.llama.glob("*.safetensors"))
    tensors = 2 + 2 * 9 + 1  # embed, lm_head, 9 per layer, final norm
    headers = CHUNK
    for rank, e in loaded.items():
        assert e["bytes_received"] > 0, e
        assert e["bytes_read"] <= files / 2 * 1.05 + tensors * CHUNK + headers, (rank, e, files)
    assert sum(e["bytes_read"] for e in loaded.values()) <= files * 1.05 + 2 * headers


# --------------------------------------------------------------------------- mixture of experts
@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_a_tp2_moe_model_serves_the_default_loaders_output_and_each_rank_reads_half_of_every_expert(
    engines: tuple[Models, dict[str, dict[str, Any]]], family: str
) -> None:
    """A Qwen2-MoE (routed experts, a shared expert, the router), a Qwen3-MoE (q_norm/k_norm) and
    a Mixtral (``w1``/``w2``/``w3`` experts) read from their directories at TP=2: bit-identical
    greedy tokens and logprobs to vLLM's default loader, though each rank read only half of every
    expert and of the rest (the router, norms whole) and the rest of each tensor vLLM got is
    unread memory; vLLM's FusedMoE splits each expert over the TP ranks the same way."""
    models, results = engines
    model = models.moe[family]
    outs = results[f"{family}-default"]["outputs"]
    assert outs[0]["tokens"] != outs[1]["tokens"]
    assert "outputs" in results[family], results[family]
    _same_output(results[family], results[f"{family}-default"])
    ranks = _loaded(models, family)
    assert sorted(ranks) == [0, 1]
    file_size = (model.checkpoint / "model.safetensors").stat().st_size
    for rank, e in ranks.items():
        assert MOE_FAMILIES[family] in e["rules"] and "whole" not in e["rules"], e
        assert e["state"] == "image-volume" and e["ep_size"] == 1, e
        share = (e["model_bytes"] - e["replicated_bytes"]) // 2 + e["replicated_bytes"]
        assert e["bytes_to_read"] == share, (rank, e)
        # what the rank really read: its share, the header, nothing of the other rank's halves
        assert share <= e["bytes_read"] <= share + (file_size - e["model_bytes"]), (rank, e)
        assert e["bytes_read"] < 0.55 * file_size, (rank, e, file_size)


# --------------------------------------------------------------------------- sharded_state
@dataclass
class Variants:
    canonical: dict[str, Any]  # vLLM's default loader on the canonical snapshot
    sharded_dir: Path  # what vLLM wrote (plus config/tokenizer)
    digest: str  # the sharded_state artifact
    snapshot: Path  # its node-cache snapshot
    events: Path
    lying_digest: str  # the same blobs, a manifest whose tp-size annotation says 1
    lying_snapshot: Path


@pytest.fixture(scope="module")
def variants(engines: tuple[Models, dict[str, dict[str, Any]]]) -> Variants:
    models, results = engines
    base = models.base
    out = models.sharded_dir
    assert results["default"].get("saved"), results["default"]
    # the non-weight files next to the rank files, as vLLM's save_sharded_state example copies them
    for f in models.llama.iterdir():
        if f.suffix not in (".bin", ".pt", ".safetensors"):
            shutil.copy(f, out / f.name)
    cache = NodeCache(str(base / "sharded-cache"))
    sharded = api.pack(str(out), f"oci:{base / 'layout'}:tp2")
    digest = str(sharded.artifact.digest)
    snapshot = Path(cache.pull(f"oci:{base / 'layout'}@{digest}").path)
    # a pusher's lie: the same blobs under a manifest that says tp-size 1; the cache pulls it as
    # it pulls any manifest (nothing about the layout is checked there), the loader must refuse
    m = sharded.artifact.manifest
    forged = Manifest.build(
        m.config,
        list(m.layers),
        artifact_type=m.artifact_type,
        annotations={**(m.annotations or {}), ANNOTATION_VARIANT_TP_SIZE: "1"},
    )
    layout = OCILayoutTarget(str(base / "layout"))
    lie = str(layout.push_manifest(forged.raw, forged.media_type, "lie").digest)
    lying = Path(cache.pull(f"oci:{base / 'layout'}@{lie}").path)
    return Variants(results["default"], out, digest, snapshot, base / "sharded-events.jsonl", lie, lying)


@pytest.fixture(scope="module")
def served(variants: Variants) -> dict[str, dict[str, Any]]:
    """One TP=2 process, three engine starts: the sharded_state snapshot twice, the lying one last."""
    extra = {
        "expected_digest": variants.digest,
        "layout": "sharded_state",
        "events": str(variants.events),
        "start_id": "sharded-modelpack",
    }
    lying = {**extra, "expected_digest": variants.lying_digest, "start_id": "sharded-lying"}
    runs = [
        EngineRun("native", variants.snapshot, "sharded_state"),
        EngineRun("modelpack", variants.snapshot, "modelpack", extra),
        EngineRun("lying", variants.lying_snapshot, "modelpack", lying),  # last: it must fail
    ]
    proc, results = run_offline(runs, tp_size=TP, timeout=1200)
    if "outputs" not in results.get("modelpack", {}) and not _rank_events(variants):
        # a second TP=2 engine in one process once failed to start its workers on a loaded
        # machine, before any loader ran: one fresh process, logged
        print("second TP=2 engine did not start; retrying in a fresh process:\n" + tail(proc, 8000))
        proc, again = run_offline(runs[1:], tp_size=TP, timeout=1200)
        results.update(again)
    assert set(results) == {"native", "modelpack", "lying"}, tail(proc, 12000)
    return results


def _rank_events(variants: Variants) -> dict[int, dict[str, Any]]:
    return {
        e["tp_rank"]: e
        for e in events_of(variants.events)
        if e.get("start_id") == "sharded-modelpack" and e["event"] == "serving.weights_loaded"
    }


def _close_output(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert "outputs" in got, got
    assert len(got["outputs"]) == len(want["outputs"]) == len(PROMPTS)
    for g, w in zip(got["outputs"], want["outputs"], strict=True):
        assert g["tokens"] == w["tokens"]
        assert g["logprobs"] == pytest.approx(w["logprobs"], abs=1e-4)


def test_vllm_wrote_every_ranks_files_and_they_pack_as_a_variant(variants: Variants) -> None:
    names = sorted(p.name for p in variants.sharded_dir.glob("*.safetensors"))
    for rank in range(TP):
        assert sum(n.startswith(f"model-rank-{rank}-part-") for n in names) >= 2, names
    assert len(names) == sum(n.startswith("model-rank-") for n in names)
    # the canonical output can fail a comparison: the prompts continue differently
    outs = variants.canonical["outputs"]
    assert outs[0]["tokens"] != outs[1]["tokens"]


def test_vllm_loads_the_pulled_snapshot_natively_with_the_canonical_tokens(
    variants: Variants, served: dict[str, dict[str, Any]]
) -> None:
    _close_output(served["native"], variants.canonical)


def test_the_modelpack_format_gives_the_canonical_tokens_and_each_rank_reads_only_its_files(
    variants: Variants, served: dict[str, dict[str, Any]]
) -> None:
    _close_output(served["modelpack"], variants.canonical)
    ranks = _rank_events(variants)
    assert sorted(ranks) == [0, 1]
    sizes = {p.name: p.stat().st_size for p in variants.snapshot.glob("model-rank-*.safetensors")}
    total = sum(sizes.values())
    for rank, e in ranks.items():
        own = {n: s for n, s in sizes.items() if n.startswith(f"model-rank-{rank}-part-")}
        assert e["layout"] == "sharded_state" and e["digest"] == variants.digest
        assert e["files"] == sorted(own)
        # the loader's byte accounting: exactly this rank's files, whole (header included)
        assert e["bytes_read"] == e["bytes_to_read"] + (sum(own.values()) - e["model_bytes"])
        assert e["bytes_read"] == sum(own.values())
        assert 0.45 < e["bytes_read"] / total < 0.55, (rank, e["bytes_read"], total)


def test_a_manifest_lying_about_its_tp_size_never_serves(
    variants: Variants, served: dict[str, dict[str, Any]]
) -> None:
    """The lying manifest's snapshot, started at TP=2 through ``modelpack``: refused when vLLM
    builds its config, before any worker starts (``ShardedStateError``: the annotation says 1, the
    rank files are for 0..1); the start fails instead of serving."""
    res = served["lying"]
    assert "outputs" not in res and res["error"].startswith("ShardedStateError"), res
    assert "says 1, but the rank files are for ranks 0..1" in res["error"]
    evs = [e for e in events_of(variants.events) if e.get("start_id") == "sharded-lying"]
    assert [(e["event"], e["stage"]) for e in evs] == [("serving.refused", "config")], evs
