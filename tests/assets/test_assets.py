"""Runtime assets: real Inductor compile caches shipped as signed, fingerprinted referrers.

One cold ``torch.compile`` (Inductor's CPU backend, the machine's C++ compiler) fills a cache in
a fresh process; ``modelpack assets push`` publishes it as a referrer of a model in a private
registry (distribution 2.8, so the referrers come from the tag-schema fallback); fresh processes
with an empty ``TORCHINDUCTOR_CACHE_DIR`` pull it and compile again from Inductor's own cache.
Then every way to get it wrong: each fingerprint field changed in turn, an empty field, a
tampered blob, a missing or untrusted signature, a foreign destination — each refused with an
event and nothing materialised.
"""

from __future__ import annotations

import dataclasses
import json
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from modelpack.assets import (
    EnvironmentFingerprint,
    get_kind,
    list_assets,
    pull_asset,
    push_asset,
    running_fingerprint,
)
from modelpack.assets.archive import pack_cache
from modelpack.assets.format import ARTIFACT_TYPE_RUNTIME_ASSET
from modelpack.assets.kinds import MARKER_FILE
from modelpack.errors import AssetError, AssetFingerprintError, AssetRefused
from modelpack.events import EventLog, read_events
from modelpack.files import TEMP_PREFIX
from modelpack.oci.descriptor import Descriptor
from modelpack.oci.reference import parse_reference
from modelpack.targets.opener import open_readable
from modelpack.testdata.synthetic import SyntheticSpec, write_checkpoint
from tests.fixtures.registry import RegistryServer, _stop_all, start_registry
from tests.signing_helpers import referrers_index_clobbered

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

# The compile both the cold and the warm processes run; with "fetch" it first asks the engine hook
# (fetch_before_compile) for a matching asset and times the compile as t6 (compile_stage).
COMPILE = r"""
import contextlib, json, os, sys, time
args = json.loads(sys.argv[1])
state, events = "none", None
if args.get("fetch"):
    from modelpack.assets import compile_stage, fetch_before_compile
    from modelpack.events import EventLog
    from modelpack.signing.keys import load_public_key
    events = EventLog(args["events"])
    policy = [load_public_key(args["key"])] if args.get("key") else None
    res = fetch_before_compile(args["fetch"], os.environ["TORCHINDUCTOR_CACHE_DIR"], "inductor",
                               policy=policy, events=events, start_id=args["start_id"])
    state = res.state
import torch
from torch._dynamo.utils import counters
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
compiled = torch.compile(model)
x = torch.randn(4, 32)
stage = (compile_stage(events, asset_state=state, start_id=args["start_id"]) if events
         else contextlib.nullcontext({}))
with torch.no_grad(), stage:
    t = time.perf_counter()
    y = compiled(x)
    seconds = time.perf_counter() - t
print(json.dumps({"seconds": seconds, "state": state, "inductor": dict(counters["inductor"]),
                  "checksum": float(y.double().sum())}))
"""


def compile_in_fresh_process(cache_dir: Path, **args: Any) -> dict[str, Any]:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir), "TORCHINDUCTOR_FX_GRAPH_CACHE": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", COMPILE, json.dumps(args)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return doc


def cli(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [sys.executable, "-m", "modelpack.cli", "assets", *argv], capture_output=True, text=True, timeout=300
    )
    if check:
        assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


@dataclass
class World:
    registry: RegistryServer
    ref: str  # the model, pinned
    model: Descriptor
    cold: dict[str, Any]
    cold_dir: Path
    private_key: str
    public_key: str
    tmp: Path
    events: Path


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    from modelpack.signing.keys import generate_key, write_keypair

    from modelpack import api

    tmp = tmp_path_factory.mktemp("assets")
    server = start_registry(tmp / "registry")  # private: the tamper test damages its storage
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("MODELPACK_UPLOAD_STATE_DIR", str(tmp / "upload-state"))
            write_checkpoint(str(tmp / "ckpt"), SyntheticSpec(shards=2))
            tagged = server.ref("assets/tiny", "v1")
            digest = str(api.push(str(tmp / "ckpt"), tagged).digest)
            ref = f"{server.host}/assets/tiny@{digest}"
            model = open_readable(parse_reference(ref)).resolve(digest)
            priv, pub = write_keypair(str(tmp / "ci"), generate_key())
            events = tmp / "events.jsonl"
            # the cold start: the hook finds no asset (state none), Inductor compiles from scratch
            cold_dir = tmp / "cold-cache"
            cold = compile_in_fresh_process(
                cold_dir, fetch=ref, events=str(events), start_id="cold-1", key=pub
            )
            yield World(server, ref, model, cold, cold_dir, priv, pub, tmp, events)
    finally:
        _stop_all([server])


