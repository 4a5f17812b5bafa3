"""Wire formats: the cosign-readable bundle referrer (structural golden test), the OpenSSF
model_signing interop (the real ``model_signing`` CLI), keys, DSSE and chunk tables."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from modelpack.mediatypes import MEDIA_TYPE_OCI_MANIFEST
from modelpack.signing import generate_key, load_private_key, load_public_key, sign_artifact
from modelpack.signing.chunks import ChunkTable, compute_chunk_table, load_chunk_table, push_chunk_table
from modelpack.signing.dsse import pae
from modelpack.signing.keys import write_keypair
from modelpack.signing.referrers import ARTIFACT_TYPE_CHUNK_DIGESTS, ARTIFACT_TYPE_SIGNATURE
from modelpack.signing.sign import write_directory_signature

from modelpack.errors import ChunkDigestMismatch, ChunkTableError, KeyLoadError
from modelpack.oci.descriptor import Manifest
from modelpack.oci.digest import Digest
from tests.signing_helpers import SMALL_CHUNK, materialise, pack_layout

EMPTY_DIGEST = "sha256:44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a"
MODEL_SIGNING = Path(sys.executable).parent / "model_signing"


def test_cosign_bundle_referrer_structure(checkpoint: Path, tmp_path: Path) -> None:
    p = pack_layout(checkpoint, tmp_path / "layout")
    key = generate_key()
    signed = sign_artifact(p.target, p.desc, key, chunk_table=False, directory_signature=False)
    (ref_desc,) = p.target.referrers(p.desc, ARTIFACT_TYPE_SIGNATURE)
    assert ref_desc.digest == signed.signature.digest
    raw, _ = p.target.fetch_manifest(str(ref_desc.digest))
    doc = json.loads(raw)
    assert doc["schemaVersion"] == 2 and doc["mediaType"] == MEDIA_TYPE_OCI_MANIFEST
    assert doc["artifactType"] == "application/vnd.dev.sigstore.bundle.v0.3+json"
    assert doc["config"]["mediaType"] == "application/vnd.oci.empty.v1+json"
    assert doc["config"]["digest"] == EMPTY_DIGEST and doc["config"]["size"] == 2
    assert Path(p.target.blob_path(EMPTY_DIGEST)).read_bytes() == b"{}"
    assert doc["subject"] == {
        "mediaType": p.desc.media_type,
        "digest": str(p.desc.digest),
        "size": p.desc.size,
    }
    assert doc["annotations"]["dev.sigstore.bundle.content"] == "dsse-envelope"
    assert doc["annotations"]["dev.sigstore.bundle.predicateType"] == "https://sigstore.dev/cosign/sign/v1"
    assert "org.opencontainers.image.created" in doc["annotations"]
    (layer,) = doc["layers"]
    assert layer["mediaType"] == "application/vnd.dev.sigstore.bundle.v0.3+json"
    assert layer["annotations"]["org.opencontainers.image.title"] == (
        "sha256-" + layer["digest"].split(":")[1] + ".sigstore.json"
    )
    blob = Path(p.target.blob_path(layer["digest"])).read_bytes()
    assert Digest.from_bytes(blob) == layer["digest"] and len(blob) == layer["size"]
    bundle = json.loads(blob)
    assert bundle["mediaType"] == "application/vnd.dev.sigstore.bundle.v0.3+json"
    assert bundle["verificationMaterial"] == {"publicKey": {"hint": key.key_id}, "tlogEntries": []}
    env = bundle["dsseEnvelope"]
    assert env["payloadType"] == "application/vnd.in-toto+json"
    payload = base64.b64decode(env["payload"])
    statement = json.loads(payload)
    # the signing time is an annotation of the subject (in-toto ResourceDescriptor.annotations,
    # the project's own key), inside the signed payload; cosign's predicate stays empty
    signed_at = statement["subject"][0]["annotations"]["dev.modelpack.signed-at"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z", signed_at), signed_at
    assert statement == {
        "_type": "https://in-toto.io/Statement/v1",
        "subject": [
            {"digest": {"sha256": p.desc.digest.hex}, "annotations": {"dev.modelpack.signed-at": signed_at}}
        ],
        "predicateType": "https://sigstore.dev/cosign/sign/v1",
        "predicate": {},
    }
    (sig,) = env["signatures"]
    assert key.public.verify(base64.b64decode(sig["sig"]), pae(env["payloadType"], payload))
    # the key id is what model_signing/cosign use as hint: sha256 of the SPKI PEM
    assert key.key_id == hashlib.sha256(key.public.pem).hexdigest()
    # the sigstore protobuf-specs model (used by model_signing) parses the bundle
    from sigstore_models.bundle.v1 import Bundle as PbBundle

    assert PbBundle.from_json(blob).media_type == bundle["mediaType"]


def test_model_signing_cli_interop(checkpoint: Path, tmp_path: Path) -> None:
    p = pack_layout(checkpoint, tmp_path / "layout")
    key = generate_key()
    _, pub = write_keypair(str(tmp_path / "keys" / "ci"), key)
    sign_artifact(p.target, p.desc, key, chunk_table=False)
    out = materialise(p.target, p.manifest, tmp_path / "model")
    sig = write_directory_signature(p.target, p.desc, out / "model.sig")
    cmd = [str(MODEL_SIGNING), "verify", "key", "--signature", sig, "--public_key", pub, str(out)]
    ok = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "Verification succeeded" in ok.stdout
    # one file changed → rejected
    cfg = out / "config.json"
    cfg.write_bytes(cfg.read_bytes().replace(b"{", b"{ ", 1))
    bad = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0
    assert "Verification succeeded" not in bad.stdout
    # and a different key is rejected too (restore the file first)
    cfg.write_bytes(cfg.read_bytes().replace(b"{ ", b"{", 1))
    _, other_pub = write_keypair(str(tmp_path / "keys" / "other"), generate_key())
    wrong = subprocess.run([*cmd[:6], other_pub, str(out)], capture_output=True, text=True, timeout=120)
    assert wrong.returncode != 0


def test_keys_roundtrip_passphrase_and_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    key = generate_key()
    priv, pub = write_keypair(str(tmp_path / "k"), key, passphrase="hunter2")
    assert os.stat(priv).st_mode & 0o777 == 0o600
    assert b"ENCRYPTED PRIVATE KEY" in Path(priv).read_bytes()
    monkeypatch.delenv("MODELPACK_SIGNING_PASSPHRASE", raising=False)
    with pytest.raises(KeyLoadError, match="encrypted"):
        load_private_key(priv)
    monkeypatch.setenv("MODELPACK_SIGNING_PASSPHRASE", "wrong")
    with pytest.raises(KeyLoadError, match="wrong passphrase"):
        load_private_key(priv)
    monkeypatch.setenv("MODELPACK_SIGNING_PASSPHRASE", "hunter2")
    assert load_private_key(priv).key_id == key.key_id
    monkeypatch.setenv("CI_PUB", Path(pub).read_text())
    assert load_public_key("env:CI_PUB").key_id == key.key_id
    with pytest.raises(KeyLoadError, match="already exists"):
        write_keypair(str(tmp_path / "k"), key)
    with pytest.raises(KeyLoadError, match="P-256"):
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ec

        other = ec.generate_private_key(ec.SECP384R1()).public_key()
        load_public_key(
            other.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        )


def test_pae_matches_dsse_spec() -> None:
    assert pae("http://example.com/HelloWorld", b"hello world") == (
        b"DSSEv1 29 http://example.com/HelloWorld 11 hello world"
    )


def test_chunk_table_roundtrip_and_mismatch(checkpoint: Path, tmp_path: Path) -> None:
    p = pack_layout(checkpoint, tmp_path / "layout")
    key = generate_key()
    assert load_chunk_table(p.target, p.desc, [key.public]) is None
    table = compute_chunk_table(p.target, p.manifest, SMALL_CHUNK)
    weights = [layer for layer in p.manifest.layers if layer.media_type.endswith(".weight.v1.raw")]
    assert set(table.layers) == {str(layer.digest) for layer in weights}
    layer = weights[0]
    blob = Path(p.target.blob_path(layer.digest)).read_bytes()
    lc = table.layers[str(layer.digest)]
    assert lc.size == len(blob) and len(lc.digests) == -(-len(blob) // SMALL_CHUNK)
    assert lc.digests[0] == hashlib.sha256(blob[:SMALL_CHUNK]).digest()
    assert lc.digests[-1] == hashlib.sha256(blob[(len(lc.digests) - 1) * SMALL_CHUNK :]).digest()
    push_chunk_table(p.target, p.desc, table, key)
    loaded = load_chunk_table(p.target, p.desc, [key.public], manifest=p.manifest)
    assert loaded == table
    assert loaded is not None
    last = len(lc.digests) - 1
    loaded.verify_chunk(str(layer.digest), 1, blob[SMALL_CHUNK : 2 * SMALL_CHUNK])
    loaded.verify_chunk(str(layer.digest), last, memoryview(blob)[last * SMALL_CHUNK :])
    bad = bytearray(blob[SMALL_CHUNK : 2 * SMALL_CHUNK])
    bad[5] ^= 1
    with pytest.raises(ChunkDigestMismatch) as info:
        loaded.verify_chunk(str(layer.digest), 1, bad)
    assert info.value.index == 1 and info.value.layer_digest == str(layer.digest)
    assert str(layer.digest) in str(info.value) and "chunk 1" in str(info.value)
    with pytest.raises(ChunkDigestMismatch):  # a short read is a mismatch too
        loaded.verify_chunk(str(layer.digest), 1, blob[SMALL_CHUNK : 2 * SMALL_CHUNK - 1])
    # untrusted signer: present but not acceptable → typed error, not None
    with pytest.raises(ChunkTableError, match="not signed by a trusted key"):
        load_chunk_table(p.target, p.desc, [generate_key().public])


def test_chunk_table_replay_refused(checkpoint: Path, tmp_path: Path) -> None:
    """A table of artifact A re-attached to artifact B (same key) is refused for B."""
    key = generate_key()
    a = pack_layout(checkpoint, tmp_path / "layout", "a")
    cfg = checkpoint / "config.json"
    cfg.write_bytes(cfg.read_bytes().replace(b"{", b"{ ", 1))
    b = pack_layout(checkpoint, tmp_path / "layout", "b")
    assert a.desc.digest != b.desc.digest
    ref = push_chunk_table(a.target, a.desc, compute_chunk_table(a.target, a.manifest, SMALL_CHUNK), key)
    raw, _ = a.target.fetch_manifest(str(ref.digest))
    orig = Manifest.parse(raw)
    copied = Manifest.build(
        orig.config,
        list(orig.layers),
        artifact_type=ARTIFACT_TYPE_CHUNK_DIGESTS,
        subject=type(b.desc)(b.desc.media_type, b.desc.digest, b.desc.size),
    )
    b.target.push_manifest(copied.raw, MEDIA_TYPE_OCI_MANIFEST)
    with pytest.raises(ChunkTableError, match="is not manifest"):
        load_chunk_table(b.target, b.desc, [key.public])
    with pytest.raises(ChunkTableError, match="is for"):
        push_chunk_table(b.target, b.desc, ChunkTable(str(a.desc.digest), SMALL_CHUNK, {}), key)


def test_chunk_table_detects_corrupt_blob(checkpoint: Path, tmp_path: Path) -> None:
    from modelpack.errors import DigestMismatchError

    p = pack_layout(checkpoint, tmp_path / "layout")
    layer = next(layer for layer in p.manifest.layers if layer.media_type.endswith(".weight.v1.raw"))
    path = Path(p.target.blob_path(layer.digest))
    data = bytearray(path.read_bytes())
    data[100] ^= 1
    path.chmod(0o644)
    path.write_bytes(bytes(data))
    with pytest.raises(DigestMismatchError, match=str(layer.digest)):
        compute_chunk_table(p.target, p.manifest, SMALL_CHUNK)
    # truncated, and one byte too long: size errors naming the blob
    from modelpack.errors import SizeMismatchError

    for bad in (bytes(data[:-10]), bytes(data) + b"x"):
        path.write_bytes(bad)
        with pytest.raises(SizeMismatchError, match=str(layer.digest)):
            compute_chunk_table(p.target, p.manifest, SMALL_CHUNK)
