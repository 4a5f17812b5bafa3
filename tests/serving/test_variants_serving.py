"""Variants in serving: the KServe initializer and the vLLM load format select
the entry of an index with the same rules as ``pull`` and ``load``.

The initializer runs the way KServe runs it (``tests/kserve_support.py``: uid 1000, read-only
root, KServe's argv pairs), against a real registry, with ``MODELPACK_VARIANT`` naming the entry.
The vLLM hook is ``serving.weights.open_rank_load`` (what the ``modelpack`` load format calls in
each rank), without starting vLLM.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from modelpack.mediatypes.annotations import layer_filepath

from modelpack import api
from modelpack.api.variants import create_index
from modelpack.errors import ServingConfigError, VariantSelectionError
from modelpack.events import read_events
from modelpack.oci.descriptor import Manifest
from modelpack.targets.opener import TargetOptions, open_readable
from modelpack.testdata.synthetic import SyntheticSpec, hf_config, write_checkpoint
from tests.kserve_support import Pod, kserve_env, pod_volumes, run_initializer

PLAIN = TargetOptions(plain_http=True)
SPEC = {"hidden": 64, "intermediate": 128, "vocab": 128, "layers": 1}
pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def index(registry, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:  # type: ignore[no-untyped-def]
    """bf16 and f32 variants in ``variants/serving`` and an index of them (f32: accelerator=cpu)."""
    base = tmp_path_factory.mktemp("variants-serving")
    out = {"host": registry.host, "base": str(base)}
    for dtype in ("BF16", "F32"):
        d = base / dtype.lower()
        write_checkpoint(str(d), SyntheticSpec(dtype=dtype, **SPEC))  # type: ignore[arg-type]
        out[dtype.lower()] = api.push(
            str(d), registry.ref("variants/serving", dtype.lower()), target_options=PLAIN
        ).digest
    made = create_index(
        registry.ref("variants/serving", "v1"),
        [registry.ref("variants/serving", "bf16"), registry.ref("variants/serving", "f32")],
        overrides={1: {"accelerator": "cpu"}},
        target_options=PLAIN,
    )
    out["index"] = made.digest
    return out


def _files(host: str, digest: str) -> dict[str, str]:
    target = open_readable(f"{host}/variants/serving@{digest}", PLAIN)
    m = Manifest.parse(target.fetch_manifest(digest)[0])
    return {layer_filepath(x.annotations) or "": str(x.digest) for x in m.layers}


@pytest.fixture
def pod() -> Iterator[Pod]:
    yield from pod_volumes()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: setpriv to uid 1000 and a mount namespace")
def test_the_kserve_initializer_takes_the_entry_the_environment_names_with_and_without_a_cache(
    index: dict[str, str], pod: Pod
) -> None:
    uri = f"modelpack://{index['host']}/variants/serving:v1"
    for cache, name in ((str(pod.node_cache), "cached"), (None, "direct")):
        env = kserve_env(
            pod, MODELPACK_CACHE=cache, MODELPACK_PLAIN_HTTP="true", MODELPACK_VARIANT="precision=bf16"
        )
        dest = pod.dest(name)
        run = run_initializer(pod, [uri, str(dest)], env)
        assert run.returncode == 0, run.stderr
        got = {n: "sha256:" + hashlib.sha256(b).hexdigest() for n, b in pod.files(dest).items()}
        assert got == _files(index["host"], index["bf16"])
    ready = [e for e in read_events(str(pod.node_cache / "events.jsonl")) if e["event"] == "kserve.ready"]
    assert ready[-1]["digest"] == index["bf16"]
    # the node's own facts (no MODELPACK_VARIANT): this CPU node takes the accelerator=cpu entry
    env = kserve_env(pod, MODELPACK_PLAIN_HTTP="true")
    run = run_initializer(pod, [uri, str(pod.dest("auto"))], env)
    assert run.returncode == 0, run.stderr
    assert {n for n in pod.files(pod.dest("auto"))} == set(_files(index["host"], index["f32"]))
    # nothing fits: one line naming each entry's field, exit 1, nothing in DEST
    env = kserve_env(pod, MODELPACK_PLAIN_HTTP="true", MODELPACK_VARIANT="precision=f16")
    run = run_initializer(pod, [uri, str(pod.dest("none"))], env)
    assert run.returncode == 1
    assert "precision: wanted f16, entry has bf16" in run.stderr and "Traceback" not in run.stderr
    assert not pod.files(pod.dest("none"))


def test_the_kserve_initializer_selects_from_the_environ_it_was_given_not_the_process_one(
    index: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``InitializerSettings.from_environ(env)`` carries the variant selector of ``env``: the
    initializer takes the entry that mapping names even when the process environment names
    another, as it does for every other setting."""
    from modelpack.serving.kserve.initializer import StorageInitializer, parse_pairs
    from modelpack.serving.kserve.settings import InitializerSettings

    monkeypatch.setenv("MODELPACK_VARIANT", "precision=f32")
    settings = InitializerSettings.from_environ(
        {"MODELPACK_PLAIN_HTTP": "true", "MODELPACK_VARIANT": "precision=bf16"}
    )
    dest = tmp_path / "model"
    pairs = parse_pairs([f"modelpack://{index['host']}/variants/serving:v1", str(dest)])
    (result,) = StorageInitializer(settings, say=lambda _: None).run(pairs)
    assert result.digest == index["bf16"]
    got = {p.name: "sha256:" + hashlib.sha256(p.read_bytes()).hexdigest() for p in dest.iterdir()}
    assert got == _files(index["host"], index["bf16"])


