"""Trust acceptance on a real registry (distribution 2.8: referrers through the tag-schema
fallback): push --sign-key, verify, every refusal with its event, pull --signature + the real
OpenSSF model_signing CLI, pull --policy refusing before any file is written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from modelpack.mediatypes import MEDIA_TYPE_OCI_MANIFEST
from modelpack.signing import generate_key, verify_artifact
from modelpack.signing.keys import write_keypair
from modelpack.signing.referrers import ARTIFACT_TYPE_SIGNATURE

from modelpack.cli import main
from modelpack.errors import SignatureRefused
from modelpack.events import EventLog, read_events
from modelpack.oci.descriptor import Descriptor, Manifest
from modelpack.oci.reference import parse_reference
from modelpack.targets.opener import open_target
from modelpack.testdata.synthetic import SyntheticSpec, write_checkpoint

MODEL_SIGNING = str(Path(sys.executable).parent / "model_signing")


def _run(*args: str) -> Any:
    res = CliRunner().invoke(main, list(args))
    return res


def _keys(tmp_path: Path, name: str = "ci") -> tuple[str, str, str]:
    key = generate_key()
    priv, pub = write_keypair(str(tmp_path / "keys" / name), key)
    return priv, pub, key.key_id


def test_push_sign_verify_pull_signature_interop(registry: Any, checkpoint: Path, tmp_path: Path) -> None:
    priv, pub, key_id = _keys(tmp_path)
    ref = registry.ref("trust/interop", "v1")
    pushed = _run("push", str(checkpoint), ref, "--sign-key", priv, "--json")
    assert pushed.exit_code == 0, pushed.output
    doc = json.loads(pushed.output)
    assert (
        doc["signed"]["keyId"] == key_id
        and doc["signed"]["chunkTable"]
        and doc["signed"]["directorySignature"]
    )

    ok = _run("verify", ref, "--key", pub, "--json")
    assert ok.exit_code == 0, ok.output
    v = json.loads(ok.output)
    assert v["status"] == "verified" and v["digest"] == doc["digest"]
    assert v["directorySignature"] == "verified" and v["chunkTable"] == "verified"

    out = tmp_path / "model"
    sig = out / "model.sig"
    pulled = _run("pull", ref, str(out), "--key", pub, "--signature", str(sig), "--json")
    assert pulled.exit_code == 0, pulled.output
    assert json.loads(pulled.output)["digest"] == doc["digest"]
    assert sig.exists()

    cmd = [MODEL_SIGNING, "verify", "key", "--signature", str(sig), "--public_key", pub, str(out)]
    good = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert good.returncode == 0 and "Verification succeeded" in good.stdout, good.stdout + good.stderr
    events = tmp_path / "events.jsonl"
    dir_ok = _run("verify", ref, "--key", pub, "--directory", str(out), "--signature", str(sig))
    assert dir_ok.exit_code == 0, dir_ok.output

    # tampered file: both verifiers reject, ours with a typed refusal and an event
    shard = out / "model-00002-of-00002.safetensors"
    original = shard.read_bytes()
    shard.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
    bad = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "Verification succeeded" not in bad.stdout
    refused = _run(
        "verify", ref, "--key", pub, "--directory", str(out), "--signature", str(sig), "--events", str(events)
    )
    assert refused.exit_code == 1 and "model-00002-of-00002.safetensors has sha256" in refused.output
    shard.write_bytes(original)
    # extra file
    (out / "backdoor.py").write_text("print('hi')\n")
    extra = _run(
        "verify", ref, "--key", pub, "--directory", str(out), "--signature", str(sig), "--events", str(events)
    )
    assert extra.exit_code == 1 and "unsigned extra file backdoor.py" in extra.output
    evs = [e for e in read_events(str(events)) if e["event"] == "signing.refused"]
    assert len(evs) == 2 and all(e["digest"] == doc["digest"] and e["reference"] == ref for e in evs)


def test_registry_refusals(registry: Any, checkpoint: Path, tmp_path: Path) -> None:
    priv, pub, _ = _keys(tmp_path)
    _, other_pub, _ = _keys(tmp_path, "other")
    events = tmp_path / "events.jsonl"
    ref_a = registry.ref("trust/refuse", "a")
    assert _run("push", str(checkpoint), ref_a, "--sign-key", priv).exit_code == 0

    # wrong key
    wrong = _run("verify", ref_a, "--key", other_pub, "--events", str(events), "--json")
    assert wrong.exit_code == 1 and "not by a trusted key" in wrong.output

    # replay: A's signature re-attached to B
    other_ckpt = tmp_path / "other-ckpt"
    write_checkpoint(str(other_ckpt), SyntheticSpec(shards=1, seed=3))
    ref_b = registry.ref("trust/refuse", "b")
    assert _run("push", str(other_ckpt), ref_b).exit_code == 0
    target = open_target(parse_reference(ref_a), for_write=True)
    da, db = target.resolve("a"), target.resolve("b")
    (sig,) = target.referrers(da, ARTIFACT_TYPE_SIGNATURE)
    raw, _ = target.fetch_manifest(str(sig.digest))
    orig = Manifest.parse(raw)
    copied = Manifest.build(
        orig.config,
        list(orig.layers),
        artifact_type=orig.artifact_type,
        subject=Descriptor(db.media_type, db.digest, db.size),
        annotations=orig.annotations,
    )
    target.push_manifest(copied.raw, MEDIA_TYPE_OCI_MANIFEST)
    replay = _run("verify", ref_b, "--key", pub, "--events", str(events))
    assert replay.exit_code == 1 and "replayed" in replay.output

    # tampered manifest in the registry's storage (the registry serves it without noticing)
    data = registry.blob_data_path(str(da.digest))
    stored = data.read_bytes()
    data.write_bytes(stored.replace(b'"schemaVersion":2', b'"schemaVersion": 2'))
    try:
        fresh = open_target(parse_reference(ref_a))
        with pytest.raises(SignatureRefused):
            verify_artifact(
                fresh, ref_a, da, [generate_key().public, *_load(pub)], events=EventLog(str(events))
            )
        tampered = _run("verify", ref_a, "--key", pub, "--events", str(events))
        assert tampered.exit_code == 1
    finally:
        data.write_bytes(stored)

    # unsigned artifact under a policy that requires signatures (matching this repository)
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        f"rules:\n  - match: '{registry.host}/trust/*'\n    keys: ['{pub}']\n    require_signature: true\n"
        "default:\n  require_signature: false\n"
    )
    unsigned = _run("verify", ref_b, "--policy", str(policy), "--events", str(events))
    assert unsigned.exit_code == 1 and "replayed" in unsigned.output  # b carries only the replayed copy
    ref_c = registry.ref("trust/refuse", "c")
    third = tmp_path / "third"
    write_checkpoint(str(third), SyntheticSpec(shards=1, seed=4))
    assert _run("push", str(third), ref_c).exit_code == 0
    dest = tmp_path / "pulled"
    refused_pull = _run("pull", ref_c, str(dest), "--policy", str(policy), "--events", str(events))
    assert refused_pull.exit_code == 1 and "unsigned" in refused_pull.output
    assert not dest.exists() or not any(dest.iterdir())
    assert _run("pull", ref_a, str(dest), "--policy", str(policy)).exit_code == 0
    assert (dest / "config.json").exists()

    reasons = [e["reason"] for e in read_events(str(events)) if e["event"] == "signing.refused"]
    assert len(reasons) == 6
    assert "not by a trusted key" in reasons[0] and "replayed" in reasons[1]
    assert "manifest cannot be verified" in reasons[2] and "manifest cannot be verified" in reasons[3]
    assert "replayed" in reasons[4] and reasons[5].startswith("unsigned")


def _load(pub: str) -> list[Any]:
    from modelpack.signing import load_public_key

    return [load_public_key(pub)]


def test_registry_audit_catalog(registry: Any, checkpoint: Path, tmp_path: Path) -> None:
    priv, pub, key_id = _keys(tmp_path)
    host = registry.host
    # repo audit/one: v1 signed (+ stable → same digest), v2 unsigned; repo audit/two: one signed tag
    assert (
        _run(
            "push", str(checkpoint), f"{host}/trustaudit/one:v1", "--sign-key", priv, "--name", "one"
        ).exit_code
        == 0
    )
    assert _run("tag", f"{host}/trustaudit/one:v1", "stable").exit_code == 0
    (checkpoint / "README.md").write_text("two\n")
    assert (
        _run(
            "push", str(checkpoint), f"{host}/trustaudit/one:v2", "--name", "one", "--version", "2"
        ).exit_code
        == 0
    )
    assert _run("push", str(checkpoint), f"{host}/trustaudit/two:latest", "--sign-key", priv).exit_code == 0
    assert _run("push", str(checkpoint), f"{host}/trustaudit-other/three:x").exit_code == 0

    res = _run("audit", host, "--repo", "trustaudit/*", "--key", pub, "--json", "--page-size", "1")
    assert res.exit_code == 0, res.output
    repos = {r["repository"]: r for r in json.loads(res.output)["repositories"]}
    assert set(repos) == {f"{host}/trustaudit/one", f"{host}/trustaudit/two"}
    one = repos[f"{host}/trustaudit/one"]
    assert set(one["tags"]) == {"v1", "stable", "v2"}
    assert one["tags"]["v1"] == one["tags"]["stable"] != one["tags"]["v2"]
    vers = {tuple(v["tags"]): v for v in one["versions"]}
    assert set(vers) == {("stable", "v1"), ("v2",)}
    signed, unsigned = vers[("stable", "v1")], vers[("v2",)]
    assert signed["signature"]["status"] == "verified" and signed["signature"]["keyIds"] == [key_id]
    assert signed["referrers"] == {
        "application/vnd.dev.sigstore.bundle.v0.3+json": 1,
        "application/vnd.modelpack.chunk-digests.v1+json": 1,
        "application/vnd.modelpack.model-signing.v1+json": 1,
    }
    assert unsigned["signature"]["status"] == "unsigned" and unsigned["referrers"] == {}
    assert signed["model"]["name"] == "one" and unsigned["model"]["version"] == "2"
    assert signed["layerCount"] == 7 and signed["totalSize"] > 0
    assert repos[f"{host}/trustaudit/two"]["versions"][0]["signature"]["status"] == "verified"

    # one repository with the table output, and a moved tag flagged against the earlier JSON
    since = tmp_path / "since.json"
    since.write_text(res.output)
    assert _run("tag", f"{host}/trustaudit/one:v2", "stable").exit_code == 0
    table = _run("audit", f"{host}/trustaudit/one", "--key", pub, "--since-digests", str(since))
    assert table.exit_code == 1
    assert (
        f"MOVED {host}/trustaudit/one:stable: {one['tags']['stable']} → {one['tags']['v2']}" in table.output
    )
    lines = table.output.splitlines()
    assert lines[0].startswith("REPOSITORY") and any("verified(" in line for line in lines)


def test_pull_into_the_cache_writes_the_directory_signature(
    registry: Any, checkpoint: Path, tmp_path: Path
) -> None:
    """``pull REF --cache C --key K --signature S`` was a usage error, so a node cache's snapshot
    could not be handed to model_signing. It writes the directory signature the cache verified
    and kept (also with the registry gone), and model_signing accepts the snapshot with it."""
    priv, pub, _ = _keys(tmp_path)
    ref = registry.ref("trust/cache-sig", "v1")
    pushed = _run("push", str(checkpoint), ref, "--sign-key", priv, "--json")
    assert pushed.exit_code == 0, pushed.output
    digest = json.loads(pushed.output)["digest"]
    cache, sig = tmp_path / "cache", tmp_path / "out" / "model.sig"
    pulled = _run("pull", ref, "--cache", str(cache), "--key", pub, "--signature", str(sig), "--json")
    assert pulled.exit_code == 0, pulled.output
    snapshot = json.loads(pulled.output)["path"]
    cmd = [MODEL_SIGNING, "verify", "key", "--signature", str(sig), "--public_key", pub, snapshot]
    good = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert good.returncode == 0 and "Verification succeeded" in good.stdout, good.stdout + good.stderr

    # pinned, origin unreachable: the signature comes from what the cache kept
    sig.unlink()
    gone = f"127.0.0.1:9/{ref.split('/', 1)[1].split(':')[0]}@{digest}"
    again = _run(
        "pull", gone, "--cache", str(cache), "--key", pub, "--signature", str(sig), "--retry-for", "0"
    )
    assert again.exit_code == 0, again.output
    assert subprocess.run(cmd, capture_output=True, timeout=120).returncode == 0

    # without a trusted key there is nothing verified to write: refused, nothing written
    sig.unlink()
    bare = _run(
        "pull", f"{ref.split(':v1')[0]}@{digest}", "--cache", str(tmp_path / "c2"), "--signature", str(sig)
    )
    assert bare.exit_code == 2 and "--key" in bare.output and not sig.exists()