@pytest.fixture(scope="module")
def pushed(world: World) -> dict[str, Any]:
    """``modelpack assets push`` of the cold cache, signed with the CI key (a fresh process)."""
    proc = cli(
        "push",
        world.ref,
        str(world.cold_dir),
        "--kind",
        "inductor",
        "--sign-key",
        world.private_key,
        "--json",
    )
    doc: dict[str, Any] = json.loads(proc.stdout)
    return doc


def _leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if p.name.startswith(TEMP_PREFIX)] if parent.exists() else []


def _events(path: Path, name: str) -> list[dict[str, Any]]:
    return [e for e in read_events(str(path)) if e["event"] == name] if path.exists() else []


# --------------------------------------------------------------------------- the happy path


def test_cold_compile_missed_and_the_push_is_a_referrer_of_the_model(
    world: World, pushed: dict[str, Any]
) -> None:
    assert world.cold["state"] == "none"
    assert world.cold["inductor"].get("fxgraph_cache_miss", 0) >= 1
    assert world.cold["inductor"].get("fxgraph_cache_hit", 0) == 0
    assert pushed["digest"] == str(world.model.digest) and pushed["kind"] == "inductor"
    assert pushed["signature"] and pushed["files"] > 0
    # distribution 2.8 has no referrers API: the asset is listed in the sha256-<hex> fallback index
    target = open_readable(parse_reference(world.ref))
    referrers = target.referrers(world.model, ARTIFACT_TYPE_RUNTIME_ASSET)
    assert [str(d.digest) for d in referrers] == [pushed["asset"]]
    fallback = target.resolve("sha256-" + world.model.digest.hex)
    assert fallback.media_type == "application/vnd.oci.image.index.v1+json"
    (stored,) = list_assets(target, world.model, "inductor")
    assert stored.record is not None and stored.record.fingerprint.digest == pushed["fingerprintDigest"]
    # lock files and temp files stay behind
    assert not any(rel.startswith("locks/") for rel, _, _ in _members(target, stored.layer))


def _members(target: Any, layer: Descriptor) -> list[tuple[str, int, str]]:
    import tarfile

    with target.fetch_blob(layer) as f, tarfile.open(fileobj=f, mode="r|gz") as tar:
        return [(m.name, m.size, "") for m in tar]


def test_fresh_process_pulls_with_the_cli_and_inductor_hits_its_cache(
    world: World, pushed: dict[str, Any], tmp_path: Path
) -> None:
    dest = tmp_path / "inductor"
    proc = cli("pull", world.ref, str(dest), "--kind", "inductor", "--key", world.public_key, "--json")
    doc = json.loads(proc.stdout)
    assert doc["state"] == "hit" and doc["asset"] == pushed["asset"] and doc["signature"] == "verified"
    assert doc["environment"] == {"TORCHINDUCTOR_CACHE_DIR": str(dest)}
    assert json.loads((dest / MARKER_FILE).read_text())["asset"] == pushed["asset"]

    warm = compile_in_fresh_process(dest)
    assert warm["inductor"].get("fxgraph_cache_hit", 0) >= 1, warm
    assert warm["inductor"].get("fxgraph_cache_miss", 0) == 0, warm
    assert warm["checksum"] == world.cold["checksum"]
    assert warm["seconds"] < world.cold["seconds"] / 2, (warm["seconds"], world.cold["seconds"])


def test_the_engine_hook_fetches_before_compiling_and_t6_records_the_asset_state(
    world: World, pushed: dict[str, Any], tmp_path: Path
) -> None:
    from modelpack.loader.timeline import timeline

    warm = compile_in_fresh_process(
        tmp_path / "empty-cache",
        fetch=world.ref,
        events=str(world.events),
        start_id="warm-1",
        key=world.public_key,
    )
    assert warm["state"] == "hit" and warm["inductor"].get("fxgraph_cache_hit", 0) >= 1, warm
    t6 = {e["start_id"]: e for e in _events(world.events, "assets.compile_done")}
    assert t6["cold-1"]["stage"] == "t6" and t6["cold-1"]["asset_state"] == "none"
    assert t6["warm-1"]["asset_state"] == "hit" and t6["warm-1"]["inductor"]["fxgraph_cache_hit"] >= 1
    assert t6["warm-1"]["duration_ms"] < t6["cold-1"]["duration_ms"] / 2
    summary = timeline([str(world.events)])
    assert summary["assets"]["hit"]["starts"] == 1 and summary["assets"]["none"]["starts"] == 1
    assert summary["assets"]["hit"]["t6"]["at"]["count"] == 1


