"""Helpers for the node-cache tests (and a test of the helpers themselves).

``CountingProxy`` is a byte-counting, optionally throttled HTTP proxy on 127.0.0.1 in front of a
real registry: it is how the fault tests measure "each blob was served once" and "a resumed pull
re-downloaded only the missing part", and how they slow a pull down enough to ``kill -9`` it
mid-blob. ``run_pull_process`` runs a pull in a separate Python process (a real second process
with its own locks), printing the ``PullResult`` as JSON.
"""

from __future__ import annotations

import http.client
import http.server
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from modelpack import api
from modelpack.oci.digest import Digest

_BLOB_RE = re.compile(r"/v2/.+/blobs/(sha256:[0-9a-f]{64})$")
_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "te", "trailer", "upgrade"}
REPO_ROOT = Path(__file__).resolve().parent.parent


class CountingProxy:
    """Forward GET/HEAD to ``upstream`` (host:port); count blob GETs and bytes per digest."""

    def __init__(self, upstream: str, *, rate: float | None = None) -> None:
        self.upstream = upstream
        self.rate = rate  # bytes per second per response, None = unthrottled
        self.lock = threading.Lock()
        self.blob_gets: Counter[str] = Counter()
        self._blob_bytes: Counter[str] = Counter()
        self.requests: list[tuple[str, str, int]] = []
        self.active = 0
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _forward(self, method: str) -> None:
                with proxy.lock:
                    proxy.active += 1
                try:
                    self._relay(method)
                finally:
                    with proxy.lock:
                        proxy.active -= 1

            def _relay(self, method: str) -> None:
                conn = http.client.HTTPConnection(proxy.upstream, timeout=60)
                headers = {
                    k: v for k, v in self.headers.items() if k.lower() not in _HOP and k.lower() != "host"
                }
                headers["Host"] = proxy.upstream
                conn.request(method, self.path, headers=headers)
                resp = conn.getresponse()
                m = _BLOB_RE.match(self.path.split("?", 1)[0])
                digest = m.group(1) if m and method == "GET" else None
                with proxy.lock:
                    proxy.requests.append((method, self.path, resp.status))
                    if digest and resp.status in (200, 206):
                        proxy.blob_gets[digest] += 1
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in _HOP:
                        self.send_header(k, v)
                self.send_header("Connection", "close")
                self.end_headers()
                if method == "HEAD":
                    conn.close()
                    return
                try:
                    while True:
                        chunk = resp.read(16 * 1024)
                        if not chunk:
                            break
                        self.wfile.write(chunk)
                        if digest:
                            with proxy.lock:
                                proxy._blob_bytes[digest] += len(chunk)
                        rate = proxy.rate
                        if rate:
                            time.sleep(len(chunk) / rate)
                except (BrokenPipeError, ConnectionResetError):
                    pass
                finally:
                    conn.close()

            def do_GET(self) -> None:
                self._forward("GET")

            def do_HEAD(self) -> None:
                self._forward("HEAD")

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.server.server_address[1]}"

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Wait until no response is being relayed (a killed client's stream takes a moment)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if self.active == 0:
                    return
            time.sleep(0.01)
        raise AssertionError("proxy still relaying after the client went away")

    def reset(self) -> None:
        with self.lock:
            self.blob_gets.clear()
            self._blob_bytes.clear()
            self.requests.clear()

    def settle(self, timeout: float = 10.0) -> None:
        """Wait until no relay is running: a client can hold a whole response before the relay
        thread that wrote it has counted the last chunk."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if self.active == 0:
                    return
            time.sleep(0.01)

    @property
    def blob_bytes(self) -> Counter[str]:
        self.settle()
        with self.lock:
            return Counter(self._blob_bytes)

    def total_blob_bytes(self) -> int:
        return sum(self.blob_bytes.values())

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


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
    out = {}
    for p in (cache / "ingest").glob("*.partial"):
        out["sha256:" + p.name.split(".")[0]] = p.stat().st_size
    return out


def committed(cache: Path) -> set[str]:
    return {"sha256:" + p.name for p in (cache / "blobs" / "sha256").iterdir() if len(p.name) == 64}


# --------------------------------------------------------------------------- self-test
@pytest.mark.timeout(120)
def test_proxy_counts_blob_bytes(registry, checkpoint: Path) -> None:  # type: ignore[no-untyped-def]
    import requests

    digest = push_model(checkpoint, registry.host, "cache/proxy-selftest")
    proxy = CountingProxy(registry.host)
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
        proxy.stop()
