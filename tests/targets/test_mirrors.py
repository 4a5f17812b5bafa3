"""Pulls through mirrors before the origin, abandoning a mirror per blob.

The origin is the session registry behind a fault-free FaultProxy (its byte counters say what
the origin served to the client); a mirror is a second real registry holding a copy (or Debian's
``docker-registry`` as a pull-through cache of the origin) behind its own FaultProxy, which plays
the peer that is down, dies mid-blob, stalls or corrupts. Every case ends with identical files,
and the origin served exactly the bytes the mirror failed to deliver. Before this change there
were no mirrors: ``--mirror``/``--hosts-dir`` did not exist and every blob came from the origin.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from modelpack.api import transfer
from modelpack.cli import main
from modelpack.errors import MirrorConfigError
from modelpack.events import EventLog, read_events
from modelpack.oci.descriptor import Descriptor
from modelpack.targets.fetch import fetch_manifest
from modelpack.targets.opener import TargetOptions, open_readable
from modelpack.targets.options import MirrorThresholds
from modelpack.targets.registry.mirrors import configured_mirrors, hosts_toml_mirrors
from modelpack.testdata.synthetic import SyntheticSpec, write_checkpoint
from tests.fixtures.faultproxy import Fault, FaultProxy, blob_get
from tests.fixtures.registry import RegistryFactory, RegistryServer, free_port

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def origin(registry: RegistryServer) -> Iterator[FaultProxy]:
    p = FaultProxy(registry.host)
    yield p
    p.close()


@pytest.fixture
def mirror_registry(registry_factory: RegistryFactory) -> RegistryServer:
    return registry_factory.start()


@pytest.fixture
def mirror(mirror_registry: RegistryServer) -> Iterator[FaultProxy]:
    """The mirror registry behind its own FaultProxy: its faults and byte counters."""
    p = FaultProxy(mirror_registry.host)
    yield p
    p.close()


def _setup(
    registry: RegistryServer, mirror: RegistryServer | None, checkpoint: Path, repo: str
) -> list[Descriptor]:
    """Push to the origin (and copy to the mirror); the layers, largest first (a pull to a
    directory does not fetch the config)."""
    res = transfer.push(str(checkpoint), registry.ref(repo, "v1"), progress="off")
    if mirror is not None:
        transfer.cp(registry.ref(repo, "v1"), mirror.ref(repo, "v1"), progress="off")
    manifest, _ = fetch_manifest(open_readable(registry.ref(repo, None)), res.digest)
    return sorted(manifest.layers, key=lambda d: -d.size)


def _options(tmp_path: Path, *mirrors: str, **thresholds: float) -> tuple[TargetOptions, Path]:
    events = tmp_path / "events.jsonl"
    opts = TargetOptions(
        mirrors=list(mirrors), events=EventLog(str(events)), mirror_thresholds=MirrorThresholds(**thresholds)
    )
    return opts, events


def _same_files(pulled: Path, checkpoint: Path, names: list[str]) -> None:
    assert names
    for rel in names:
        assert (pulled / rel).read_bytes() == (checkpoint / rel).read_bytes(), rel
    assert not [p.name for p in pulled.rglob("*") if p.name.startswith(".tmp-modelpack")]


def _pull_via(
    tmp_path: Path, origin: FaultProxy, mirror_url: str, repo: str, checkpoint: Path, **extra: Any
) -> tuple[Any, Path]:
    """Pull ``repo`` from the origin with ``mirror_url`` as its mirror into tmp_path/out; check the
    files against ``checkpoint`` and let the origin's counters settle. Returns (result, event log)."""
    opts, events = _options(tmp_path, mirror_url, **extra)
    res = transfer.pull(
        f"{origin.host}/{repo}:v1", str(tmp_path / "out"), target_options=opts, progress="off"
    )
    _same_files(tmp_path / "out", checkpoint, list(res.files))
    origin.settle()
    return res, events


def _abandoned(events: Path) -> list[dict[str, Any]]:
    if not events.exists():
        return []
    return [e for e in read_events(str(events)) if e["event"] == "registry.mirror_abandoned"]


def _origin_blob_gets(registry: RegistryServer, mark: int) -> list[str]:
    return [p for m, p, _ in registry.requests_since(mark) if m == "GET" and "/blobs/" in p]


