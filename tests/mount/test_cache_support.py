"""Helpers for the node-cache tests (and a test of the helpers themselves).

The fault tests count bytes and blob GETs through ``tests.fixtures.faultproxy.FaultProxy`` (no
faults added): that is how they measure "each blob was served once" and "a resumed pull
re-downloaded only the missing part", and how they slow a pull down (``rate``) enough to
``kill -9`` it mid-blob. ``run_pull_process`` runs a pull in a separate Python process (a real second process
with its own locks), printing the ``PullResult`` as JSON. ``FaultySource`` is a real OCI layout
whose stream of one blob breaks after N bytes, and ``pack_layout`` packs the checkpoint into
one (the serverless cache tests: ``test_cache_store``, ``test_cache_locks``).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, BinaryIO

import pytest

from modelpack import api
from modelpack.errors import ModelpackError
from modelpack.oci.descriptor import Descriptor, Manifest
from modelpack.oci.digest import Digest
from modelpack.targets.layout import OCILayoutTarget
from tests.fixtures.faultproxy import FaultProxy
from tests.paths import REPO_ROOT

_BLOB_RE = re.compile(r"/v2/.+/blobs/(sha256:[0-9a-f]{64})$")
_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "te", "trailer", "upgrade"}


PULL_SCRIPT = """
import json, sys
from modelpack.mount import NodeCache
from modelpack.targets.opener import TargetOptions
cache, ref = sys.argv[1], sys.argv[2]
extra = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
c = NodeCache(cache, stale_after=extra.pop("stale_after", 60.0))
try:
    r = c.pull(ref, TargetOptions(plain_http=True), jobs=extra.get("jobs", 4))
except Exception as exc:
    print(json.dumps({"error": type(exc).__name__, "message": str(exc)}))
    sys.exit(3)
print(json.dumps(r.to_json()))
"""


def pull_process(cache: Path, ref: str, **extra: Any) -> subprocess.Popen[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO_ROOT)
    return subprocess.Popen(
        [sys.executable, "-c", PULL_SCRIPT, str(cache), ref, json.dumps(extra)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=str(REPO_ROOT),
    )


def finish(proc: subprocess.Popen[str], timeout: float = 120) -> dict[str, Any]:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"pull process failed ({proc.returncode}): {out}\n{err[-3000:]}"
    doc: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return doc


def push_model(checkpoint: Path, registry_host: str, repo: str, tag: str = "v1") -> str:
    """Pack + push ``checkpoint`` straight to the registry; returns the manifest digest."""
    from modelpack.targets.opener import TargetOptions

    res = api.pack(str(checkpoint), f"{registry_host}/{repo}:{tag}", None, TargetOptions(plain_http=True))
    return str(res.artifact.digest)


def partial_bytes(cache: Path) -> dict[str, int]:
    """Bytes of each partial blob in the cache's ingest, read while a pull may still be writing
    (a partial it commits between the listing and the stat is gone: not counted)."""
    out: dict[str, int] = {}
    for p in (cache / "ingest").glob("*.partial") if (cache / "ingest").exists() else []:
        try:
            out["sha256:" + p.name.split(".")[0]] = p.stat().st_size
        except FileNotFoundError:
            continue
    return out


def kill_9_once_partial(proc: subprocess.Popen[str], cache: Path, at_least: int) -> None:
    """SIGKILL ``proc`` (a pull or a streamed load into ``cache``) once its partial blobs hold
    ``at_least`` bytes, and reap it; fails if it ended first or never got there in 60 s."""
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if sum(partial_bytes(cache).values()) > at_least:
                break
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL


def committed(cache: Path) -> set[str]:
    return {"sha256:" + p.name for p in (cache / "blobs" / "sha256").iterdir() if len(p.name) == 64}


# --------------------------------------------------------------------------- a faulty layout source
class Interrupted(ModelpackError):
    """What ``FaultySource`` raises where its stream breaks (a dropped connection)."""


class FaultySource:
    """A real layout whose blob stream for one digest breaks after ``after`` bytes (a dropped
    connection), and which counts what it served."""

    def __init__(self, layout: OCILayoutTarget, digest: str | None = None, after: int = 0) -> None:
        self.layout = layout
        self.name = layout.name
        self.digest = digest
        self.after = after
        self.served: dict[str, int] = {}
        self.offsets: list[tuple[str, int]] = []

    def __getattr__(self, item: str) -> Any:
        return getattr(self.layout, item)

    def fetch_blob(self, descriptor: Descriptor, offset: int = 0) -> BinaryIO:
        self.offsets.append((str(descriptor.digest), offset))
        f = self.layout.fetch_blob(descriptor, offset)
        src = self

        class Stream:
            def __init__(self) -> None:
                self.n = 0

            def read(self, n: int = -1) -> bytes:
                if src.digest == descriptor.digest and self.n >= src.after:
                    raise Interrupted("connection dropped")
                if src.digest == descriptor.digest:
                    n = min(n if n > 0 else 1 << 20, src.after - self.n)
                data = f.read(n)
                self.n += len(data)
                src.served[descriptor.digest] = src.served.get(descriptor.digest, 0) + len(data)
                return data

            def __enter__(self) -> Stream:
                return self

            def __exit__(self, *a: object) -> None:
                f.close()

        return Stream()  # type: ignore[return-value]


def pack_layout(checkpoint: Path, tmp_path: Path) -> tuple[OCILayoutTarget, Manifest]:
    """``checkpoint`` packed into an OCI layout under ``tmp_path`` as ``:v1``; (layout, manifest)."""
    api.pack(str(checkpoint), f"oci:{tmp_path / 'layout'}:v1")
    target = OCILayoutTarget(str(tmp_path / "layout"))
    manifest, _ = api.fetch_manifest(target, "v1")
    return target, manifest


# --------------------------------------------------------------------------- self-test
@pytest.mark.timeout(120)
def test_proxy_counts_blob_bytes(registry, checkpoint: Path) -> None:  # type: ignore[no-untyped-def]
    import requests

    digest = push_model(checkpoint, registry.host, "cache/proxy-selftest")
    proxy = FaultProxy(registry.host)
    try:
        manifest = requests.get(
            f"http://{proxy.host}/v2/cache/proxy-selftest/manifests/{digest}",
            headers={"Accept": "application/vnd.oci.image.manifest.v1+json"},
            timeout=10,
        )
        assert manifest.status_code == 200
        assert Digest.from_bytes(manifest.content) == digest
        layer = json.loads(manifest.content)["layers"][0]
        proxy.rate = 256 * 1024
        body = requests.get(
            f"http://{proxy.host}/v2/cache/proxy-selftest/blobs/{layer['digest']}", timeout=30
        )
        assert Digest.from_bytes(body.content) == layer["digest"]
        assert proxy.blob_gets[layer["digest"]] == 1
        assert proxy.blob_bytes[layer["digest"]] == layer["size"]
    finally:
        proxy.close()