# --------------------------------------------------------------------------- refusals


def _changed(value: Any) -> Any:
    return value + 1 if isinstance(value, int) else f"{value}-other"


def test_each_fingerprint_field_changed_in_turn_is_refused_and_nothing_is_materialised(
    world: World, pushed: dict[str, Any], tmp_path: Path
) -> None:
    target = open_readable(parse_reference(world.ref))
    running = running_fingerprint(target, world.model)
    assert running.digest == pushed["fingerprintDigest"]  # this machine built it
    log = tmp_path / "events.jsonl"
    names = [f.name for f in dataclasses.fields(EnvironmentFingerprint)]
    for name in names:
        fp = running.replace(**{name: _changed(getattr(running, name))})
        dest = tmp_path / f"dest-{name}"
        res = pull_asset(
            world.ref, dest, "inductor", fingerprint=fp, events=EventLog(str(log)), policy=[_pub(world)]
        )
        assert (res.state, res.fields, res.asset) == ("refused", [name], pushed["asset"]), (name, res.reason)
        assert name in res.reason
        assert not dest.exists() and not _leftovers(tmp_path)
    refused = _events(log, "assets.refused")
    assert [e["fields"] for e in refused] == [[n] for n in names]
    assert all(e["asset_state"] == "refused" and e["asset"] == pushed["asset"] for e in refused)
    # fail closed: an empty field is a mismatch, never a wildcard
    res = pull_asset(
        world.ref,
        tmp_path / "empty",
        "inductor",
        fingerprint=running.replace(device_arch=""),
        policy=[_pub(world)],
    )
    assert res.state == "refused" and res.fields == ["device_arch"] and "empty" in res.reason
    # and the unchanged fingerprint is a hit
    same = pull_asset(world.ref, tmp_path / "same", "inductor", fingerprint=running, policy=[_pub(world)])
    assert same.state == "hit"


def test_fingerprint_file_from_elsewhere_and_require_hit_through_the_cli(
    world: World, pushed: dict[str, Any], tmp_path: Path
) -> None:
    fp_file = tmp_path / "fp.json"
    cli("fingerprint", world.ref, "--out", str(fp_file))
    fp = EnvironmentFingerprint.read(fp_file)
    assert fp.digest == pushed["fingerprintDigest"]
    # an init container: pulls with the file, and never imports torch
    code = (
        "import json, sys\nfrom modelpack.cli import main\n"
        "try:\n    main(sys.argv[1:], prog_name='modelpack')\nexcept SystemExit as exc:\n    rc = exc.code or 0\n"
        "print(json.dumps({'rc': rc, 'torch': any(m.split('.')[0] == 'torch' for m in sys.modules)}))\n"
    )
    dest = tmp_path / "from-file"
    args = ["assets", "pull", world.ref, str(dest), "--kind", "inductor", "--fingerprint", str(fp_file),
            "--key", world.public_key]  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"rc": 0, "torch": False}
    assert (dest / MARKER_FILE).exists()

    gpu = fp.replace(device_kind="cuda", device_arch="sm_90", driver_version="550.54.15", cuda_version="12.4")
    gpu.write(tmp_path / "gpu.json")
    miss = cli(
        "pull",
        world.ref,
        str(tmp_path / "gpu"),
        "--kind",
        "inductor",
        "--fingerprint",
        str(tmp_path / "gpu.json"),
        "--key",
        world.public_key,
        "--json",
    )
    doc = json.loads(miss.stdout)
    assert doc["state"] == "refused"
    assert doc["fields"] == ["device_kind", "device_arch", "driver_version", "cuda_version"]
    strict = cli(
        "pull", world.ref, str(tmp_path / "gpu"), "--kind", "inductor", "--fingerprint", str(tmp_path / "gpu.json"),
        "--key", world.public_key, "--require-hit", check=False,
    )  # fmt: skip
    assert strict.returncode == 1 and "device_arch" in strict.stderr
    assert not (tmp_path / "gpu").exists()


