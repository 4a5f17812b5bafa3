"""One download per node: concurrent pulls into one cache fetch each manifest and blob once.

Real parts: a real registry behind a throttled fault proxy (so two pulls overlap: the first
still holds a blob's or a manifest's lock when the second asks for it), two real ``modelpack
pull --cache`` processes on one cache directory; the proxy counts the origin's GETs. What is
checked: the re-check after a blob lock (a waiter finds the blob the holder committed) and the
re-check after the manifest lock (a waiter finds the snapshot the holder published).
"""

from __future__ import annotations

import concurrent.futures
import subprocess
from pathlib import Path

import pytest

from modelpack.api import transfer
from modelpack.oci.descriptor import Manifest
from modelpack.targets.fetch import fetch_manifest
from modelpack.targets.opener import open_readable
from tests.fixtures.faultproxy import FaultProxy
from tests.fixtures.registry import RegistryServer
from tests.mount.test_cache_serve import _cli, _env

pytestmark = pytest.mark.timeout(180)

#: the link's rate: each ~2 MB layer takes about 2 s, so two pulls started together overlap
RATE = 1024 * 1024


def _push(registry: RegistryServer, checkpoint: Path, repo: str) -> tuple[str, Manifest]:
    res = transfer.push(str(checkpoint), registry.ref(repo, "v1"), progress="off")
    return str(res.digest), fetch_manifest(open_readable(registry.ref(repo, None)), res.digest)[0]


def _pull_together(tmp_path: Path, cache: Path, refs: list[str]) -> None:
    def pull(ref: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            _cli("pull", "--cache", str(cache), "--retry-for", "10s", ref),
            env=_env(tmp_path),
            capture_output=True,
            text=True,
            timeout=120,
        )

    with concurrent.futures.ThreadPoolExecutor(len(refs)) as pool:
        for res in pool.map(pull, refs):
            assert res.returncode == 0, res.stderr


def test_two_different_manifests_pulled_at_once_download_their_shared_blobs_once(
    registry: RegistryServer, checkpoint: Path, tmp_path: Path
) -> None:
    """Two models that share their weight blobs (only a small file differs), pulled at once into
    one cache by two processes: each shared blob crosses the link once (the second pull waits
    on the blob's lock and then finds it committed), each model's own blobs once."""
    first, m1 = _push(registry, checkpoint, "once/a")
    (checkpoint / "README.md").write_text("the other model\n")
    second, m2 = _push(registry, checkpoint, "once/b")
    shared = {str(d.digest) for d in m1.layers} & {str(d.digest) for d in m2.layers}
    assert len(shared) >= 2 and first != second
    proxy = FaultProxy(registry.host, rate=RATE)
    try:
        _pull_together(
            tmp_path, tmp_path / "cache", [f"{proxy.host}/once/a@{first}", f"{proxy.host}/once/b@{second}"]
        )
        proxy.settle()
        assert {d: proxy.blob_gets[d] for d in shared} == dict.fromkeys(shared, 1)
        every = {str(d.digest) for m in (m1, m2) for d in (m.config, *m.layers)}
        assert set(proxy.blob_gets) == every and all(n == 1 for n in proxy.blob_gets.values())
    finally:
        proxy.close()


def test_one_manifest_pulled_twice_at_once_is_fetched_once(
    registry: RegistryServer, checkpoint: Path, tmp_path: Path
) -> None:
    """Two processes pull the same pinned model into one cache at once: the second waits on the
    manifest's lock and finds the snapshot the first published (one GET of the manifest under
    the lock, one GET per blob), instead of fetching the manifest again. Each pull also asks
    once, before the lock, whether the pinned digest names a variant index: 2 + 1 GETs."""
    digest, _manifest = _push(registry, checkpoint, "once/same")
    proxy = FaultProxy(registry.host, rate=RATE)
    try:
        ref = f"{proxy.host}/once/same@{digest}"
        _pull_together(tmp_path, tmp_path / "cache", [ref, ref])
        proxy.settle()
        manifest_gets = [p for _t, m, p, s in proxy.log if m == "GET" and p.endswith(f"/manifests/{digest}")]
        assert len(manifest_gets) == 2 + 1, manifest_gets
        assert all(n == 1 for n in proxy.blob_gets.values()), proxy.blob_gets
    finally:
        proxy.close()