def test_blobs_come_from_the_mirror_and_manifests_from_the_origin(
    registry: RegistryServer,
    origin: FaultProxy,
    mirror_registry: RegistryServer,
    mirror: FaultProxy,
    checkpoint: Path,
    tmp_path: Path,
) -> None:
    blobs = _setup(registry, mirror_registry, checkpoint, "mirrors/plain")
    mark = registry.log_mark()
    res, events = _pull_via(tmp_path, origin, f"http://{mirror.host}", "mirrors/plain", checkpoint)
    mirror.settle()
    assert sum(origin.blob_bytes.values()) == 0
    assert _origin_blob_gets(registry, mark) == []
    assert sum(mirror.blob_bytes.values()) == sum(d.size for d in blobs)
    # the run's summary says where the bytes came from
    assert res.bytes_by_source == {mirror.host: sum(d.size for d in blobs)}
    # a mirror never chooses the version: it is never asked for a manifest or a tag
    assert not [p for _, p, _ in mirror.requests if "/manifests/" in p]
    assert _abandoned(events) == []


def test_mirror_down_at_start_falls_back_to_the_origin(
    registry: RegistryServer, origin: FaultProxy, checkpoint: Path, tmp_path: Path
) -> None:
    blobs = _setup(registry, None, checkpoint, "mirrors/down")
    dead = f"http://127.0.0.1:{free_port()}"
    opts, events = _options(tmp_path, dead)
    started = time.monotonic()
    res = transfer.pull(
        f"{origin.host}/mirrors/down:v1", str(tmp_path / "out"), target_options=opts, progress="off"
    )
    took = time.monotonic() - started
    _same_files(tmp_path / "out", checkpoint, list(res.files))
    origin.settle()
    assert sum(origin.blob_bytes.values()) == sum(d.size for d in blobs)
    assert res.bytes_by_source == {origin.host: sum(d.size for d in blobs)}
    gone = _abandoned(events)
    assert gone and all(e["mirror"] == dead.removeprefix("http://") for e in gone)
    assert "cannot reach" in gone[0]["reason"]
    # a dead mirror costs one short retry budget per run, not one per blob: only the blobs
    # already asking it concurrently (--jobs 4) tried it, the rest went straight to the origin
    assert len(gone) <= 4 < len(blobs) and took < 30, (len(gone), took)


def test_mirror_killed_mid_blob_resumes_at_the_origin_from_the_byte_reached(
    registry: RegistryServer, origin: FaultProxy, mirror_registry: RegistryServer, tmp_path: Path
) -> None:
    ckpt = tmp_path / "ckpt"
    write_checkpoint(str(ckpt), SyntheticSpec(hidden=512, intermediate=1376, layers=4, vocab=4096, shards=1))
    blobs = _setup(registry, mirror_registry, ckpt, "mirrors/killed")
    big = blobs[0]
    mirror = FaultProxy(mirror_registry.host, rate=4 * 1024 * 1024)
    opts, events = _options(tmp_path, f"http://{mirror.host}")
    outcome: list[BaseException | None] = []

    def pull() -> None:
        try:
            transfer.pull(
                f"{origin.host}/mirrors/killed:v1",
                str(tmp_path / "out"),
                target_options=opts,
                jobs=1,
                progress="off",
            )
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    try:
        worker = threading.Thread(target=pull)
        worker.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and mirror.blob_bytes[str(big.digest)] < big.size // 3:
            time.sleep(0.01)
        assert worker.is_alive(), "the pull finished before the mirror could be killed"
        mirror_registry.kill()
        worker.join(timeout=120)
        mirror.settle()
    finally:
        mirror.close()
    assert outcome == [None], outcome
    check = transfer.pull(registry.ref("mirrors/killed", "v1"), str(tmp_path / "check"), progress="off")
    _same_files(tmp_path / "out", ckpt, list(check.files))
    origin.settle()
    from_mirror = mirror.blob_bytes[str(big.digest)]
    from_origin = origin.blob_bytes[str(big.digest)]
    assert 0 < from_mirror < big.size
    # the origin served only what the mirror failed to deliver, with one ranged request
    assert from_origin == big.size - from_mirror, (from_origin, from_mirror, big.size)
    gone = _abandoned(events)
    assert gone and gone[0]["blob"] == str(big.digest) and gone[0]["offset"] == from_mirror
    split = [e["sources"] for e in read_events(str(events)) if e["event"] == "registry.blob_sources"]
    assert {mirror.host: from_mirror, origin.host: from_origin} in split