def test_a_tampered_asset_blob_is_refused_with_events_and_nothing_materialised(
    world: World, pushed: dict[str, Any], tmp_path: Path
) -> None:
    from modelpack.mount import NodeCache

    target = open_readable(parse_reference(world.ref))
    (stored,) = [a for a in list_assets(target, world.model, "inductor") if a.digest == pushed["asset"]]
    data = world.registry.blob_data_path(str(stored.layer.digest))
    original = data.read_bytes()
    tampered = bytearray(original)
    tampered[len(tampered) // 2] ^= 0xFF
    data.write_bytes(bytes(tampered))  # same size: only the digest can tell
    try:
        log = tmp_path / "events.jsonl"
        dest = tmp_path / "dest"
        res = pull_asset(world.ref, dest, "inductor", events=EventLog(str(log)), policy=[_pub(world)])
        assert res.state == "refused" and res.reason.startswith("content:"), res.reason
        assert str(stored.layer.digest) in res.reason
        assert not dest.exists() and not _leftovers(tmp_path)
        (candidate,) = _events(log, "assets.candidate_refused")
        assert candidate["asset"] == pushed["asset"] and "content" in candidate["reason"]
        assert _events(log, "assets.refused")[0]["asset_state"] == "refused"
        # through the node cache: refused there too, and no snapshot is published
        cache = NodeCache(str(tmp_path / "cache"))
        res = pull_asset(world.ref, dest, "inductor", cache=cache, policy=[_pub(world)])
        assert res.state == "refused" and not dest.exists() and cache.ls() == []
        with pytest.raises(AssetRefused):
            pull_asset(world.ref, dest, "inductor", require_hit=True, policy=[_pub(world)])
    finally:
        data.write_bytes(original)
    assert pull_asset(world.ref, dest, "inductor", policy=[_pub(world)]).state == "hit"


def test_signatures_are_checked_under_the_models_policy(
    world: World, pushed: dict[str, Any], tmp_path: Path
) -> None:
    from modelpack.signing.keys import generate_key, load_public_key, write_keypair
    from modelpack.signing.policy import TrustPolicy

    from modelpack import api

    # a second model whose only asset is unsigned
    write_checkpoint(str(tmp_path / "ckpt"), SyntheticSpec(shards=1, seed=7))
    digest = str(api.push(str(tmp_path / "ckpt"), world.registry.ref("assets/unsigned", "v1")).digest)
    ref = f"{world.registry.host}/assets/unsigned@{digest}"
    unsigned = push_asset(ref, world.cold_dir, "inductor")
    assert unsigned.signature is None
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text(
        "version: 1\nrules:\n"
        f"  - match: ['{world.registry.host}/assets/*']\n"
        f"    keys: [{{path: {world.public_key}}}]\n"
        "    require_signature: true\n"
        "    require_directory_signature: true\n"  # a weights rule: never demanded of a cache
    )
    policy = TrustPolicy.load(policy_file)
    log = tmp_path / "events.jsonl"
    res = pull_asset(ref, tmp_path / "u", "inductor", policy=policy, events=EventLog(str(log)))
    assert res.state == "refused" and res.reason.startswith("signature:") and "unsigned" in res.reason
    assert res.signature == "refused" and not (tmp_path / "u").exists()
    assert _events(log, "signing.refused") and _events(log, "assets.candidate_refused")
    # signed, but by a key the policy does not trust
    _, other_pub = write_keypair(str(tmp_path / "other"), generate_key())
    res = pull_asset(world.ref, tmp_path / "o", "inductor", policy=[load_public_key(other_pub)])
    assert res.state == "refused" and "not by a trusted key" in res.reason and not (tmp_path / "o").exists()
    # the CI key: verified, even under a rule that requires a directory signature of the weights
    res = pull_asset(world.ref, tmp_path / "ok", "inductor", policy=policy)
    assert res.state == "hit" and res.signature == "verified"


def test_a_destination_modelpack_did_not_write_is_never_replaced(world: World, tmp_path: Path) -> None:
    dest = tmp_path / "busy"
    dest.mkdir()
    (dest / "mine.txt").write_text("user data")
    with pytest.raises(AssetError, match="not empty"):
        pull_asset(world.ref, dest, "inductor", policy=[_pub(world)])
    assert (dest / "mine.txt").read_text() == "user data"


# --------------------------------------------------------------------------- node cache


def test_node_cache_keeps_assets_next_to_snapshots_with_the_same_gc_and_leases(
    world: World, pushed: dict[str, Any], tmp_path: Path
) -> None:
    from modelpack.mount import NodeCache

    cache = NodeCache(str(tmp_path / "cache"))
    cache.pull(world.ref)  # the model itself
    first = pull_asset(world.ref, tmp_path / "view-1", "inductor", cache=cache, policy=[_pub(world)])
    assert first.state == "hit" and first.signature == "verified"
    snapshot = Path(cache.snapshot_path(pushed["asset"]))
    assert snapshot.parent == Path(cache.snapshot_path(world.ref)).parent  # next to the model's
    a_file = next(p for p in snapshot.rglob("*") if p.is_file())
    rel = a_file.relative_to(snapshot)
    # a view: a copy, never a hard link into the shared snapshot (tests/assets/test_assets_trust.py)
    assert (tmp_path / "view-1" / rel).read_bytes() == a_file.read_bytes()
    assert not os.path.samefile(a_file, tmp_path / "view-1" / rel)
    mark = world.registry.log_mark()
    second = pull_asset(world.ref, tmp_path / "view-2", "inductor", cache=cache, policy=[_pub(world)])
    assert second.state == "hit"
    blob_gets = [p for m, p, _ in world.registry.requests_since(mark) if m == "GET" and "/blobs/" in p]
    assert not [p for p in blob_gets if str(_layer(world, pushed).digest) in p]  # one download per node
    # the view is writable for the runtime; the shared copy is not
    (tmp_path / "view-2" / "new-entry").write_text("x")
    assert stat.S_IMODE(snapshot.stat().st_mode) & 0o222 == 0

    # GC: the asset never counts as a version of the model, and a lease protects it
    assert cache.gc(keep_versions=1, min_age=0).evicted == []
    with cache.open_snapshot(pushed["asset"]):
        res = cache.gc(max_bytes=0, min_age=0)
        assert pushed["asset"] in res.kept_in_use and str(world.model.digest) in res.evicted
    res = cache.gc(max_bytes=0, min_age=0)
    assert pushed["asset"] in res.evicted and not snapshot.exists()
    assert (tmp_path / "view-1" / rel).read_bytes()  # views survive GC: they are copies


def _pub(world: World) -> Any:
    from modelpack.signing.keys import load_public_key

    return load_public_key(world.public_key)


def _layer(world: World, pushed: dict[str, Any]) -> Descriptor:
    target = open_readable(parse_reference(world.ref))
    (stored,) = [a for a in list_assets(target, world.model, "inductor") if a.digest == pushed["asset"]]
    return stored.layer


# --------------------------------------------------------------------------- units


def test_packing_leaves_scratch_behind_refuses_links_and_is_reproducible(tmp_path: Path) -> None:
    cache = tmp_path / "c"
    (cache / "fxgraph" / "ab").mkdir(parents=True)
    (cache / "fxgraph" / "ab" / "entry").write_bytes(b"graph")
    (cache / "locks").mkdir()
    (cache / "locks" / "k.lock").write_bytes(b"")
    (cache / "fxgraph" / ".123.456.tmp").write_bytes(b"half")
    (cache / "__pycache__").mkdir()
    (cache / "__pycache__" / "m.pyc").write_bytes(b"pyc")
    kind = get_kind("inductor")
    a = pack_cache(str(cache), kind, work_dir=str(tmp_path))
    b = pack_cache(str(cache), kind, work_dir=str(tmp_path))
    try:
        assert a.digest == b.digest and a.files == 1 and a.bytes == len(b"graph")
    finally:
        os.unlink(a.path)
        os.unlink(b.path)
    (cache / "link").symlink_to(cache / "fxgraph" / "ab" / "entry")
    with pytest.raises(AssetError, match="symlink"):
        pack_cache(str(cache), kind, work_dir=str(tmp_path))
    assert not _leftovers(tmp_path)
    with pytest.raises(AssetError, match="no inductor cache files"):
        pack_cache(str(tmp_path / "c" / "locks"), kind)


def test_fingerprint_files_fail_closed(tmp_path: Path) -> None:
    fp = EnvironmentFingerprint.from_dict({"manifest_digest": "sha256:" + "0" * 64, "tp_size": 1})
    fp.write(tmp_path / "fp.json")
    assert EnvironmentFingerprint.read(tmp_path / "fp.json") == fp
    doc = json.loads((tmp_path / "fp.json").read_text())
    doc["fingerprint"]["dtype"] = "BF16"  # edited after the digest was recorded
    (tmp_path / "edited.json").write_text(json.dumps(doc))
    with pytest.raises(AssetFingerprintError, match="does not match"):
        EnvironmentFingerprint.read(tmp_path / "edited.json")
    (tmp_path / "unknown.json").write_text(json.dumps({"gpu": "H200"}))
    with pytest.raises(AssetFingerprintError, match="unknown fields"):
        EnvironmentFingerprint.read(tmp_path / "unknown.json")
    with pytest.raises(AssetFingerprintError, match="tp_size"):
        EnvironmentFingerprint.from_dict({"tp_size": "8"})


# --------------------------------------------------------------------------- concurrent pushes


def _slow_reads(delay: float) -> Any:
    import time

    def rewrite(body: bytes, rng: str | None) -> bytes:
        time.sleep(delay)
        return body

    return rewrite


def test_concurrent_asset_pushes_of_one_model_both_end_discoverable(
    registry: RegistryServer, tmp_path: Path
) -> None:
    """Two replicas publish their caches of the same model at once. On a registry without the
    referrers API each push is a read-modify-write of the model's ``sha256-<hex>`` fallback index;
    the push reads its referrer back and re-adds it until it is listed, so neither is lost."""
    import threading

    from modelpack import api
    from tests.fixtures.faultproxy import Fault, FaultProxy, manifest_get

    write_checkpoint(str(tmp_path / "ckpt"), SyntheticSpec(shards=1))
    base = registry.ref("assets-race/base", "v1")
    digest = str(api.push(str(tmp_path / "ckpt"), base).digest)
    model = open_readable(parse_reference(base)).resolve(digest)
    fp = running_fingerprint(open_readable(parse_reference(base)), model)
    caches = []
    for i in range(2):
        d = tmp_path / f"cache-{i}" / "fxgraph"
        d.mkdir(parents=True)
        (d / "entry").write_bytes(f"graph built by replica {i}".encode())
        caches.append(d.parent)
    events_path = tmp_path / "events.jsonl"
    proxy = FaultProxy(registry.host)
    # a slow registry: reading the fallback index takes a while, so read-modify-writes overlap
    proxy.add(Fault(match=manifest_get("sha256-" + digest[7:]), rewrite=_slow_reads(0.1), times=None))
    try:
        for round_ in range(3):
            repo = f"assets-race/round{round_}"
            api.cp(base, registry.ref(repo, "v1"))
            ref = f"{proxy.host}/{repo}@{digest}"
            errors: list[BaseException] = []
            pushed: list[str] = []
            barrier = threading.Barrier(2)

            def push(
                cache: Path,
                ref: str = ref,
                errors: list[BaseException] = errors,
                pushed: list[str] = pushed,
                barrier: threading.Barrier = barrier,
            ) -> None:
                try:
                    barrier.wait()
                    res = push_asset(
                        ref, cache, "inductor", fingerprint=fp, events=EventLog(str(events_path))
                    )
                    pushed.append(str(res.asset.digest))
                except BaseException as exc:  # reported below
                    errors.append(exc)

            threads = [threading.Thread(target=push, args=(c,)) for c in caches]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            assert not errors, errors
            target = open_readable(parse_reference(registry.ref(repo, "v1")))
            listed = {a.digest for a in list_assets(target, model, "inductor")}
            assert set(pushed) <= listed and len(pushed) == 2, f"round {round_}: lost {set(pushed) - listed}"
    finally:
        proxy.close()
    # the race did happen (an entry was overwritten) and was repaired, not merely avoided
    assert _events(events_path, "assets.referrer_lost")


def test_asset_push_fails_with_exit_1_when_its_referrer_stays_undiscoverable(
    registry: RegistryServer, tmp_path: Path
) -> None:

    from modelpack import api

    write_checkpoint(str(tmp_path / "ckpt"), SyntheticSpec(shards=1))
    digest = str(api.push(str(tmp_path / "ckpt"), registry.ref("assets-race/dropped", "v1")).digest)
    ref = f"{registry.host}/assets-race/dropped@{digest}"
    cache = tmp_path / "cache" / "fxgraph"
    cache.mkdir(parents=True)
    (cache / "entry").write_bytes(b"graph")
    with referrers_index_clobbered(registry.host, "assets-race/dropped", digest):
        proc = cli("push", ref, str(cache.parent), "--kind", "inductor", check=False)
    assert proc.returncode == 1, proc.stderr
    assert "not discoverable" in proc.stderr and digest in proc.stderr, proc.stderr
    assert "inductor asset" in proc.stderr and "push it again" in proc.stderr, proc.stderr
