"""Signatures through peers — a signed, pinned start with the origin down.

Real parts: a real origin registry (killed for the outage), ``modelpack push --sign-key`` (a
manifest signature, a directory signature and a signed chunk table as referrers), real ``modelpack
pull --cache … --key`` and ``modelpack cache serve`` subprocesses on loopback.

Before this change the node cache kept no signatures and ``cache serve`` answered no referrers,
so ``pull --cache REF@sha256:… --key K --mirror PEER`` with the origin down was refused as
unsigned although the peer had verified the very same model.
"""

from __future__ import annotations

import http.server
import json
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

from tests.fixtures.loopback import LoopbackServer
from tests.origin_down_support import events, push_signed, run, serve, signed_peer, warm_node  # noqa: F401 (the fixture)

pytestmark = pytest.mark.timeout(240)

SIGNATURE = "application/vnd.dev.sigstore.bundle.v0.3+json"


def _get(url: str) -> tuple[int, dict[str, str], bytes]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.status, dict(resp.headers), resp.read()


def test_a_signed_pinned_pull_succeeds_from_a_peer_with_the_origin_down(
    registry_factory: Any,
    checkpoint: Path,
    tmp_path: Path,
    serve: Any,  # noqa: F811
) -> None:
    origin, model, peer = signed_peer(registry_factory, checkpoint, tmp_path, serve, "peers/signed")

    # the peer answers the referrers API with what node A verified: all three kinds, filterable
    status, headers, body = _get(f"{peer.url}/v2/{model.repo}/referrers/{model.digest}")
    index = json.loads(body)
    assert status == 200 and headers["Content-Type"] == "application/vnd.oci.image.index.v1+json"
    kinds = sorted(m["artifactType"] for m in index["manifests"])
    assert len(kinds) == 3 and SIGNATURE in kinds, kinds
    _, headers, body = _get(
        f"{peer.url}/v2/{model.repo}/referrers/{model.digest}?artifactType={quote(SIGNATURE, safe='')}"
    )
    assert [m["artifactType"] for m in json.loads(body)["manifests"]] == [SIGNATURE]
    assert headers.get("OCI-Filters-Applied") == "artifactType"
    # a digest it holds nothing for: an empty index (the API's answer), never the tag fallback
    _, _, body = _get(f"{peer.url}/v2/{model.repo}/referrers/sha256:{'0' * 64}")
    assert json.loads(body)["manifests"] == []

    origin.kill()
    log = tmp_path / "b-events.jsonl"
    started = time.monotonic()
    b = run(
        tmp_path,
        "pull", "--cache", str(tmp_path / "node-b"), "--key", model.pub, "--mirror", peer.url,
        "--retry-for", "2s", "--events", str(log), "--json", model.pinned,
    )  # fmt: skip
    assert b.returncode == 0, b.stderr
    doc = json.loads(b.stdout)
    assert doc["signature"] == "verified" and doc["digest"] == model.digest
    # every blob byte came from the peer; the one origin attempt cost one short retry budget
    assert set(doc["bytesBySource"]) == {peer.host}, doc
    assert time.monotonic() - started < 30
    listed = [e for e in events(log) if e["event"] == "registry.referrers_listed"]
    assert listed and all(e["source"] == peer.url and e["source_kind"] == "mirror" for e in listed), listed
    assert sum(e["referrers"] for e in listed) == 3
    fetched = [e for e in events(log) if e["event"] == "registry.manifest_fetched"]
    assert {e["source"] for e in fetched} == {peer.url} and all(e["bytes"] > 0 for e in fetched)
    # node B keeps what it verified: it can be a peer itself, for node C
    peer_b = serve(tmp_path / "node-b")
    c = run(
        tmp_path,
        "pull", "--cache", str(tmp_path / "node-c"), "--key", model.pub, "--mirror", peer_b.url,
        "--retry-for", "2s", model.pinned,
    )  # fmt: skip
    assert c.returncode == 0, c.stderr

    # a tag cannot be resolved by a peer: a typed error naming the origin, no traceback
    tagged = run(
        tmp_path, "pull", "--cache", str(tmp_path / "node-d"), "--key", model.pub, "--mirror", peer.url,
        "--retry-for", "2s", model.tagged,
    )  # fmt: skip
    assert tagged.returncode != 0 and origin.host in tagged.stderr and "Traceback" not in tagged.stderr