def test_mirror_corrupting_one_blob_is_abandoned_and_nothing_corrupt_is_written(
    registry: RegistryServer,
    origin: FaultProxy,
    mirror_registry: RegistryServer,
    mirror: FaultProxy,
    checkpoint: Path,
    tmp_path: Path,
) -> None:
    blobs = _setup(registry, mirror_registry, checkpoint, "mirrors/corrupt")
    big = blobs[0]
    mirror.add(Fault(match=blob_get(str(big.digest)), corrupt_at=big.size // 2, times=None))
    mark = registry.log_mark()
    _res, events = _pull_via(tmp_path, origin, f"http://{mirror.host}", "mirrors/corrupt", checkpoint)
    # the origin served that one blob whole (once); the mirror, caught serving bytes that are not
    # the blob, is not asked for the blobs it had not started yet (``Mirror.lied``)
    assert origin.blob_bytes[str(big.digest)] == big.size
    assert [p.rsplit("/", 1)[1] for p in _origin_blob_gets(registry, mark)].count(str(big.digest)) == 1
    gone = _abandoned(events)
    assert len(gone) == 1 and "digest mismatch" in gone[0]["reason"] and gone[0]["blob"] == str(big.digest)


def test_mirror_stalling_is_abandoned_within_its_short_budget(
    registry: RegistryServer,
    origin: FaultProxy,
    mirror_registry: RegistryServer,
    mirror: FaultProxy,
    checkpoint: Path,
    tmp_path: Path,
) -> None:
    blobs = _setup(registry, mirror_registry, checkpoint, "mirrors/stall")
    big = blobs[0]
    mirror.add(Fault(match=blob_get(str(big.digest)), stall=20, times=None))
    started = time.monotonic()
    _res, events = _pull_via(
        tmp_path, origin, f"http://{mirror.host}", "mirrors/stall", checkpoint, stall_s=0.5
    )
    took = time.monotonic() - started
    assert dict(origin.blob_bytes) == {str(big.digest): big.size}
    gone = _abandoned(events)
    assert len(gone) == 1 and gone[0]["blob"] == str(big.digest) and gone[0]["offset"] == 0
    assert took < 20, took


def test_node_cache_and_loader_ranges_go_through_the_mirror(
    registry: RegistryServer,
    origin: FaultProxy,
    mirror_registry: RegistryServer,
    mirror: FaultProxy,
    checkpoint: Path,
    tmp_path: Path,
) -> None:
    from modelpack.loader.readers import TargetReader
    from modelpack.mount import NodeCache

    blobs = _setup(registry, mirror_registry, checkpoint, "mirrors/cache")
    big = blobs[0]
    mirror.add(Fault(match=blob_get(str(big.digest)), corrupt_at=7, times=1))
    opts, _events = _options(tmp_path, f"http://{mirror.host}")
    result = NodeCache(str(tmp_path / "cache")).pull(f"{origin.host}/mirrors/cache:v1", opts)
    for f in checkpoint.glob("*.safetensors"):
        assert (Path(result.path) / f.name).read_bytes() == f.read_bytes()
    origin.settle()
    # the corrupted blob came whole from the origin (the mirror, caught, is not asked again in
    # that pull: ``Mirror.lied``)
    assert origin.blob_bytes[str(big.digest)] == big.size

    origin.clear()
    target = open_readable(f"{origin.host}/mirrors/cache:v1", opts)
    whole = open_readable(registry.ref("mirrors/cache", None)).fetch_range(big, 0, big.size)
    buf = bytearray(100_000)
    TargetReader(target, big).read_into(4321, memoryview(buf))
    assert bytes(buf) == whole[4321 : 4321 + len(buf)]
    origin.settle()
    assert sum(origin.blob_bytes.values()) == 0
    assert target.bytes_by_source() == {mirror.host: len(buf)}  # type: ignore[attr-defined]


def test_pull_through_registry_is_a_real_mirror_and_hosts_toml_selects_it(
    registry: RegistryServer,
    origin: FaultProxy,
    registry_factory: RegistryFactory,
    checkpoint: Path,
    tmp_path: Path,
) -> None:
    blobs = _setup(registry, None, checkpoint, "mirrors/through")
    cache = registry_factory.start(proxy_remote=registry.url)
    hosts = tmp_path / "certs.d" / origin.host
    hosts.mkdir(parents=True)
    (hosts / "hosts.toml").write_text(
        f'server = "http://{origin.host}"\n\n'
        f'[host."http://127.0.0.1:{free_port()}"]\n  capabilities = ["push"]\n\n'
        f'[host."http://{cache.host}"]\n  capabilities = ["pull", "resolve"]\n'
    )
    runner = CliRunner()
    for n in (1, 2):
        mark = cache.log_mark()
        out = runner.invoke(
            main,
            [
                "pull",
                "--hosts-dir",
                str(tmp_path / "certs.d"),
                "--json",
                f"{origin.host}/mirrors/through:v1",
                str(tmp_path / f"out{n}"),
            ],
        )
        assert out.exit_code == 0, out.output
        _same_files(tmp_path / f"out{n}", checkpoint, json.loads(out.stdout)["directory"]["paths"])
        assert json.loads(out.stdout)["bytesBySource"] == {cache.host: sum(d.size for d in blobs)}
        assert len([p for m, p, s in cache.requests_since(mark) if m == "GET" and "/blobs/" in p]) == len(
            blobs
        )
    origin.settle()
    assert sum(origin.blob_bytes.values()) == 0  # the client never fetched a blob from the origin


def test_mirror_configuration(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = tmp_path / "certs.d"
    (d / "reg.example:5000").mkdir(parents=True)
    (d / "reg.example:5000" / "hosts.toml").write_text(
        'server = "https://reg.example:5000"\n'
        '[host."https://m1.example"]\n  capabilities = ["pull"]\n  ca = "/ca.pem"\n'
        '[host."http://m2.example:81/v2"]\n  skip_verify = true\n'
        '  [host."http://m2.example:81/v2".header]\n    X-Dragonfly-Registry = ["https://reg.example:5000"]\n'
        '[host."https://push.example"]\n  capabilities = ["push"]\n'
    )
    found = hosts_toml_mirrors(str(d), "reg.example:5000")
    assert [(m.host, m.plain_http, m.ca_file, m.skip_verify) for m in found] == [
        ("m1.example", False, "/ca.pem", False),
        ("m2.example:81", True, None, True),
    ]
    assert found[1].headers == {"X-Dragonfly-Registry": "https://reg.example:5000"}
    assert hosts_toml_mirrors(str(d), "other.example") == []
    (d / "_default").mkdir()
    (d / "_default" / "hosts.toml").write_text('[host."http://fallback:5000"]\n')
    assert [m.host for m in hosts_toml_mirrors(str(d), "other.example")] == ["fallback:5000"]

    monkeypatch.setenv("MODELPACK_MIRRORS", "http://env1:5000, env2.example")
    got = configured_mirrors("reg.example:5000", TargetOptions.from_environ().mirrors, str(d))
    assert [m.host for m in got] == ["env1:5000", "env2.example", "m1.example", "m2.example:81"]
    # --mirror replaces the environment's list; the registry itself is never its own mirror
    got = configured_mirrors("reg.example:5000", ["https://reg.example:5000", "http://f:1"], str(d))
    assert [m.host for m in got] == ["f:1", "m1.example", "m2.example:81"]

    (d / "bad").mkdir()
    (d / "bad" / "hosts.toml").write_text("[host\n")
    with pytest.raises(MirrorConfigError, match=r"not valid TOML"):
        hosts_toml_mirrors(str(d), "bad")
    (d / "prefixed").mkdir()
    (d / "prefixed" / "hosts.toml").write_text('[host."https://m.example/some/prefix"]\n')
    with pytest.raises(MirrorConfigError, match="path prefix"):
        hosts_toml_mirrors(str(d), "prefixed")
    with pytest.raises(MirrorConfigError, match="--mirror"):
        configured_mirrors("reg.example", ["ftp://x"], str(d))


def test_a_full_spool_directory_falls_back_to_the_origin(
    registry: RegistryServer,
    origin: FaultProxy,
    mirror_registry: RegistryServer,
    checkpoint: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import subprocess
    import tempfile

    from modelpack.targets.registry import mirrors

    tiny = tmp_path / "tiny"
    tiny.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(tiny)]).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        blobs = _setup(registry, mirror_registry, checkpoint, "mirrors/fullspool")
        monkeypatch.setattr(mirrors, "SPOOL_IN_MEMORY", 1)  # every spool on disk, in the tiny tmpfs
        monkeypatch.setattr(tempfile, "tempdir", str(tiny))
        _pull_via(tmp_path, origin, f"http://{mirror_registry.host}", "mirrors/fullspool", checkpoint)
        # the blobs too big for the spool came from the origin; nothing is left in the tmpfs
        assert origin.blob_bytes[str(blobs[0].digest)] == blobs[0].size
        assert list(tiny.iterdir()) == []
    finally:
        subprocess.run(["umount", "-l", str(tiny)], check=False)


def test_loader_range_falls_back_when_the_mirror_errors(
    registry: RegistryServer,
    origin: FaultProxy,
    mirror_registry: RegistryServer,
    mirror: FaultProxy,
    checkpoint: Path,
    tmp_path: Path,
) -> None:
    from modelpack.loader.readers import TargetReader

    big = _setup(registry, mirror_registry, checkpoint, "mirrors/ranges")[0]
    mirror.add(Fault(match=blob_get(str(big.digest)), status=500, times=None))
    opts, events = _options(tmp_path, f"http://{mirror.host}")
    target = open_readable(f"{origin.host}/mirrors/ranges:v1", opts)
    whole = open_readable(registry.ref("mirrors/ranges", None)).fetch_range(big, 0, big.size)
    buf = bytearray(50_000)
    TargetReader(target, big).read_into(999, memoryview(buf))
    assert bytes(buf) == whole[999 : 999 + len(buf)]
    origin.settle()
    assert origin.blob_bytes[str(big.digest)] == len(buf)
    assert target.bytes_by_source() == {origin.host: len(buf)}  # type: ignore[attr-defined]
    gone = _abandoned(events)
    assert gone and gone[0]["offset"] == 999 and "500" in gone[0]["reason"]
