"""``audit`` streams tags, bounds pages and total tags, and says when it cut.

The attack: a registry answers ``tags/list`` with huge pages and an endless ``Link: rel=next``
(the reported case: 400,000-tag pages reached 1.5 GiB RSS in 37 s), or with endless empty
pages. The registry here is a small hostile loopback server; ``modelpack audit`` runs as a real
subprocess whose peak RSS (``wait4``) and wall time are measured.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.fixtures.loopback import LoopbackServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

MANIFEST = json.dumps(
    {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.empty.v1+json",
            "digest": "sha256:" + "44" * 32,
            "size": 2,
        },
        "layers": [],
    }
).encode()
MANIFEST_DIGEST = "sha256:" + hashlib.sha256(MANIFEST).hexdigest()


class EndlessTags(LoopbackServer):
    """``tags/list`` pages of ``per_page`` tags each, every page linking to the next, forever."""

    def __init__(self, per_page: int) -> None:
        self.pages = 0
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # headers and body in separate writes: no 40 ms ACK waits

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _send(self, status: int, body: bytes, headers: dict[str, str]) -> None:
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def do_GET(self) -> None:
                path, _, query = self.path.partition("?")
                if path == "/v2/":
                    self._send(200, b"{}", {"Content-Type": "application/json"})
                elif path == "/v2/_catalog":  # endless catalog pages, one repository each
                    server.pages += 1
                    page = int(query.rsplit("page=", 1)[1]) if "page=" in query else 0
                    body = json.dumps({"repositories": [f"r/m{page}"] if page < 3 else []}).encode()
                    link = f'</v2/_catalog?n=100&page={page + 1}>; rel="next"'
                    self._send(200, body, {"Content-Type": "application/json", "Link": link})
                elif path.endswith("/tags/list"):
                    server.pages += 1
                    page = int(query.rsplit("page=", 1)[1]) if "page=" in query else 0
                    tags = [f"p{page}-t{i}" for i in range(per_page)]
                    body = json.dumps({"name": "m/x", "tags": tags}).encode()
                    link = f'</v2/m/x/tags/list?n=1000&page={page + 1}>; rel="next"'
                    self._send(200, body, {"Content-Type": "application/json", "Link": link})
                elif "/manifests/" in path:
                    headers = {
                        "Content-Type": "application/vnd.oci.image.manifest.v1+json",
                        "Docker-Content-Digest": MANIFEST_DIGEST,
                    }
                    self._send(200, MANIFEST, headers)
                else:
                    self._send(404, b'{"errors":[{"code":"NOT_FOUND","message":"no"}]}', {})

            do_HEAD = do_GET

        super().__init__(Handler)


@pytest.fixture
def big_pages() -> Iterator[EndlessTags]:
    s = EndlessTags(per_page=100_000)
    yield s
    s.close()


@pytest.fixture
def empty_pages() -> Iterator[EndlessTags]:
    s = EndlessTags(per_page=0)
    yield s
    s.close()


_RSS_LINE = "\nmodelpack-test-maxrss-kib: "
# runs argv[2:], kills it after argv[1] seconds, passes its exit code on and appends its own peak
# RSS (wait4) to stderr
_LAUNCH = (
    "import os, subprocess, sys, threading\n"
    "p = subprocess.Popen(sys.argv[2:])\n"
    "t = threading.Timer(float(sys.argv[1]), p.kill)\n"
    "t.daemon = True\n"
    "t.start()\n"
    "_, status, usage = os.wait4(p.pid, 0)\n"
    f"sys.stderr.write({_RSS_LINE!r} + str(usage.ru_maxrss))\n"
    "sys.exit(os.waitstatus_to_exitcode(status))\n"
)


def _audit(*args: str, limit_s: float = 120) -> tuple[int, str, str, float, int]:
    """Run ``modelpack audit``: (exit code, stdout, stderr, seconds, peak RSS in MiB)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        start = time.monotonic()
        # started through a small launcher: a process forked from this (large) pytest process
        # inherits its memory high-water mark across exec, so its ru_maxrss would be ours
        cmd = [sys.executable, "-m", "modelpack.cli", "audit", *args, "--retry-for", "0"]
        proc = subprocess.Popen(
            [sys.executable, "-c", _LAUNCH, str(limit_s), *cmd],
            stdout=out,
            stderr=err,
            text=True,
            env={**os.environ, "CI": "1"},
        )
        proc.wait(timeout=limit_s + 30)
        took = time.monotonic() - start
        out.seek(0)
        err.seek(0)
        stderr = err.read()
        head, found, rss_kib = stderr.rpartition(_RSS_LINE)
        if not found:
            return proc.returncode, out.read(), stderr, took, 0
        return proc.returncode, out.read(), head, took, int(rss_kib) // 1024


