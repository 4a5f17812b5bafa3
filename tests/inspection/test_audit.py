"""Audit of repositories holding several tags, shared digests, signed and unsigned versions."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner
from modelpack.signing import TrustPolicy, generate_key, sign_artifact
from modelpack.signing.keys import write_keypair
from modelpack.signing.referrers import (
    ARTIFACT_TYPE_CHUNK_DIGESTS,
    ARTIFACT_TYPE_MODEL_SIGNATURE,
    ARTIFACT_TYPE_SIGNATURE,
)

from modelpack import api
from modelpack.cli import main
from modelpack.inspection.audit import audit_repository
from modelpack.packing.packer import PackOptions
from modelpack.targets.layout import OCILayoutTarget
from tests.signing_helpers import SMALL_CHUNK


def test_audit_layout_versions_signatures_and_moves(checkpoint: Path, tmp_path: Path) -> None:
    layout = tmp_path / "layout"
    key, other = generate_key(), generate_key()
    api.pack(
        str(checkpoint), f"oci:{layout}:v1", PackOptions(name="llama", version="1.0", precision="bfloat16")
    )
    t = OCILayoutTarget(str(layout))
    v1 = t.resolve("v1")
    t.tag(v1, "stable")
    (checkpoint / "README.md").write_text("v2\n")
    api.pack(str(checkpoint), f"oci:{layout}:v2", PackOptions(name="llama", version="2.0"))
    v2 = t.resolve("v2")
    (checkpoint / "README.md").write_text("v3\n")
    api.pack(str(checkpoint), f"oci:{layout}:v3", PackOptions(name="llama", version="3.0"))
    v3 = t.resolve("v3")
    sign_artifact(t, v1, key, chunk_size=SMALL_CHUNK)
    sign_artifact(t, v3, other, chunk_table=False, directory_signature=False)

    audit = audit_repository(t, "layout", policy_or_keys=TrustPolicy.from_keys([key.public]))
    assert audit.tags == {
        "stable": str(v1.digest),
        "v1": str(v1.digest),
        "v2": str(v2.digest),
        "v3": str(v3.digest),
    }
    by = {v.digest: v for v in audit.versions}
    assert len(audit.versions) == 3
    a1, a2, a3 = by[str(v1.digest)], by[str(v2.digest)], by[str(v3.digest)]
    assert sorted(a1.tags) == ["stable", "v1"]
    assert a1.signature == "verified" and a1.key_ids == [key.key_id]
    assert a1.referrers == {
        ARTIFACT_TYPE_SIGNATURE: 1,
        ARTIFACT_TYPE_MODEL_SIGNATURE: 1,
        ARTIFACT_TYPE_CHUNK_DIGESTS: 1,
    }
    assert a2.signature == "unsigned" and a2.referrers == {}
    assert a3.signature == "untrusted" and a3.key_ids == [other.key_id]
    assert a1.model == {"name": "llama", "version": "1.0", "precision": "bfloat16"}
    assert a2.model["version"] == "2.0"
    manifest, _ = api.fetch_manifest(t, "v1")
    assert a1.total_size == manifest.total_size and a1.layer_count == len(manifest.layers)
    assert a1.artifact_type == "application/vnd.cncf.model.manifest.v1+json"

    # without keys: signatures are reported as present, by key id, not as verified
    plain = audit_repository(t, "layout")
    pv = {v.digest: v for v in plain.versions}
    assert pv[str(v1.digest)].signature == "signed" and pv[str(v1.digest)].key_ids == [key.key_id]
    assert pv[str(v2.digest)].signature == "unsigned"

    # tag moves since a recorded state
    since = {"v1": str(v1.digest), "stable": str(v2.digest), "gone": str(v2.digest)}
    moved = audit_repository(t, "layout", since=since).moved
    assert moved == [
        {"tag": "gone", "previous": str(v2.digest), "current": None},
        {"tag": "stable", "previous": str(v2.digest), "current": str(v1.digest)},
    ]


def test_audit_cli_table_and_json(checkpoint: Path, tmp_path: Path) -> None:
    layout = tmp_path / "layout"
    api.pack(str(checkpoint), f"oci:{layout}:v1", PackOptions(name="m", version="1"))
    t = OCILayoutTarget(str(layout))
    key = generate_key()
    _, pub = write_keypair(str(tmp_path / "ci"), key)
    sign_artifact(t, t.resolve("v1"), key, chunk_table=False, directory_signature=False)
    runner = CliRunner()
    res = runner.invoke(main, ["audit", f"oci:{layout}", "--key", pub, "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    (repo,) = doc["repositories"]
    (ver,) = repo["versions"]
    signed_at = ver["signature"].pop("signedAt")  # the signing time inside the verified statement
    assert signed_at and signed_at.endswith("Z"), signed_at
    assert ver["signature"] == {"status": "verified", "keyIds": [key.key_id], "reasons": []}
    assert ver["tags"] == ["v1"] and ver["model"]["name"] == "m"
    # the JSON is stable: the same state gives the same bytes
    assert runner.invoke(main, ["audit", f"oci:{layout}", "--key", pub, "--json"]).output == res.output
    table = runner.invoke(main, ["audit", f"oci:{layout}", "--key", pub])
    assert table.exit_code == 0
    lines = table.output.splitlines()
    assert lines[0].split() == [
        "REPOSITORY",
        "TAGS",
        "DIGEST",
        "TYPE",
        "SIZE",
        "LAYERS",
        "CREATED",
        "MODEL",
        "SIGNATURE",
        "REFERRERS",
    ]
    assert f"verified({key.key_id[:12]})" in lines[1] and ver["digest"][:19] in lines[1]
    # a moved tag is flagged and the exit status says so
    since = tmp_path / "since.json"
    since.write_text(json.dumps({"v1": "sha256:" + "0" * 64}))
    moved = runner.invoke(main, ["audit", f"oci:{layout}", "--since-digests", str(since)])
    assert moved.exit_code == 1 and "MOVED" in moved.output and "v1" in moved.output


def test_audit_and_verify_name_a_signature_by_another_key_alike(checkpoint: Path, tmp_path: Path) -> None:
    """A valid signature made by a key that is not the one given is 'untrusted' in audit, with
    the same reason verify refuses it with ('not by a trusted key'), never 'invalid' (which means
    a signature that does not verify at all); an unsigned version stays 'unsigned'."""
    layout = tmp_path / "layout"
    api.pack(str(checkpoint), f"oci:{layout}:v1", PackOptions(name="m", version="1"))
    (checkpoint / "README.md").write_text("v2\n")
    api.pack(str(checkpoint), f"oci:{layout}:v2", PackOptions(name="m", version="2"))
    t = OCILayoutTarget(str(layout))
    signer, trusted = generate_key(), generate_key()
    _, trusted_pub = write_keypair(str(tmp_path / "trusted"), trusted)
    sign_artifact(t, t.resolve("v1"), signer, chunk_table=False, directory_signature=False)
    runner = CliRunner()

    verify = runner.invoke(main, ["verify", f"oci:{layout}:v1", "--key", trusted_pub])
    assert verify.exit_code == 1 and "not by a trusted key" in verify.output, verify.output
    audit = runner.invoke(main, ["audit", f"oci:{layout}", "--key", trusted_pub, "--json"])
    assert audit.exit_code == 0, audit.output
    (repo,) = json.loads(audit.output)["repositories"]
    by_tag = {v["tags"][0]: v["signature"] for v in repo["versions"]}
    assert by_tag["v1"]["status"] == "untrusted", by_tag["v1"]
    assert by_tag["v1"]["keyIds"] == [signer.key_id]
    (reason,) = by_tag["v1"]["reasons"]
    assert "not by a trusted key" in reason and reason in verify.output
    assert by_tag["v2"]["status"] == "unsigned"
    table = runner.invoke(main, ["audit", f"oci:{layout}", "--key", trusted_pub])
    assert f"untrusted({signer.key_id[:12]})" in table.output and "invalid" not in table.output
