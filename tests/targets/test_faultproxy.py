"""The fault proxy itself: relays pushes and pulls unchanged, and cuts, forges and refuses on cue."""

from __future__ import annotations

from pathlib import Path

import pytest
import requests

from modelpack import api
from modelpack.api import transfer
from tests.fixtures.faultproxy import Fault, FaultProxy, blob_get, manifest_get


def test_relays_push_and_pull_and_injects_faults(registry, checkpoint: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    proxy = FaultProxy(registry.host)
    try:
        ref = f"{proxy.host}/faultproxy/model:v1"
        transfer.push(str(checkpoint), ref)
        assert any(m == "PUT" for m, _, _ in proxy.requests)
        manifest, _ = api.fetch_manifest(*_target(ref))
        layer = max(manifest.layers, key=lambda d: d.size)
        url = f"http://{proxy.host}/v2/faultproxy/model/blobs/{layer.digest}"
        whole = requests.get(url, timeout=10).content
        assert len(whole) == layer.size

        proxy.add(Fault(match=blob_get(str(layer.digest)), cut_after=1000))
        with pytest.raises(requests.exceptions.ChunkedEncodingError):
            requests.get(url, timeout=10).content  # noqa: B018
        proxy.add(Fault(match=blob_get(str(layer.digest)), rewrite=lambda body, rng: body[::-1]))
        assert requests.get(url, timeout=10).content == whole[::-1]
        proxy.add(Fault(match=manifest_get("v1"), status=503))
        assert (
            requests.get(f"http://{proxy.host}/v2/faultproxy/model/manifests/v1", timeout=10).status_code
            == 503
        )
        assert requests.get(url, timeout=10).content == whole  # every fault was used up
        assert sum(proxy.fired.values()) == 3
    finally:
        proxy.close()


def _target(ref: str):  # type: ignore[no-untyped-def]
    from modelpack.oci.reference import parse_reference
    from modelpack.targets.opener import open_readable

    parsed = parse_reference(ref)
    return open_readable(parsed), parsed.identifier


def test_skip_before_headers_body_and_the_request_log(registry) -> None:  # type: ignore[no-untyped-def]
    """A fault lets its first ``skip`` matches through, runs ``before`` ahead of relaying, answers
    with the headers and body it was given, and ``log`` records every request with its answer."""
    proxy = FaultProxy(registry.host)
    calls: list[str] = []
    try:
        url = f"http://{proxy.host}/v2/"
        proxy.add(Fault(match=lambda m, p, h: p == "/v2/", skip=1, times=1, before=lambda: calls.append("x")))
        proxy.add(
            Fault(
                match=lambda m, p, h: p == "/v2/",
                status=429,
                headers={"Retry-After": "3"},
                body=b'{"errors":[{"code":"TOOMANYREQUESTS"}]}',
            )
        )
        first = requests.get(url, timeout=10)  # skipped by the first fault, answered by the second
        assert first.status_code == 429 and first.headers["Retry-After"] == "3"
        assert b"TOOMANYREQUESTS" in first.content
        second = requests.get(url, timeout=10)  # the first fault fires: before(), then relayed
        assert second.status_code == 200 and calls == ["x"]
        assert [(m, p, s) for _, m, p, s in proxy.log] == [("GET", "/v2/", 429), ("GET", "/v2/", 200)]
        assert proxy.log[0][0] <= proxy.log[1][0]
    finally:
        proxy.close()