def test_the_vllm_load_format_streams_the_entry_for_its_tp_size_and_checks_the_model_dir(
    index: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from modelpack.serving.weights import open_rank_load

    base = Path(index["base"])
    source = f"{index['host']}/variants/serving@{index['index']}"
    extra = {"source": source, "plain_http": True, "events": str(tmp_path / "ev.jsonl")}
    spec = SyntheticSpec(dtype="BF16", **SPEC)  # type: ignore[arg-type]
    monkeypatch.setenv("MODELPACK_VARIANT", "precision=bf16")
    rank = open_rank_load(extra, str(base / "bf16"), hf_config(spec), 1, 0)
    names = [name for name, _ in rank.tensors()]
    assert names and rank.stats.digest == index["bf16"]
    selected = [
        e for e in read_events(str(tmp_path / "ev.jsonl")) if e["event"] == "serving.variant_selected"
    ]
    assert selected[-1]["chosen"] == index["bf16"] and selected[-1]["node"]["engine"] == "vllm"
    # vLLM's --model directory holds the f32 variant's config: refused against the chosen bf16
    with pytest.raises(ServingConfigError, match=r"config\.json"):
        open_rank_load(extra, str(base / "f32"), hf_config(spec), 1, 0)
    # the entry is for another engine/TP size than vLLM runs: refused, never another entry
    monkeypatch.setenv("MODELPACK_VARIANT", "precision=bf16,tp-size=2")
    with pytest.raises(VariantSelectionError, match="tp-size: wanted 2, entry declares none"):
        open_rank_load(extra, str(base / "bf16"), hf_config(spec), 1, 0)


def test_the_vllm_load_format_selects_from_the_environ_it_was_given_not_the_process_one(
    index: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``open_rank_load`` and vLLM's config hook (``check_before_vllm_reads``) take the variant of
    the environ they are given, as every other setting of the start: with bf16 asked there and f32
    in the process environment, both check and stream the bf16 entry."""
    from modelpack.serving.model_dir import check_before_vllm_reads
    from modelpack.serving.weights import open_rank_load

    base = Path(index["base"])
    source = f"{index['host']}/variants/serving@{index['index']}"
    extra = {"source": source, "plain_http": True}
    spec = SyntheticSpec(dtype="BF16", **SPEC)  # type: ignore[arg-type]
    monkeypatch.setenv("MODELPACK_VARIANT", "precision=f32")
    environ = {"MODELPACK_VARIANT": "precision=bf16"}
    assert check_before_vllm_reads(str(base / "bf16"), extra, environ=environ)
    rank = open_rank_load(extra, str(base / "bf16"), hf_config(spec), 1, 0, environ=environ)
    assert [name for name, _ in rank.tensors()] and rank.stats.digest == index["bf16"]
