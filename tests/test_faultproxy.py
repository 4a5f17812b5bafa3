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
