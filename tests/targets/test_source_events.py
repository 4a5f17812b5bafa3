"""Events say which source served what, and why a source was left.

Real parts: a real origin registry, a real second registry as a mirror that lacks the model, a
closed loopback port, and the hostile loopback mirror of ``tests/fixtures/hostile_mirror.py``
(zeroed bytes, a crawl under the throughput floor, silence past the stall limit). Each pull
goes through ``modelpack.api.transfer.pull`` with the JSON event log the CLI's ``--events`` uses.

Before this change an abandonment named only the mirror's host and a free-text reason, a blob
the origin served alone was in no event, and manifest fetches were in none.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from modelpack.api import transfer
from modelpack.events import EventLog, read_events
from modelpack.targets.fetch import fetch_manifest
from modelpack.targets.opener import TargetOptions, open_readable
from modelpack.targets.options import MirrorThresholds
from tests.fixtures.hostile_mirror import HostileMirror, push_and_read_back
from tests.fixtures.loopback import free_port

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def hostile() -> Iterator[list[HostileMirror]]:
    made: list[HostileMirror] = []
    yield made
    for m in made:
        m.close()


@pytest.mark.parametrize("mode", ["missing", "refused", "zero", "crawl", "silent"])
def test_each_abandonment_names_the_source_and_why_and_each_blob_its_sources(
    mode: str,
    registry_factory: Any,
    checkpoint: Path,
    tmp_path: Path,
    hostile: list[HostileMirror],
) -> None:
    origin = registry_factory.start()
    digest, manifest, blobs = push_and_read_back(origin, checkpoint, f"events/{mode}")
    thresholds = MirrorThresholds()
    if mode == "missing":
        url, expect = f"http://{registry_factory.start().host}", "not_found"
    elif mode == "refused":
        url, expect = f"http://127.0.0.1:{free_port()}", "connection_refused"
    else:
        m = HostileMirror(blobs, mode, interval=0.5, max_s=30)
        hostile.append(m)
        url = m.url
        expect = {"zero": "digest_mismatch", "crawl": "floor", "silent": "stall"}[mode]
        thresholds = MirrorThresholds(min_rate=65536, rate_window_s=1.0, stall_s=1.0)
    log = tmp_path / "events.jsonl"
    opts = TargetOptions(
        mirrors=[url], retry_for=1.0, events=EventLog(str(log)), mirror_thresholds=thresholds
    )
    res = transfer.pull(
        f"{origin.host}/events/{mode}@{digest}", str(tmp_path / "out"), target_options=opts, progress="off"
    )
    for f in checkpoint.glob("*.safetensors"):
        assert (tmp_path / "out" / f.name).read_bytes() == f.read_bytes()
    got = read_events(str(log))

    left = [e for e in got if e["event"] == "registry.mirror_abandoned"]
    assert left, got
    assert all(e["source"] == url and e["source_kind"] == "mirror" for e in left), left
    assert expect in {e["failure"] for e in left}, [(e["failure"], e["reason"]) for e in left]
    assert "@" not in "".join(e["source"] for e in left)  # never credentials

    # the manifest: from the origin (the mirror failed or lied), with its bytes
    fetched = [e for e in got if e["event"] == "registry.manifest_fetched" and e["manifest"] == digest]
    assert (
        fetched
        and fetched[-1]["source_kind"] == "origin"
        and fetched[-1]["bytes"]
        == len(fetch_manifest(open_readable(origin.ref(f"events/{mode}", None)), digest)[0].raw)
    )
    assert fetched[-1]["source"].endswith("://" + origin.host)
    # every layer pulled is in a blob event naming its sources (the origin here) and bytes
    sources = {e["blob"]: e for e in got if e["event"] == "registry.blob_sources"}
    for layer in manifest.layers:
        e = sources[str(layer.digest)]
        assert sum(e["sources"].values()) == layer.size == e["bytes"]
        assert origin.host in e["sources"] and e["source_urls"][origin.host].endswith("://" + origin.host)
        assert set(e["source_urls"].values()) <= {url, e["source_urls"][origin.host]}
    # the run's totals per source: what a crawler delivered before it was left counts as its own
    assert sum(res.bytes_by_source.values()) >= sum(layer.size for layer in manifest.layers)
    assert res.bytes_by_source[origin.host] > 0


def test_a_manifest_resolved_then_read_through_one_mirror_is_one_fetch_event(
    registry_factory: Any, checkpoint: Path, tmp_path: Path
) -> None:
    origin, mirror = registry_factory.start(), registry_factory.start()
    digest, _, _ = push_and_read_back(origin, checkpoint, "events/once")
    transfer.cp(origin.ref("events/once", "v1"), mirror.ref("events/once", "v1"), progress="off")
    log = tmp_path / "events.jsonl"
    opts = TargetOptions(mirrors=[f"http://{mirror.host}"], events=EventLog(str(log)))
    target = open_readable(f"{origin.host}/events/once@{digest}", opts)
    desc = target.resolve(digest)
    raw, _ = target.fetch_manifest(digest)
    assert desc.size == len(raw)
    fetched = [e for e in read_events(str(log)) if e["event"] == "registry.manifest_fetched"]
    assert [(e["source"], e["source_kind"], e["bytes"]) for e in fetched] == [
        (f"http://{mirror.host}", "mirror", len(raw))
    ]


@pytest.mark.parametrize("port", [40447, 4041, 51404])
def test_the_failure_kind_comes_from_the_error_not_from_digits_in_its_text(port: int) -> None:
    """CI saw a silent mirror on port 40447 reported as ``not_found``: the reason's text held
    "404" (the port). The kind is decided from the typed error, never by searching its text."""
    from modelpack.targets.registry.client import RegistryClient
    from modelpack.targets.registry.source_events import failure_kind

    client = RegistryClient(f"127.0.0.1:{port}", plain_http=True, timeout=1.0)
    stalled = client.connection_error(
        f"blob sha256:{'404' * 21}4 from 127.0.0.1:{port}/unknown/x", TimeoutError("timed out")
    )
    assert failure_kind(stalled) == "stall"
    refused = client.connection_error("manifest x", ConnectionRefusedError(111, "Connection refused"))
    assert failure_kind(refused) == "connection_refused"
    from modelpack.errors import RegistryError, RegistryNotFoundError

    assert failure_kind(RegistryNotFoundError("blob unknown", status=404)) == "not_found"
    assert failure_kind(RegistryError(f"127.0.0.1:{port}: blob upload unknown", status=500)) == "error"