def test_endless_huge_tag_pages_are_cut_at_the_tag_bound(big_pages: EndlessTags) -> None:
    code, out, err, took, _ = _audit(f"{big_pages.host}/m/x", "--max-tags", "300", "--json")
    assert code == 0, err
    assert took < 60, took
    [repo] = json.loads(out)["repositories"]
    assert len(repo["tags"]) == 300
    assert repo["cut"] and "300" in repo["cut"] and "--max-tags" in repo["cut"], repo["cut"]
    assert big_pages.pages <= 2  # streamed: the listing stopped at the bound, no page fetched after
    # the text output says so too
    code, out, err, _, _ = _audit(f"{big_pages.host}/m/x", "--max-tags", "300")
    assert code == 0 and "cut" in (out + err) and "--max-tags" in (out + err), out + err


def test_the_default_tag_bound_holds_memory_and_time(big_pages: EndlessTags) -> None:
    """With the default bound (10,000 tags), a registry of endless 100,000-tag pages costs a
    bounded RSS and time, and the cut is reported."""
    code, out, err, took, rss = _audit(f"{big_pages.host}/m/x", "--json", limit_s=200)
    assert code == 0, err
    [repo] = json.loads(out)["repositories"]
    assert len(repo["tags"]) == 10_000 and "10000" in repo["cut"], repo["cut"]
    assert rss and rss < 400, rss
    assert took < 180, took


def test_endless_empty_pages_are_cut_at_the_page_bound(empty_pages: EndlessTags) -> None:
    code, out, err, took, _ = _audit(f"{empty_pages.host}/m/x", "--json", limit_s=200)
    assert code == 0, err
    [repo] = json.loads(out)["repositories"]
    assert repo["tags"] == {} and "pages" in repo["cut"], repo
    assert empty_pages.pages <= 2_001
    assert took < 180, took


def test_ls_refuses_a_listing_past_its_bound(big_pages: EndlessTags) -> None:
    """``ls`` prints every tag it lists, so a cut listing would look complete: past ``--max-tags``
    it stops with an error naming the bound (before: it resolved tags until killed)."""
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "modelpack.cli", "ls", f"{big_pages.host}/m/x", "--max-tags", "50"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "50" in proc.stderr and "--max-tags" in proc.stderr, proc.stderr
    assert time.monotonic() - start < 60 and big_pages.pages == 1


def test_an_endless_catalog_is_cut_at_the_page_bound(empty_pages: EndlessTags) -> None:
    code, out, err, took, _ = _audit(empty_pages.host, "--json", limit_s=200)
    assert code == 0, err
    repos = json.loads(out)["repositories"]
    assert [r["repository"] for r in repos][:3] == [f"{empty_pages.host}/r/m{i}" for i in range(3)]
    assert repos[-1]["repository"] == "_catalog" and "pages" in repos[-1]["cut"], repos[-1]
    assert took < 180, took
    code, out, err, _, _ = _audit(empty_pages.host, limit_s=200)
    assert code == 0 and "CUT _catalog" in err, err
