"""Sign then verify on an OCI layout, and every refusal the issue lists (typed error + event)."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import pytest
from modelpack.mediatypes import MEDIA_TYPE_OCI_MANIFEST
from modelpack.signing import (
    TrustPolicy,
    generate_key,
    sign_artifact,
    verify_artifact,
    verify_directory,
    write_directory_signature,
)
from modelpack.signing.policy import RepositoryPolicy
from modelpack.signing.referrers import ARTIFACT_TYPE_SIGNATURE

from modelpack.errors import DirectorySignatureError, SignatureRefused
from modelpack.events import EventLog, read_events
from modelpack.oci.descriptor import Manifest
from modelpack.testdata.synthetic import SyntheticSpec, write_checkpoint
from tests.signing_helpers import SMALL_CHUNK, materialise, pack_layout


@pytest.fixture
def events_path(tmp_path: Path) -> str:
    return str(tmp_path / "events.jsonl")


def _refusals(path: str) -> list[dict]:
    return [e for e in read_events(path) if e["event"] == "signing.refused"]


def test_sign_then_verify(checkpoint: Path, tmp_path: Path, events_path: str) -> None:
    p = pack_layout(checkpoint, tmp_path / "layout")
    key = generate_key()
    signed = sign_artifact(p.target, p.desc, key, chunk_size=SMALL_CHUNK)
    assert signed.directory_signature is not None and signed.chunk_table is not None
    result = verify_artifact(p.target, p.ref, p.desc, [key.public], events=EventLog(events_path))
    assert result.allowed and result.status == "verified"
    assert result.key_ids == [key.key_id]
    assert result.directory_signature == "verified" and result.chunk_table == "verified"
    ev = [e for e in read_events(events_path) if e["event"] == "signing.verified"]
    assert ev and ev[0]["digest"] == str(p.desc.digest) and ev[0]["reference"] == p.ref


def test_wrong_key_refused(checkpoint: Path, tmp_path: Path, events_path: str) -> None:
    p = pack_layout(checkpoint, tmp_path / "layout")
    sign_artifact(p.target, p.desc, generate_key(), chunk_table=False, directory_signature=False)
    other = generate_key()
    with pytest.raises(SignatureRefused) as info:
        verify_artifact(p.target, p.ref, p.desc, [other.public], events=EventLog(events_path))
    assert "not by a trusted key" in info.value.reason
    (ev,) = _refusals(events_path)
    assert ev["digest"] == str(p.desc.digest) and ev["reference"] == p.ref
    assert "not by a trusted key" in ev["reason"]


def test_replayed_signature_refused(checkpoint: Path, tmp_path: Path, events_path: str) -> None:
    """A valid signature of digest A attached to digest B (same key!) must not verify B."""
    key = generate_key()
    a = pack_layout(checkpoint, tmp_path / "layout", "a")
    sign_artifact(a.target, a.desc, key, chunk_table=False, directory_signature=False)
    other_ckpt = tmp_path / "other"
    write_checkpoint(str(other_ckpt), SyntheticSpec(shards=1, seed=7))
    b = pack_layout(other_ckpt, tmp_path / "layout", "b")
    assert a.desc.digest != b.desc.digest
    (sig_desc,) = a.target.referrers(a.desc, ARTIFACT_TYPE_SIGNATURE)
    raw, _ = a.target.fetch_manifest(str(sig_desc.digest))
    original = Manifest.parse(raw)
    copied = Manifest.build(
        original.config,
        list(original.layers),
        artifact_type=original.artifact_type,
        subject=type(b.desc)(b.desc.media_type, b.desc.digest, b.desc.size),
        annotations=original.annotations,
    )
    b.target.push_manifest(copied.raw, MEDIA_TYPE_OCI_MANIFEST)
    assert b.target.referrers(b.desc, ARTIFACT_TYPE_SIGNATURE)
    with pytest.raises(SignatureRefused) as info:
        verify_artifact(b.target, b.ref, b.desc, [key.public], events=EventLog(events_path))
    assert "replayed" in info.value.reason and str(a.desc.digest) in info.value.reason
    assert _refusals(events_path)[0]["digest"] == str(b.desc.digest)
    # the original is still fine
    assert verify_artifact(a.target, a.ref, a.desc, [key.public]).verified


def test_tampered_manifest_refused(checkpoint: Path, tmp_path: Path, events_path: str) -> None:
    p = pack_layout(checkpoint, tmp_path / "layout")
    key = generate_key()
    sign_artifact(p.target, p.desc, key, chunk_table=False, directory_signature=False)
    # (1) a modified manifest pushed under the same tag: new digest, no signature for it
    doc = json.loads(p.manifest.raw)
    doc["annotations"] = {"org.opencontainers.image.description": "tampered"}
    tampered = json.dumps(doc).encode()
    new_desc = p.target.push_manifest(tampered, MEDIA_TYPE_OCI_MANIFEST, "v1")
    with pytest.raises(SignatureRefused) as info:
        verify_artifact(p.target, p.ref, new_desc, [key.public], events=EventLog(events_path))
    assert "unsigned" in info.value.reason
    # (2) the stored manifest bytes modified in place: the digest in use no longer matches
    blob = Path(p.target.blob_path(p.desc.digest))
    blob.chmod(0o644)
    blob.write_bytes(p.manifest.raw.replace(b'"schemaVersion":2', b'"schemaVersion":2 '))
    with pytest.raises(SignatureRefused) as info2:
        verify_artifact(p.target, p.ref, p.desc, [key.public], events=EventLog(events_path))
    assert "manifest cannot be verified" in info2.value.reason
    evs = _refusals(events_path)
    assert [e["digest"] for e in evs] == [str(new_desc.digest), str(p.desc.digest)]


def test_unsigned_refused_when_policy_requires(checkpoint: Path, tmp_path: Path, events_path: str) -> None:
    p = pack_layout(checkpoint, tmp_path / "layout")
    key = generate_key()
    pub = tmp_path / "ci.pub"
    pub.write_bytes(key.public.pem)
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text(
        "version: 1\n"
        "default:\n  require_signature: false\n"
        f"rules:\n  - match: 'oci:{tmp_path}/layout*'\n    keys: [{{path: ci.pub}}]\n"
        "    require_signature: true\n"
    )
    policy = TrustPolicy.load(policy_file)
    with pytest.raises(SignatureRefused) as info:
        verify_artifact(p.target, p.ref, p.desc, policy, events=EventLog(events_path))
    assert info.value.reason.startswith("unsigned")
    (ev,) = _refusals(events_path)
    assert ev["reason"].startswith("unsigned") and ev["digest"] == str(p.desc.digest)
    # a repository outside the rule falls to the default, which does not require a signature
    lenient = verify_artifact(p.target, "oci:/elsewhere:v1", p.desc, policy)
    assert lenient.allowed and lenient.status == "unsigned"
    # once signed, the strict rule passes
    sign_artifact(p.target, p.desc, key, chunk_table=False, directory_signature=False)
    assert verify_artifact(p.target, p.ref, p.desc, policy).verified


def test_policy_requiring_chunk_table(checkpoint: Path, tmp_path: Path) -> None:
    p = pack_layout(checkpoint, tmp_path / "layout")
    key = generate_key()
    sign_artifact(p.target, p.desc, key, chunk_table=False, directory_signature=False)
    strict = RepositoryPolicy((key.public,), require_chunk_table=True, rule="strict")
    with pytest.raises(SignatureRefused, match="chunk table absent"):
        verify_artifact(p.target, p.ref, p.desc, strict)


def test_directory_tampered_and_extra_file(checkpoint: Path, tmp_path: Path, events_path: str) -> None:
    p = pack_layout(checkpoint, tmp_path / "layout")
    key = generate_key()
    sign_artifact(p.target, p.desc, key, chunk_table=False)
    out = materialise(p.target, p.manifest, tmp_path / "model")
    sig = write_directory_signature(p.target, p.desc, out / "model.sig", [key.public])
    files = verify_directory(str(out), [key.public], signature_path=sig)
    assert set(files) == {layer.annotations["org.cncf.model.filepath"] for layer in p.manifest.layers}
    log = EventLog(events_path)
    # an extra file
    (out / "extra.bin").write_bytes(b"x")
    with pytest.raises(DirectorySignatureError, match=re.escape("unsigned extra file extra.bin")):
        verify_directory(str(out), [key.public], signature_path=sig, events=log, digest=str(p.desc.digest))
    (out / "extra.bin").unlink()
    # one byte of a weight file changed
    shard = out / "model-00001-of-00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(
        DirectorySignatureError, match=re.escape("model-00001-of-00002.safetensors has sha256")
    ):
        verify_directory(str(out), [key.public], signature_path=sig, events=log, digest=str(p.desc.digest))
    # a wrong key for the directory signature
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(DirectorySignatureError, match="not by a trusted key"):
        verify_directory(str(out), [generate_key().public], signature_path=sig, events=log)
    reasons = [e["reason"] for e in _refusals(events_path)]
    assert len(reasons) == 3 and "extra.bin" in reasons[0]


def test_forged_payload_fails(checkpoint: Path, tmp_path: Path) -> None:
    """Editing the signed statement inside a bundle (re-pointing it) breaks the DSSE signature."""
    from modelpack.signing.bundle import Bundle
    from modelpack.signing.dsse import Envelope
    from modelpack.signing.statements import manifest_statement

    key = generate_key()
    p = pack_layout(checkpoint, tmp_path / "layout")
    other = manifest_statement("0" * 64).to_bytes()
    signed = sign_artifact(p.target, p.desc, key, chunk_table=False, directory_signature=False)
    raw, _ = p.target.fetch_manifest(str(signed.signature.digest))
    layer = Manifest.parse(raw).layers[0]
    bundle = Bundle.from_bytes(Path(p.target.blob_path(layer.digest)).read_bytes())
    forged = Bundle(
        Envelope(other, bundle.envelope.payload_type, bundle.envelope.signatures), bundle.key_hint
    )
    assert forged.verify([key.public]) is None
    assert bundle.verify([key.public]) == key.public
    assert base64.b64decode(bundle.to_dict()["dsseEnvelope"]["payload"]) == bundle.envelope.payload
