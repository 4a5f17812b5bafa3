"""The node-cache CLI against a real registry: pull --cache, signature policy, cache maintenance."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from modelpack.signing import generate_key, sign_artifact
from modelpack.signing.keys import write_keypair

from modelpack.cli import main
from modelpack.events import read_events
from modelpack.oci.reference import parse_reference
from modelpack.targets.opener import TargetOptions
from modelpack.targets.registry.target import RegistryTarget
from tests.mount.test_cache_support import push_model

pytestmark = pytest.mark.timeout(180)


def _run(*args: str) -> tuple[int, str, str]:
    res = CliRunner().invoke(main, list(args))
    return res.exit_code, res.stdout, res.stderr


def test_pull_cache_json_then_hit_and_maintenance(registry, checkpoint: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    digest = push_model(checkpoint, registry.host, "cli/cache")
    cache = str(tmp_path / "cache")
    ref = registry.ref("cli/cache", "v1")
    code, out, err = _run("pull", ref, "--cache", cache, "--json", "--plain-http")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["digest"] == digest and doc["cache"]["state"] == "cold" and Path(doc["path"]).is_dir()
    assert doc["bytesDownloaded"] == doc["cache"]["bytes"]["total"] > 0
    code, out, err = _run("pull", f"{ref.rsplit(':', 1)[0]}@{digest}", "--cache", cache, "--events", "-")
    assert code == 0, err
    assert out.strip() == doc["path"]  # plain output: the snapshot path on stdout
    streamed = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    assert any(e["event"] == "cache.hit" and e["stage"] == "t4" for e in streamed)

    code, out, _ = _run("cache", "ls", "--cache", cache, "--json")
    listing = json.loads(out)
    assert code == 0 and [s["digest"] for s in listing["snapshots"]] == [digest]
    assert _run("cache", "path", ref, "--cache", cache)[1].strip() == doc["path"]
    assert _run("cache", "verify", "--cache", cache)[0] == 0
    assert _run("cache", "pin", ref, "--cache", cache)[0] == 0
    code, out, _ = _run("cache", "gc", "--cache", cache, "--max-bytes", "1", "--min-age", "0", "--json")
    assert code == 0 and json.loads(out)["keptPinned"] == [digest]
    assert _run("cache", "rm", ref, "--cache", cache)[0] == 1  # pinned
    assert _run("cache", "unpin", ref, "--cache", cache)[0] == 0
    code, out, _ = _run("cache", "gc", "--cache", cache, "--max-bytes", "1", "--min-age", "0", "--json")
    assert json.loads(out)["evicted"] == [digest]
    assert json.loads(_run("cache", "ls", "--cache", cache, "--json")[1])["snapshots"] == []
    code, _, err = _run("pull", ref, "--cache", cache, "--plain-http", "--max-cache-bytes", "1K")
    assert code == 1 and "quota" in err


def test_pull_cache_refuses_unsigned_and_accepts_signed(registry, checkpoint: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    digest = push_model(checkpoint, registry.host, "cli/signed")
    key = generate_key()
    _, pub = write_keypair(str(tmp_path / "ci"), key)
    cache = tmp_path / "cache"
    ref = registry.ref("cli/signed", "v1")
    code, out, err = _run("pull", ref, "--cache", str(cache), "--key", pub, "--plain-http")
    assert code == 1 and "refused" in err
    refused = [e for e in read_events(str(cache / "events.jsonl")) if e["event"] == "cache.signature_refused"]
    assert refused and refused[0]["digest"] == digest
    assert not list((cache / "snapshots").iterdir()) and not list((cache / "blobs" / "sha256").iterdir())

    target = RegistryTarget.from_reference(
        parse_reference(ref), TargetOptions(plain_http=True), for_write=True
    )
    sign_artifact(target, target.resolve("v1"), key, chunk_table=False, directory_signature=False)
    code, out, err = _run("pull", ref, "--cache", str(cache), "--key", pub, "--plain-http", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["digest"] == digest and doc["signature"] == "verified"


def test_push_format_image_then_pull_cache(registry, checkpoint: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    ref = registry.ref("cli/image", "v1")
    code, out, err = _run("push", str(checkpoint), ref, "--format", "image", "--plain-http", "--json")
    assert code == 0, err
    code, out, err = _run("pull", ref, "--cache", str(tmp_path / "cache"), "--plain-http")
    assert code == 0, err
    snap = Path(out.strip())
    for p in checkpoint.iterdir():
        assert (snap / p.name).read_bytes() == p.read_bytes()
