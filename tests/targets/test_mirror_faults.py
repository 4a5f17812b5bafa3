"""A crawling mirror cannot stall a pull, SIGTERM stops a stalled transfer,
and a lying mirror cannot deny a chunk-verified load.

The origin is a real ``docker-registry``; the mirrors are the small hostile loopback servers of
``tests/fixtures/hostile_mirror.py`` (one byte a second; headers then silence; zeroed bytes);
the pulls and loads are real subprocesses of the CLI. Before this change the crawling mirror
kept a pull running for as long as it crawled (the stall limit is per ``recv``), SIGTERM left the
worker blocked in it, and a mirror serving zeroed bytes made ``modelpack load`` fail at chunk 0.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from modelpack.api import transfer
from modelpack.targets.opener import open_readable
from tests.fixtures.hostile_mirror import HostileMirror, push_and_read_back
from tests.fixtures.registry import RegistryServer

pytestmark = pytest.mark.timeout(240)


def _cli(*argv: str) -> list[str]:
    return [sys.executable, "-m", "modelpack.cli", *argv]


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    spool = tmp_path / "tmpdir"
    spool.mkdir(exist_ok=True)
    return dict(os.environ, TMPDIR=str(spool), MODELPACK_HOSTS_DIR=str(tmp_path / "no-hosts"), **extra)


def _leftovers(*dirs: Path) -> list[str]:
    return [str(p) for d in dirs if d.exists() for p in d.rglob("*") if p.is_file() or ".tmp-" in p.name]


@pytest.fixture
def crawler_for() -> Iterator[list[HostileMirror]]:
    made: list[HostileMirror] = []
    yield made
    for m in made:
        m.close()


def test_a_crawling_mirror_is_abandoned_below_its_floor_and_the_origin_finishes(
    registry: RegistryServer, checkpoint: Path, tmp_path: Path, crawler_for: list[HostileMirror]
) -> None:
    _digest, manifest, blobs = push_and_read_back(registry, checkpoint, "faults/crawl")
    crawler = HostileMirror(blobs, "crawl", interval=0.5)
    crawler_for.append(crawler)
    env = _env(tmp_path, MODELPACK_MIRROR_MIN_RATE="65536", MODELPACK_MIRROR_RATE_WINDOW="2")
    out = tmp_path / "out"
    proc = subprocess.run(
        _cli("pull", "--mirror", crawler.url, "--json", registry.ref("faults/crawl", "v1"), str(out)),
        env=env,
        capture_output=True,
        text=True,
        timeout=120,  # before the floor: one byte every 0.5 s of a multi-MiB blob, for hours
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    for rel in doc["directory"]["paths"]:
        assert (out / rel).read_bytes() == (checkpoint / rel).read_bytes(), rel
    assert "too slow" in proc.stderr and "floor 65536 B/s over 2 s" in proc.stderr, proc.stderr
    # the crawler delivered a few bytes; the origin continued from the byte reached
    weights = sum(d.size for d in manifest.layers)
    assert 0 < doc["bytesBySource"].get(crawler.host, 0) < 64
    assert doc["bytesBySource"][crawler.host] + doc["bytesBySource"][registry.host] == weights
    assert _leftovers(tmp_path / "tmpdir") == []
    assert not [p.name for p in out.rglob(".tmp-modelpack*")]


@pytest.mark.parametrize("mode", ["crawl", "silent"])
def test_sigterm_during_a_stalled_mirror_transfer_exits_within_2s_and_removes_temp_files(
    registry: RegistryServer, checkpoint: Path, tmp_path: Path, crawler_for: list[HostileMirror], mode: str
) -> None:
    _digest, _manifest, blobs = push_and_read_back(registry, checkpoint, f"faults/term-{mode}")
    mirror = HostileMirror(blobs, mode, interval=0.5)
    crawler_for.append(mirror)
    # a stall limit and floor window longer than the test: only the signal can end the wait
    env = _env(tmp_path, MODELPACK_MIRROR_STALL="60", MODELPACK_MIRROR_RATE_WINDOW="60")
    out = tmp_path / "out"
    proc = subprocess.Popen(
        _cli(
            "pull",
            "--mirror",
            mirror.url,
            "--retry-for",
            "2m",
            registry.ref(f"faults/term-{mode}", "v1"),
            str(out),
        ),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        blob_gets = lambda: [p for m, p in mirror.requests if m == "GET" and "/blobs/" in p]  # noqa: E731
        while time.monotonic() < deadline and (
            len(blob_gets()) < 1 or (mode == "crawl" and mirror.served < 2)
        ):
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        assert blob_gets(), "the pull never asked the mirror for a blob"
        time.sleep(0.5)  # well inside the transfer: workers blocked on the mirror
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        try:
            _stdout, stderr = proc.communicate(timeout=2)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running 2 s after SIGTERM (mode {mode})")
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    assert "interrupted by SIGTERM" in stderr and "Traceback" not in stderr, stderr
    assert took < 2
    assert not [p.name for p in out.rglob(".tmp-modelpack*")] if out.exists() else True
    assert _leftovers(tmp_path / "tmpdir") == []


def test_a_mirror_serving_zeroed_bytes_cannot_deny_a_chunk_verified_load(
    registry: RegistryServer, checkpoint: Path, tmp_path: Path, crawler_for: list[HostileMirror]
) -> None:
    import torch
    from modelpack.loader import load_state_dict
    from modelpack.signing.chunks import compute_chunk_table, push_chunk_table
    from modelpack.signing.keys import generate_key

    from modelpack.events import EventLog, read_events
    from modelpack.targets.opener import TargetOptions, open_target
    from tests.loader_helpers import reference_tensors

    digest, manifest, blobs = push_and_read_back(registry, checkpoint, "faults/liar")
    target = open_target(f"{registry.host}/faults/liar@{digest}", for_write=True)
    key = generate_key()
    push_chunk_table(target, target.resolve(digest), compute_chunk_table(target, manifest), key)
    pub = tmp_path / "k.pub"
    pub.write_bytes(key.public.pem)
    liar = HostileMirror(blobs, "zero")
    crawler_for.append(liar)
    source = f"{registry.host}/faults/liar@{digest}"

    proc = subprocess.run(
        _cli("load", source, "--mirror", liar.url, "--trusted-key", str(pub), "--json"),
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr  # before: "chunk 0: expected sha256:…"
    doc = json.loads(proc.stdout)
    assert set(doc["verification"].values()) == {"chunks"}
    assert liar.served > 0  # the mirror was asked, and lied

    events = tmp_path / "ev.jsonl"
    opts = TargetOptions(mirrors=[liar.url], events=EventLog(str(events)))
    got = load_state_dict(source, trusted_keys=[key.public], target_options=opts)
    want = reference_tensors(checkpoint)
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    # the signature's blobs are not on the liar (404); every weight layer it served was refetched
    ours = {str(d.digest) for d in manifest.layers}
    gone = [
        e
        for e in read_events(str(events))
        if e["event"] == "registry.mirror_abandoned" and e.get("blob") in ours
    ]
    assert gone and all("digest mismatch" in e["reason"] for e in gone), gone
    # caught on its ranges (chunk by chunk), or on a whole blob: then it is not asked again
    assert any("chunk(s) of range" in e["reason"] or "not the blob" in e["reason"] for e in gone), gone


def test_a_mirror_serving_zeroed_bytes_cannot_deny_a_whole_layer_load(
    registry: RegistryServer, checkpoint: Path, tmp_path: Path, crawler_for: list[HostileMirror]
) -> None:
    """Without a chunk table a layer is verified whole (its manifest digest): a mirror serving
    zeroes made ``modelpack load REF@D --mirror M`` exit 1 ("expected sha256:…, got …") while the
    origin was healthy. The layer is now read from the mirrors only once their bytes matched
    the digest (the liar's bytes go to the next source, then the origin), the load succeeds with
    the origin's bytes, and the liar is named in an event."""
    import torch
    from modelpack.loader import load_state_dict

    from modelpack.events import EventLog, read_events
    from modelpack.targets.opener import TargetOptions
    from tests.loader_helpers import reference_tensors

    digest, manifest, blobs = push_and_read_back(registry, checkpoint, "faults/whole-liar")
    liar = HostileMirror(blobs, "zero")
    crawler_for.append(liar)
    source = f"{registry.host}/faults/whole-liar@{digest}"
    proc = subprocess.run(
        _cli("load", source, "--mirror", liar.url, "--json"),
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert set(doc["verification"].values()) == {"whole"}, doc["verification"]
    assert liar.served > 0  # the mirror was asked, and lied

    events = tmp_path / "ev.jsonl"
    opts = TargetOptions(mirrors=[liar.url], events=EventLog(str(events)))
    got = load_state_dict(source, target_options=opts)
    want = reference_tensors(checkpoint)
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    weights = {str(d.digest) for d in manifest.layers if str(d.digest) in blobs}
    gone = [
        e
        for e in read_events(str(events))
        if e["event"] == "registry.mirror_abandoned" and e.get("blob") in weights
    ]
    assert gone and all(e["failure"] == "digest_mismatch" for e in gone), gone


def test_origin_down_a_pinned_pull_comes_from_the_mirror_and_a_tag_pull_fails_clearly(
    registry_factory: Any, checkpoint: Path, tmp_path: Path
) -> None:
    """Manifests by digest may come from a mirror (verified by digest); tags
    resolve only at the origin. Before, every manifest read went to the origin."""
    origin = registry_factory.start()
    mirror = registry_factory.start()
    digest, _manifest, _blobs = push_and_read_back(origin, checkpoint, "faults/down")
    transfer.cp(origin.ref("faults/down", "v1"), mirror.ref("faults/down", "v1"), progress="off")
    origin.kill()
    mark = mirror.log_mark()
    env = _env(tmp_path)
    base = ["--mirror", f"http://{mirror.host}", "--retry-for", "2s"]
    pinned = subprocess.run(
        _cli("pull", "--cache", str(tmp_path / "cache"), *base, f"{origin.host}/faults/down@{digest}"),
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert pinned.returncode == 0, pinned.stderr
    snapshot = Path(pinned.stdout.strip().splitlines()[-1])
    for f in checkpoint.glob("*.safetensors"):
        assert (snapshot / f.name).read_bytes() == f.read_bytes()
    tagged = subprocess.run(
        _cli("pull", "--cache", str(tmp_path / "cache2"), *base, f"{origin.host}/faults/down:v1"),
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert tagged.returncode != 0
    assert origin.host in tagged.stderr and "Traceback" not in tagged.stderr, tagged.stderr
    # the mirror served the manifest by digest, and was never asked what a tag names
    asked = [p for m, p, _ in mirror.requests_since(mark) if "/manifests/" in p]
    assert f"/v2/faults/down/manifests/{digest}" in asked
    assert not [p for p in asked if not p.rsplit("/", 1)[1].startswith("sha256:")], asked


@pytest.mark.parametrize("where", ["directory", "cache"])
def test_a_kept_partial_resumes_from_a_mirror_while_the_origin_is_down(
    where: str, registry_factory: Any, checkpoint: Path, tmp_path: Path
) -> None:
    """A partial kept by a killed pull (or a full disk) is resumed from the mirrors too: a
    resumed download asked the origin alone (mirrors only from byte 0), so with the origin down
    a pinned pull failed after ``--retry-for`` although the mirror held the blob."""
    from modelpack.mount.store import Store

    from modelpack.transfer.staging import partial_path

    origin = registry_factory.start()
    mirror = registry_factory.start()
    digest, manifest, blobs = push_and_read_back(origin, checkpoint, "faults/resume")
    transfer.cp(origin.ref("faults/resume", "v1"), mirror.ref("faults/resume", "v1"), progress="off")
    big = max(manifest.layers, key=lambda d: d.size)
    data = blobs[str(big.digest)]
    keep = len(data) // 3
    if where == "directory":
        out = tmp_path / "out"
        out.mkdir()
        partial = Path(partial_path(str(out / big.annotations["org.opencontainers.image.title"]), big.digest))
        dest = [str(out)]
    else:
        partial = Path(Store(str(tmp_path / "cache")).partial_path(big.digest))
        dest = ["--cache", str(tmp_path / "cache")]
    partial.parent.mkdir(parents=True, exist_ok=True)
    partial.write_bytes(data[:keep])
    partial.chmod(0o600)
    origin.kill()
    proc = subprocess.run(
        _cli(
            "pull",
            f"{origin.host}/faults/resume@{digest}",
            *dest,
            "--mirror",
            f"http://{mirror.host}",
            "--retry-for",
            "2s",
            "--json",
        ),
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    resumed = doc["directory"]["resumedBytes"] if where == "directory" else doc["cache"]["bytes"]["resumed"]
    assert resumed == keep, doc
    assert not partial.exists()


def test_a_mirror_forging_a_manifest_by_digest_is_abandoned_for_the_origin(
    registry: RegistryServer, checkpoint: Path, tmp_path: Path, crawler_for: list[HostileMirror]
) -> None:
    digest, _manifest, blobs = push_and_read_back(registry, checkpoint, "faults/forged")
    target = open_readable(registry.ref("faults/forged", None))
    raw, media_type = target.fetch_manifest(digest)
    liar = HostileMirror(blobs, "zero", manifests={digest: (raw, media_type)})  # zeroed manifest too
    crawler_for.append(liar)
    proc = subprocess.run(
        _cli(
            "pull",
            "--cache",
            str(tmp_path / "cache"),
            "--mirror",
            liar.url,
            f"{registry.host}/faults/forged@{digest}",
        ),
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    snapshot = Path(proc.stdout.strip().splitlines()[-1])
    for f in checkpoint.glob("*.safetensors"):
        assert (snapshot / f.name).read_bytes() == f.read_bytes()
    assert ("GET", f"/v2/faults/forged/manifests/{digest}") in liar.requests
    assert f"abandoned for {digest}" in proc.stderr, proc.stderr


def test_a_lying_mirror_sends_the_blob_to_the_next_mirror_not_to_the_origin(
    registry_factory: Any, checkpoint: Path, tmp_path: Path, crawler_for: list[HostileMirror]
) -> None:
    """A mirror whose bytes fail the digest is dropped for that blob and the next mirror asked;
    the origin serves only what no honest mirror has. Before, the first mismatch sent the whole
    blob to the origin (a corrupting storm peer cost the origin ~5 copies of the model)."""
    origin = registry_factory.start()
    honest = registry_factory.start()
    digest, _manifest, blobs = push_and_read_back(origin, checkpoint, "faults/next")
    transfer.cp(origin.ref("faults/next", "v1"), honest.ref("faults/next", "v1"), progress="off")
    liar = HostileMirror(blobs, "zero")
    crawler_for.append(liar)
    mark = origin.log_mark()
    mirrors = ["--mirror", liar.url, "--mirror", f"http://{honest.host}"]
    proc = subprocess.run(
        _cli(
            "pull",
            "--cache",
            str(tmp_path / "cache"),
            *mirrors,
            "--json",
            f"{origin.host}/faults/next@{digest}",
        ),
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    for f in checkpoint.glob("*.safetensors"):
        assert (Path(doc["path"]) / f.name).read_bytes() == f.read_bytes()
    assert any("/blobs/" in p for _, p in liar.requests)  # the liar was asked, and lied
    assert not [p for m, p, _ in origin.requests_since(mark) if "/blobs/" in p and m == "GET"]
    assert set(doc["bytesBySource"]) == {honest.host}, doc


def test_a_liar_just_above_the_floor_costs_a_bounded_time_per_blob(
    registry: RegistryServer, checkpoint: Path, tmp_path: Path, crawler_for: list[HostileMirror]
) -> None:
    """A mirror serving zeroed bytes at 1.25 times the throughput floor (never below it, so never
    abandoned by the floor) cannot hold each blob for size / floor: a mirror must average four
    times the floor over a whole blob after a grace of three windows, else the next source
    continues from the byte reached; and once it alone served a blob that failed its digest it is
    not asked again in this run. Before, this pull took about 50 s (the whole of each shard at
    40 KiB/s, then the origin again)."""
    digest, manifest, blobs = push_and_read_back(registry, checkpoint, "faults/liar")
    layers = {str(d.digest): blobs[str(d.digest)] for d in manifest.layers if d.size > 1024 * 1024}
    assert len(layers) == 2
    liar = HostileMirror(layers, "zero", rate=40 * 1024)
    crawler_for.append(liar)
    env = _env(tmp_path, MODELPACK_MIRROR_MIN_RATE=str(32 * 1024), MODELPACK_MIRROR_RATE_WINDOW="1")
    started = time.monotonic()
    proc = subprocess.run(
        _cli(
            "pull",
            "--cache",
            str(tmp_path / "cache"),
            "--mirror",
            liar.url,
            "--json",
            f"{registry.host}/faults/liar@{digest}",
        ),
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
    )
    took = time.monotonic() - started
    print(f"pull through a liar at 1.25 x the floor: {took:.1f} s")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    for f in checkpoint.glob("*.safetensors"):
        assert (Path(doc["path"]) / f.name).read_bytes() == f.read_bytes()
    # each shard: at most 3 windows + size / (4 x floor) = 3 s + 15 s from the liar, then the origin
    assert took < 30, (took, proc.stderr)
    assert "too slow for a whole blob" in proc.stderr, proc.stderr


def test_a_mirror_caught_lying_is_not_asked_again_in_the_run(
    registry: RegistryServer, checkpoint: Path, tmp_path: Path, crawler_for: list[HostileMirror]
) -> None:
    """A mirror that alone served a blob whose bytes failed the digest is not asked for any other
    blob of the run: a liar costs one blob, not every blob. Before, it was asked for each."""
    digest, _manifest, blobs = push_and_read_back(registry, checkpoint, "faults/once")
    liar = HostileMirror(blobs, "zero")
    crawler_for.append(liar)
    proc = subprocess.run(
        _cli(
            "pull",
            "--cache",
            str(tmp_path / "cache"),
            "--jobs",
            "1",
            "--mirror",
            liar.url,
            "--json",
            f"{registry.host}/faults/once@{digest}",
        ),
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    asked = [p for m, p in liar.requests if m == "GET" and "/blobs/" in p]
    assert len(asked) == 1, asked
    assert len(blobs) > 2


def test_with_a_signed_chunk_table_a_liar_is_dropped_at_its_first_bad_chunk(
    registry: RegistryServer, tmp_path: Path, crawler_for: list[HostileMirror]
) -> None:
    """With a signed chunk table (64 KiB chunks) verified before the blobs are fetched, a mirror's
    spool is checked chunk by chunk as it arrives: a liar sending zeroes just above the floor is
    dropped at its first bad chunk (a few seconds), not at the last byte of a 27 MiB shard, and
    the origin continues from the last good chunk. Before, each shard waited for the whole blob
    (or the whole-blob limit: 3 windows + size at 4 x the floor)."""
    from modelpack.signing import sign_artifact
    from modelpack.signing.keys import generate_key

    from modelpack.targets.opener import open_target
    from modelpack.testdata.synthetic import SyntheticSpec, write_checkpoint

    big = tmp_path / "big"
    write_checkpoint(str(big), SyntheticSpec(hidden=512, intermediate=1376, layers=2, vocab=8192))
    digest, manifest, blobs = push_and_read_back(registry, big, "faults/chunks")
    target = open_target(f"{registry.host}/faults/chunks@{digest}", for_write=True)
    key = generate_key()
    sign_artifact(target, target.resolve(digest), key, chunk_size=64 * 1024)
    pub = tmp_path / "k.pub"
    pub.write_bytes(key.public.pem)
    shard = max(manifest.layers, key=lambda d: d.size)
    assert shard.size > 16 * 1024 * 1024
    liar = HostileMirror({str(shard.digest): blobs[str(shard.digest)]}, "zero", rate=80 * 1024)
    crawler_for.append(liar)
    env = _env(tmp_path, MODELPACK_MIRROR_MIN_RATE=str(64 * 1024), MODELPACK_MIRROR_RATE_WINDOW="1")
    started = time.monotonic()
    proc = subprocess.run(
        _cli(
            "pull",
            "--cache",
            str(tmp_path / "cache"),
            "--key",
            str(pub),
            "--mirror",
            liar.url,
            "--json",
            f"{registry.host}/faults/chunks@{digest}",
        ),
        env=env,
        capture_output=True,
        text=True,
        timeout=200,
    )
    took = time.monotonic() - started
    print(f"pull through a liar with a 64 KiB chunk table: {took:.1f} s")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["signature"] == "verified"
    assert (Path(doc["path"]) / "model.safetensors").read_bytes() == (big / "model.safetensors").read_bytes()
    assert "chunk" in proc.stderr and "digest mismatch" in proc.stderr, proc.stderr
    assert liar.served < 4 * 64 * 1024, liar.served  # dropped within its first chunks
    assert took < 30, took
