"""A streamed load that fills the node cache as it goes (``CacheStream``, ``modelpack load --cache``).

Against a real registry behind a counting proxy (``FaultProxy``): the blob bytes that cross the
wire say how many reads served the load and the cache, the cache's files say what was published.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from modelpack.loader import CacheStream, LoaderOptions, iter_tensors, load_state_dict
from modelpack.mount import NodeCache
from safetensors.torch import load_file

from modelpack.cli import main
from modelpack.errors import DigestMismatchError, NotFoundError
from modelpack.events import read_events
from modelpack.targets.opener import TargetOptions
from modelpack.testdata.synthetic import SyntheticSpec, write_checkpoint
from tests.fixtures.faultproxy import FaultProxy
from tests.mount.test_cache_support import (
    committed,
    finish,
    kill_9_once_partial,
    partial_bytes,
    pull_process,
    push_model,
)
from tests.paths import REPO_ROOT

PLAIN = TargetOptions(plain_http=True)
pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def proxy(registry):  # type: ignore[no-untyped-def]
    p = FaultProxy(registry.host)
    yield p
    p.close()


def _model_dir(tmp_path: Path, seed: int) -> Path:
    return tmp_path / f"ckpt-{seed}"


def _files_by_digest(ckpt: Path) -> list[tuple[Path, str]]:
    """Each weight file and the layer digest pack gives it (the file's sha256: raw layers)."""
    import hashlib

    return [
        (f, "sha256:" + hashlib.sha256(f.read_bytes()).hexdigest())
        for f in sorted(ckpt.glob("*.safetensors"))
    ]


def _model(tmp_path: Path, seed: int = 0, layers: int = 2) -> Path:
    d = _model_dir(tmp_path, seed)
    write_checkpoint(str(d), SyntheticSpec(shards=2, seed=seed, layers=layers))
    return d


def _expected(ckpt: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _blob_total(cache: NodeCache, digest: str) -> int:
    from modelpack.oci.descriptor import Manifest

    m = Manifest.parse(cache.store.read_small(digest))
    return sum(d.size for d in {str(x.digest): x for x in [m.config, *m.layers]}.values())


def _valid_load_json(doc: dict) -> None:  # type: ignore[type-arg]
    import jsonschema

    from modelpack.cli.json_output import load_schema

    jsonschema.validate(doc, load_schema("load"))


def _events(path: Path, name: str) -> list[dict]:  # type: ignore[type-arg]
    return [e for e in read_events(str(path)) if e["event"] == name]


def test_first_start_fills_the_cache_from_one_read_and_the_next_start_reads_no_blob_bytes(
    registry, proxy, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    ckpt = _model(tmp_path, seed=40)
    digest = push_model(ckpt, registry.host, "stream/fill")
    cache_dir = tmp_path / "cache"
    cache = NodeCache(str(cache_dir))
    ref = f"{proxy.host}/stream/fill@{digest}"

    src = CacheStream(cache, ref, target_options=PLAIN)
    sd = load_state_dict(src)
    expected = _expected(ckpt)
    assert sd.keys() == expected.keys() and all(torch.equal(sd[k], expected[k]) for k in expected)
    assert src.report.state == "filled" and src.report.published
    info = cache.snapshots.ready(digest)
    assert info is not None and src.report.path == info.path
    total = _blob_total(cache, digest)
    # one read from the registry served the load and the cache: each blob fetched once
    assert proxy.total_blob_bytes() == total
    assert proxy.blob_gets and all(n == 1 for n in proxy.blob_gets.values()), proxy.blob_gets
    assert all(r.ok for r in cache.verify())
    assert _events(cache_dir / "events.jsonl", "cache.ready")

    proxy.clear()
    res = CliRunner().invoke(
        main, ["load", ref, "--cache", str(cache_dir), "--plain-http", "--json"], catch_exceptions=False
    )
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    _valid_load_json(doc)
    assert doc["state"] == "hit" and doc["cache"]["state"] == "hit" and doc["cache"]["published"]
    assert doc["cache"]["path"] == info.path
    assert proxy.total_blob_bytes() == 0 and not proxy.blob_gets


LOAD_SCRIPT = """
import json, sys
from modelpack.loader import CacheStream, load_state_dict
from modelpack.mount import NodeCache
from modelpack.targets.opener import TargetOptions
src = CacheStream(NodeCache(sys.argv[1]), sys.argv[2], target_options=TargetOptions(plain_http=True))
sd = load_state_dict(src)
print(json.dumps({"tensors": len(sd), "state": src.report.state, "published": src.report.published}))
"""


def _load_process(cache: Path, ref: str) -> subprocess.Popen[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO_ROOT)
    return subprocess.Popen(
        [sys.executable, "-c", LOAD_SCRIPT, str(cache), ref],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=str(REPO_ROOT),
    )


@pytest.mark.host_copier  # the load runs in a process of its own, which the test device does not reach
def test_kill_9_mid_stream_leaves_resumable_partials_and_never_a_snapshot(
    registry, proxy, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    digest = push_model(_model(tmp_path, seed=41, layers=4), registry.host, "stream/kill")
    cache_dir = tmp_path / "cache"
    ref = f"{proxy.host}/stream/kill@{digest}"
    proxy.rate = 512 * 1024  # per response: several seconds for the model
    proc = _load_process(cache_dir, ref)
    kill_9_once_partial(proc, cache_dir, 300_000)
    partials = partial_bytes(cache_dir)
    assert partials and sum(partials.values()) > 300_000
    before = committed(cache_dir)

    cache = NodeCache(str(cache_dir))
    assert cache.ls() == [] and cache.snapshots.ready(digest) is None  # never a hit
    with pytest.raises(NotFoundError), cache.open_snapshot(ref):
        pass

    proxy.rate = None
    proxy.wait_idle()
    proxy.clear()
    result = cache.pull(ref, PLAIN)  # pull --cache resumes what the stream left
    assert result.state == "cold" and result.bytes_resumed > 0
    missing = _blob_total(cache, digest) - sum(
        os.path.getsize(cache.store.blob_path(d)) for d in before if d != digest
    )
    assert result.bytes_downloaded == missing - result.bytes_resumed
    assert proxy.total_blob_bytes() == result.bytes_downloaded
    assert all(r.ok for r in cache.verify())


def test_a_concurrent_pull_and_streamed_load_download_each_blob_once(registry, proxy, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    digest = push_model(_model(tmp_path, seed=42, layers=4), registry.host, "stream/both")
    cache_dir = tmp_path / "cache"
    ref = f"{proxy.host}/stream/both@{digest}"
    proxy.rate = 1024 * 1024  # long enough for the two to overlap
    mark = registry.log_mark()
    puller = pull_process(cache_dir, ref)
    loader = _load_process(cache_dir, ref)
    pulled = finish(puller)
    out, err = loader.communicate(timeout=120)
    assert loader.returncode == 0, err[-3000:]
    loaded = json.loads(out.strip().splitlines()[-1])
    assert loaded["published"] and pulled["digest"] == digest
    cache = NodeCache(str(cache_dir))
    total = _blob_total(cache, digest)
    assert proxy.total_blob_bytes() == total
    assert proxy.blob_gets and all(n == 1 for n in proxy.blob_gets.values()), proxy.blob_gets
    gets: dict[str, int] = {}
    for method, path, status in registry.requests_since(mark):
        if method == "GET" and "/blobs/sha256:" in path and status in (200, 206):
            gets[path.rsplit("/", 1)[1]] = gets.get(path.rsplit("/", 1)[1], 0) + 1
    assert gets and all(n == 1 for n in gets.values()), gets
    assert [e.digest for e in cache.ls()] == [digest]


def test_a_corrupt_registry_blob_commits_nothing_and_fails_typed(registry, proxy, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    # big enough that the forged file's first tensors land seconds before its last byte
    digest = push_model(_model(tmp_path, seed=43, layers=12), registry.host, "stream/corrupt")
    from modelpack.oci.descriptor import Manifest
    from modelpack.oci.reference import parse_reference
    from modelpack.targets.registry.target import RegistryTarget

    target = RegistryTarget.from_reference(parse_reference(registry.ref("stream/corrupt", "v1")), PLAIN)
    raw, _ = target.fetch_manifest(digest)
    # the weight file the load reads first
    forged_file, forged = _files_by_digest(_model_dir(tmp_path, 43))[0]
    layer = next(x for x in Manifest.parse(raw).layers if str(x.digest) == forged)
    data_path = registry.blob_data_path(layer.digest)
    original = data_path.read_bytes()
    tampered = bytearray(original)
    tampered[len(tampered) // 8] ^= 0xFF  # early: tensors after it land long before the blob ends
    data_path.write_bytes(bytes(tampered))  # same size: only the hash can tell

    cache_dir = tmp_path / "cache"
    cache = NodeCache(str(cache_dir))
    src = CacheStream(cache, f"{proxy.host}/stream/corrupt@{digest}", target_options=PLAIN)
    handed: list[str] = []
    proxy.rate = 2 * 1024 * 1024  # the load follows the bytes as they land, tensor by tensor
    try:
        with pytest.raises(DigestMismatchError) as exc:
            # as a serving engine takes them, one by one (each tensor its own read task)
            for name, _ in iter_tensors(src, options=LoaderOptions(batch_bytes=1)):
                handed.append(name)
    finally:
        proxy.rate = None
        data_path.write_bytes(original)  # the registry is the session's: leave it as found
    # no tensor of the forged file was handed out before the refusal (read unhashed on the host,
    # held until the cache's check: loader.settled)
    assert not set(handed) & set(load_file(str(forged_file)))
    assert str(layer.digest) in str(exc.value)
    assert cache.ls() == [] and cache.snapshots.ready(digest) is None
    assert str(layer.digest) not in committed(cache_dir)
    assert not any(p.name.startswith(layer.digest.split(":")[1]) for p in (cache_dir / "ingest").iterdir())
    assert src.report.state == "failed" and not src.report.published


def test_a_tp_rank_share_leaves_the_snapshot_unpublished_and_says_so(registry, proxy, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    digest = push_model(_model(tmp_path, seed=44), registry.host, "stream/share")
    cache_dir = tmp_path / "cache"
    cache = NodeCache(str(cache_dir))
    ref = f"{proxy.host}/stream/share@{digest}"
    events = tmp_path / "events.jsonl"

    res = CliRunner().invoke(
        main,
        [
            *("load", ref, "--cache", str(cache_dir), "--plain-http"),
            *("--tp-size", "2", "--tp-rank", "0", "--events", str(events), "--json"),
        ],
        catch_exceptions=False,
    )
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    _valid_load_json(doc)
    assert doc["cache"]["state"] == "share" and doc["cache"]["published"] is False
    assert doc["cache"]["leftTo"] == "fill"
    assert cache.snapshots.ready(digest) is None and not committed(cache_dir)
    left = _events(events, "loader.cache_left")
    assert left and left[0]["left_to"] == "fill" and left[0]["digest"] == digest

    # asked to fill in the background: the share is read from the cache as the fill lands it
    proxy.clear()
    src = CacheStream(cache, ref, target_options=PLAIN, fill="background")
    sd = load_state_dict(src, tp_size=2, tp_rank=1)
    assert sd and src.report.state == "filled" and src.report.published
    assert src.report.left_to == "background"
    assert cache.snapshots.ready(digest) is not None
    assert proxy.blob_gets and all(n == 1 for n in proxy.blob_gets.values())
    assert proxy.total_blob_bytes() == _blob_total(cache, digest)


def test_a_signed_stream_publishes_the_same_trust_facts_as_pull_cache(
    registry, proxy, tmp_path: Path, copier
) -> None:  # type: ignore[no-untyped-def]
    from modelpack.loader import LoadStats
    from modelpack.mount.kept_referrers import kept_referrers
    from modelpack.signing.keys import generate_key

    from modelpack import api

    key = generate_key()
    ckpt = _model(tmp_path, seed=45)
    pushed = api.push(str(ckpt), registry.ref("stream/signed", "v1"), sign_key=key, progress="off")
    digest = str(pushed.digest)
    ref = f"{proxy.host}/stream/signed@{digest}"

    streamed = NodeCache(str(tmp_path / "streamed"))
    stats = LoadStats()
    src = CacheStream(streamed, ref, target_options=PLAIN)
    sd = load_state_dict(src, trusted_keys=[key.public], stats=stats)
    expected = _expected(ckpt)
    assert all(torch.equal(sd[k], expected[k]) for k in expected)
    # into host tensors the cache's whole-blob check vouches (loader.settled); a device's staged
    # reads are checked against the signed table chunk by chunk
    assert set(stats.verification.values()) == {"committed" if copier is None else "chunks"}
    assert src.report.published
    model_blobs = {str(d.digest) for d in (lambda m: [m.config, *m.layers])(_manifest(streamed, digest))}
    assert all(proxy.blob_gets[d] == 1 for d in model_blobs), proxy.blob_gets

    pulled = NodeCache(str(tmp_path / "pulled"))
    pulled.pull(ref, PLAIN, policy=[key.public])
    assert streamed.trust.read(digest) == pulled.trust.read(digest)
    assert streamed.trust.read(digest)["key_ids"] and streamed.trust.read(digest)["chunk_table"] == "verified"
    assert sorted(str(d.digest) for d in kept_referrers(streamed.store, digest)) == sorted(
        str(d.digest) for d in kept_referrers(pulled.store, digest)
    )
    assert kept_referrers(streamed.store, digest)
    # the next start under the same key is a hit from the trust record: no blob, no signature read
    proxy.clear()
    again = CacheStream(streamed, ref, target_options=PLAIN)
    load_state_dict(again, trusted_keys=[key.public])
    assert again.report.state == "hit" and proxy.total_blob_bytes() == 0


def _manifest(cache: NodeCache, digest: str):  # type: ignore[no-untyped-def]
    from modelpack.oci.descriptor import Manifest

    return Manifest.parse(cache.store.read_small(digest))


def test_a_damaged_partial_left_in_the_cache_is_never_read_and_the_stream_still_loads(
    registry, proxy, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """A partial a crash left (torn write, bit rot: here the whole blob's length of zeros) is the
    cache's to re-hash and throw away; the stream does not read its bytes before the blob is
    committed, so the load gets the registry's bytes and the cache publishes verified ones."""
    from modelpack.oci.descriptor import Manifest
    from modelpack.oci.reference import parse_reference
    from modelpack.targets.registry.target import RegistryTarget

    ckpt = _model(tmp_path, seed=46)
    digest = push_model(ckpt, registry.host, "stream/damaged")
    target = RegistryTarget.from_reference(parse_reference(registry.ref("stream/damaged", "v1")), PLAIN)
    from modelpack.loader.weight_files import config_json_layer

    manifest = Manifest.parse(target.fetch_manifest(digest)[0])
    config_json = config_json_layer(manifest)  # the first blob a load reads
    assert config_json is not None
    cache_dir = tmp_path / "cache"
    cache = NodeCache(str(cache_dir))
    for layer in (config_json, max(manifest.layers, key=lambda x: x.size)):
        fd = os.open(cache.store.partial_path(layer.digest), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, b"\0" * layer.size)
        os.close(fd)

    # another pull holds the manifest lock for a while: the stream's own pull waits behind it, and
    # the load meanwhile finds only the damaged partial
    import fcntl
    import threading

    held = os.open(
        os.path.join(cache.store.locks_dir, f"m-{digest.split(':')[1]}.lock"), os.O_RDWR | os.O_CREAT, 0o600
    )
    fcntl.flock(held, fcntl.LOCK_EX)
    release = threading.Timer(2.0, lambda: os.close(held))
    release.start()
    src = CacheStream(cache, f"{proxy.host}/stream/damaged@{digest}", target_options=PLAIN)
    try:
        sd = load_state_dict(src)
    finally:
        release.join()
    expected = _expected(ckpt)
    assert all(torch.equal(sd[k], expected[k]) for k in expected)
    assert src.report.published
    assert _events(cache_dir / "events.jsonl", "cache.resume_discarded")
    assert all(r.ok for r in cache.verify())


def test_a_fill_that_makes_no_progress_stops_the_load_within_its_bound(
    registry, proxy, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """A blob lock held by a process that writes nothing: the load gives up after ``stall_s``
    with an error naming the blob; the fill itself takes the stale lock over and still publishes."""
    import fcntl

    from modelpack.loader.weight_files import config_json_layer

    from modelpack.errors import CacheFillStalledError
    from modelpack.oci.descriptor import Manifest
    from modelpack.oci.reference import parse_reference
    from modelpack.targets.registry.target import RegistryTarget

    digest = push_model(_model(tmp_path, seed=47), registry.host, "stream/stall")
    target = RegistryTarget.from_reference(parse_reference(registry.ref("stream/stall", "v1")), PLAIN)
    first = config_json_layer(Manifest.parse(target.fetch_manifest(digest)[0]))
    assert first is not None
    cache = NodeCache(str(tmp_path / "cache"), stale_after=4.0)
    held = os.open(cache.store.lock_path(first.digest), os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(held, fcntl.LOCK_EX)  # a holder that never writes a byte
    try:
        src = CacheStream(cache, f"{proxy.host}/stream/stall@{digest}", target_options=PLAIN, stall_s=1.0)
        t = time.monotonic()
        with pytest.raises(CacheFillStalledError) as exc:
            load_state_dict(src)
        assert str(first.digest) in str(exc.value)
        assert time.monotonic() - t < 30
    finally:
        os.close(held)
    assert src.report.published and cache.snapshots.ready(digest) is not None


def test_the_config_a_cache_stream_reads_is_verified_and_names_the_quantization(
    registry, proxy, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """config.json read from the filling cache is the same document a plain stream reads: checked
    against its digest before it is parsed, and its quantization reaches the fingerprint (which
    keys the compile caches: a stream through the cache must not fingerprint an FP8 model as
    unquantized). A registry that forges it is refused before any plan is made from it."""
    from modelpack.loader import LoadStats
    from modelpack.loader.weight_files import config_json_layer

    from modelpack.oci.descriptor import Manifest
    from modelpack.oci.reference import parse_reference
    from modelpack.targets.registry.target import RegistryTarget
    from tests.fixtures.faultproxy import Fault, blob_get

    ckpt = _model(tmp_path, seed=48)
    (ckpt / "config.json").write_text(
        json.dumps({"model_type": "llama", "quantization_config": {"quant_method": "fp8", "bits": 8}})
    )
    digest = push_model(ckpt, registry.host, "stream/quant")
    ref = f"{proxy.host}/stream/quant@{digest}"
    plain = LoadStats()
    load_state_dict(ref, target_options=PLAIN, stats=plain)
    assert plain.fingerprint is not None and plain.fingerprint.quantization == "fp8-8bit"
    streamed = LoadStats()
    load_state_dict(
        CacheStream(NodeCache(str(tmp_path / "cache")), ref, target_options=PLAIN), stats=streamed
    )
    assert streamed.fingerprint is not None
    assert streamed.fingerprint.quantization == plain.fingerprint.quantization

    target = RegistryTarget.from_reference(parse_reference(registry.ref("stream/quant", "v1")), PLAIN)
    cfg = config_json_layer(Manifest.parse(target.fetch_manifest(digest)[0]))
    assert cfg is not None
    proxy.add(Fault(blob_get(str(cfg.digest)), times=None, corrupt_at=2))
    forged = CacheStream(NodeCache(str(tmp_path / "cache-forged")), ref, target_options=PLAIN)
    with pytest.raises(DigestMismatchError) as exc:
        load_state_dict(forged)
    # refused by the load's own check of config.json or by the fill's, whichever sees it first
    assert str(cfg.digest) in str(exc.value)


def test_bytes_read_from_a_partial_the_cache_threw_away_are_read_again_from_the_verified_blob(
    registry, proxy, tmp_path: Path, copier
) -> None:  # type: ignore[no-untyped-def]
    """The load reads a weight file from a partial another writer fills with forged bytes (a
    registry that lies to the first GET); that writer's check fails and it removes its partial;
    the stream's own fill then downloads the blob again into a new file and verifies it. No hash
    of the load's own covers the forged bytes it read on the host (loader.settled): they must be
    told apart by the file they came from and read again from the verified one, so the load gets
    the right tensors, not the forged ones, and not a failure either."""
    import fcntl
    import threading

    from modelpack.loader.weight_files import config_json_layer

    from modelpack.oci.descriptor import Manifest
    from modelpack.oci.reference import parse_reference
    from modelpack.targets.registry.target import RegistryTarget
    from tests.fixtures.faultproxy import Fault, blob_get

    ckpt = tmp_path / "ckpt"
    write_checkpoint(str(ckpt), SyntheticSpec(shards=1, seed=49, layers=2))
    digest = push_model(ckpt, registry.host, "stream/reread")
    via_proxy = RegistryTarget.from_reference(parse_reference(f"{proxy.host}/stream/reread@{digest}"), PLAIN)
    manifest = Manifest.parse(via_proxy.fetch_manifest(digest)[0])
    weights = max(manifest.layers, key=lambda x: x.size)
    cfg = config_json_layer(manifest)
    assert cfg is not None
    cache_dir = tmp_path / "cache"
    cache = NodeCache(str(cache_dir))
    cache.blobs.ingest(cfg, via_proxy)  # config.json is there: the load goes on to the weights

    # the stream's own pull waits behind another pull's manifest lock meanwhile
    held = os.open(
        os.path.join(cache.store.locks_dir, f"m-{digest.split(':')[1]}.lock"), os.O_RDWR | os.O_CREAT, 0o600
    )
    fcntl.flock(held, fcntl.LOCK_EX)
    src = CacheStream(cache, f"{proxy.host}/stream/reread@{digest}", target_options=PLAIN)
    out: dict[str, object] = {}

    def load() -> None:
        try:
            out["sd"] = load_state_dict(src)
        except BaseException as exc:  # raised in the test thread below
            out["error"] = exc

    proxy.rate = 1024 * 1024  # the forged writer lands its bytes slowly: the load follows it
    proxy.add(Fault(blob_get(str(weights.digest)), times=1, corrupt_at=weights.size // 4))
    loader = threading.Thread(target=load)
    try:
        loader.start()
        with pytest.raises(DigestMismatchError):  # the other writer: its own check refuses it
            cache.blobs.ingest(weights, via_proxy)
    finally:
        os.close(held)
        proxy.rate = None
        loader.join(timeout=120)
    assert not loader.is_alive()
    if "error" in out:
        raise out["error"]  # type: ignore[misc]
    sd = out["sd"]
    expected = _expected(ckpt)
    assert all(torch.equal(sd[k], expected[k]) for k in expected)  # type: ignore[index]
    assert src.report.state == "filled" and src.report.published
    if copier is None:  # host tensors: the cache's check vouched, the forged reads were read again
        assert src.report.bytes_reread > 0
    assert all(r.ok for r in cache.verify())


@pytest.mark.parametrize("publish", ["wait", "background"])
def test_a_background_publish_returns_the_verified_tensors_before_the_cache_commit(
    registry, proxy, tmp_path: Path, publish: str
) -> None:  # type: ignore[no-untyped-def]
    """The cache publishes only when every blob is committed; a blob the load does not read (the
    README) arrives late. ``publish="wait"`` returns after the publish; ``"background"`` (a
    serving engine) returns with the verified tensors and the fill publishes on its own, which
    ``wait()`` joins. Either way the snapshot ends up the same and verified."""
    from modelpack.oci.descriptor import Manifest
    from modelpack.oci.reference import parse_reference
    from modelpack.targets.registry.target import RegistryTarget
    from tests.fixtures.faultproxy import Fault, blob_get

    ckpt = _model(tmp_path, seed=50)
    digest = push_model(ckpt, registry.host, "stream/publish")
    target = RegistryTarget.from_reference(parse_reference(registry.ref("stream/publish", "v1")), PLAIN)
    manifest = Manifest.parse(target.fetch_manifest(digest)[0])
    readme = next(
        x for x in manifest.layers if (x.annotations or {}).get("org.cncf.model.filepath") == "README.md"
    )
    proxy.add(Fault(blob_get(str(readme.digest)), before=lambda: time.sleep(3.0)))
    cache = NodeCache(str(tmp_path / "cache"))
    src = CacheStream(cache, f"{proxy.host}/stream/publish@{digest}", target_options=PLAIN, publish=publish)
    t = time.monotonic()
    sd = load_state_dict(src)
    took = time.monotonic() - t
    expected = _expected(ckpt)
    assert all(torch.equal(sd[k], expected[k]) for k in expected)
    if publish == "wait":
        assert took >= 3.0 and src.report.state == "filled" and src.report.published
    else:
        assert took < 3.0 and src.report.state == "publishing" and not src.report.published
        assert cache.snapshots.ready(digest) is None
        assert src.wait(timeout=60) is src.report
    assert src.report.state == "filled" and src.report.published
    assert cache.snapshots.ready(digest) is not None and all(r.ok for r in cache.verify())
    assert proxy.blob_gets and all(n == 1 for n in proxy.blob_gets.values())
    with pytest.raises(ValueError, match="publish='later'"):
        CacheStream(cache, f"{proxy.host}/stream/publish@{digest}", publish="later")