def test_a_peer_withholding_signatures_is_a_refusal_naming_the_digest_not_a_hang(
    registry_factory: Any,
    checkpoint: Path,
    tmp_path: Path,
    serve: Any,  # noqa: F811
) -> None:
    # node A pulled without a key: it holds the model, but verified (and so keeps) no signature
    origin, model, peer = signed_peer(
        registry_factory, checkpoint, tmp_path, serve, "peers/withheld", key=False
    )
    origin.kill()
    started = time.monotonic()
    b = run(
        tmp_path,
        "pull", "--cache", str(tmp_path / "node-b"), "--key", model.pub, "--mirror", peer.url,
        "--retry-for", "2s", model.pinned,
    )  # fmt: skip
    assert b.returncode != 0 and time.monotonic() - started < 30
    assert model.digest in b.stderr and "Traceback" not in b.stderr, b.stderr
    assert "unsigned" in b.stderr or "no signature" in b.stderr, b.stderr
    # nothing was marked ready
    assert not list((tmp_path / "node-b" / "snapshots").glob("*.ready"))


class _HugeIndexPeer(http.server.BaseHTTPRequestHandler):
    """A peer whose referrers index is 5 MiB (over the 4 MiB bound) and that has nothing else."""

    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        if self.path in ("/v2", "/v2/"):
            self._reply(200, b"{}", "application/json")
        elif "/referrers/" in self.path:
            entry = {
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "digest": "sha256:" + "1" * 64,
                "size": 1,
            }
            entries = ",".join([json.dumps(entry)] * 40_000)
            body = (
                '{"schemaVersion":2,"mediaType":"application/vnd.oci.image.index.v1+json","manifests":['
                + entries
                + "]}"
            ).encode()
            self._reply(200, body, "application/vnd.oci.image.index.v1+json")
        else:
            self._reply(404, b'{"errors":[{"code":"MANIFEST_UNKNOWN"}]}', "application/json")

    def _reply(self, status: int, body: bytes, ctype: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def test_a_peer_cannot_forge_trust_a_withholding_one_hides_no_honest_one_and_a_huge_index_is_refused(
    registry_factory: Any,
    checkpoint: Path,
    tmp_path: Path,
    serve: Any,  # noqa: F811
) -> None:
    origin = registry_factory.start()
    model = push_signed(origin, checkpoint, tmp_path, "peers/forged")
    honest = tmp_path / "honest"
    warm_node(tmp_path, honest, model)
    withholding = tmp_path / "withholding"
    warm_node(tmp_path, withholding, model, key=False)
    # a forging peer: the same model (packing is reproducible: the same digest), signed with its
    # own key — valid signatures, by a key this node does not trust
    forger = registry_factory.start()
    forged = push_signed(forger, checkpoint, tmp_path / "forger", "peers/forged")
    assert forged.digest == model.digest
    peer_h, peer_w = serve(honest), serve(withholding)
    huge = LoopbackServer(_HugeIndexPeer)
    origin.kill()
    try:

        def pull(node: str, *mirrors: str) -> subprocess.CompletedProcess[str]:
            flags = [x for m in mirrors for x in ("--mirror", m)]
            return run(
                tmp_path, "pull", "--cache", str(tmp_path / node), "--key", model.pub, *flags,
                "--retry-for", "2s", "--events", str(tmp_path / f"{node}.jsonl"), model.pinned,
            )  # fmt: skip

        started = time.monotonic()
        by_forger = pull("b1", f"http://{forger.host}")
        assert by_forger.returncode != 0 and model.digest in by_forger.stderr, by_forger.stderr
        assert "not by a trusted key" in by_forger.stderr or "untrusted" in by_forger.stderr, by_forger.stderr
        assert not list((tmp_path / "b1" / "snapshots").glob("*.ready"))

        # the withholding peer asked first hides nothing: the honest peer's listing is merged in
        both = pull("b2", peer_w.url, peer_h.url)
        assert both.returncode == 0, both.stderr
        listed = {
            e["source"]: e["referrers"]
            for e in events(tmp_path / "b2.jsonl")
            if e["event"] == "registry.referrers_listed"
        }
        assert listed.get(peer_w.url) == 0 and listed.get(peer_h.url, 0) > 0, listed

        # an oversized index is refused while it is read (bounded), then the model is refused as
        # unsigned, naming the digest: no hang, no partial snapshot
        by_huge = pull("b3", f"http://{huge.host}", peer_w.url)
        assert by_huge.returncode != 0 and model.digest in by_huge.stderr, by_huge.stderr
        left = [e for e in events(tmp_path / "b3.jsonl") if e["event"] == "registry.mirror_abandoned"]
        assert any(e["source"] == f"http://{huge.host}" and "4 MiB" in e["reason"] for e in left), left
        assert time.monotonic() - started < 90
    finally:
        huge.close()


class _JunkListingPeer(http.server.BaseHTTPRequestHandler):
    """A peer that lists 1,000 junk referrers for any digest (each of the type asked for, plus
    some untyped and some of other types), and has none of them nor anything else."""

    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        if self.path in ("/v2", "/v2/"):
            self._reply(200, b"{}", "application/json")
        elif "/referrers/" in self.path:
            from urllib.parse import parse_qs, urlsplit

            wanted = parse_qs(urlsplit(self.path).query).get("artifactType", [SIGNATURE])[0]
            entries = []
            for i in range(1000):
                entry: dict[str, Any] = {
                    "mediaType": "application/vnd.oci.image.manifest.v1+json",
                    "digest": "sha256:" + f"{i:064x}",
                    "size": 1234,
                }
                if i % 10 == 1:
                    entry["artifactType"] = "application/vnd.example.junk"
                elif i % 10 != 2:
                    entry["artifactType"] = wanted
                entries.append(entry)
            entries += entries[:100]  # and the same digests again
            body = json.dumps(
                {
                    "schemaVersion": 2,
                    "mediaType": "application/vnd.oci.image.index.v1+json",
                    "manifests": entries,
                }
            ).encode()
            self._reply(200, body, "application/vnd.oci.image.index.v1+json")
        else:
            time.sleep(0.05)  # a little slow for each junk digest, as a real flooder would be
            self._reply(404, b'{"errors":[{"code":"MANIFEST_UNKNOWN"}]}', "application/json")

    def _reply(self, status: int, body: bytes, ctype: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def test_a_peer_flooding_junk_referrers_hides_no_honest_signature(
    registry_factory: Any,
    checkpoint: Path,
    tmp_path: Path,
    serve: Any,  # noqa: F811
) -> None:
    """With the origin down, a peer listing 1,000 junk referrers (asked first) neither hides the
    honest peer's signatures nor costs more than a few seconds: each peer's listing has a budget,
    only entries of the type asked for count, and duplicates are dropped."""
    origin, model, honest = signed_peer(registry_factory, checkpoint, tmp_path, serve, "peers/flooded")
    junk = LoopbackServer(_JunkListingPeer)
    origin.kill()
    try:
        started = time.monotonic()
        b = run(
            tmp_path,
            "pull", "--cache", str(tmp_path / "node-b"), "--key", model.pub,
            "--mirror", f"http://{junk.host}", "--mirror", honest.url,
            "--retry-for", "2s", "--events", str(tmp_path / "b.jsonl"), "--json", model.pinned,
        )  # fmt: skip
        took = time.monotonic() - started
        print(f"signed pinned pull with a junk-flooding peer first: {took:.1f} s")
        assert b.returncode == 0, b.stderr
        assert json.loads(b.stdout)["signature"] == "verified"
        assert took < 20, took
    finally:
        junk.close()
