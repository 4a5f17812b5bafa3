"""Each test starts from the attack or the mistake.

- 7: a push with an unusable signing key uploads nothing; a signing that fails after the upload
  leaves no tag pointing at the unsigned model (push by digest → sign → tag).
- 8: two signers of one manifest on a registry without the referrers API (distribution 2.8, the
  ``sha256-<hex>`` fallback index) both end up discoverable, and a registry that keeps dropping a
  signer's entry makes that signer fail instead of exiting 0.
- 10: a DSSE envelope signed by a trusted key but of another payloadType is not a signature.
- 11: a 5000-level-deep referrer next to a valid signature is skipped with an event; verify,
  pull --policy and the node cache still accept the valid signature.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import requests
from click.testing import CliRunner
from modelpack.mediatypes import MEDIA_TYPE_OCI_INDEX, MEDIA_TYPE_OCI_MANIFEST
from modelpack.signing import generate_key, sign_artifact, verify_artifact
from modelpack.signing.bundle import BUNDLE_MEDIA_TYPE, Bundle
from modelpack.signing.dsse import sign_envelope
from modelpack.signing.keys import PrivateKey, write_keypair
from modelpack.signing.referrers import (
    ARTIFACT_TYPE_CHUNK_DIGESTS,
    ARTIFACT_TYPE_SIGNATURE,
    push_bundle_referrer,
    subject_descriptor,
)
from modelpack.signing.statements import PREDICATE_COSIGN_SIGN, manifest_statement

from modelpack.cli import main
from modelpack.errors import ModelpackError, RegistryNotFoundError, SignatureRefused
from modelpack.events import EventLog, read_events
from modelpack.oci.descriptor import EMPTY_JSON, Descriptor, Manifest, empty_config_descriptor
from modelpack.oci.digest import Digest
from modelpack.oci.reference import parse_reference
from modelpack.targets.base import bytes_blob_source
from modelpack.targets.opener import open_target
from modelpack.testdata.synthetic import SyntheticSpec, write_checkpoint
from tests.fixtures.faultproxy import Fault, FaultProxy, manifest_get, request
from tests.signing_helpers import referrers_index_clobbered


def _run(*args: str, input: str | None = None) -> Any:
    return CliRunner().invoke(main, list(args), input=input)


def _keypair(tmp_path: Path, name: str = "ci", passphrase: str | None = None) -> tuple[str, str, PrivateKey]:
    key = generate_key()
    priv, pub = write_keypair(str(tmp_path / "keys" / name), key, passphrase)
    return priv, pub, key


def _tags(registry: Any, repo: str) -> list[str]:
    target = open_target(parse_reference(registry.ref(repo, "x")), for_write=True)
    try:
        return sorted(target.list_tags())
    except RegistryNotFoundError:
        return []


# ----------------------------------------------------------------------------- item 7
@pytest.mark.parametrize("case", ["public-key", "unset-env", "wrong-passphrase"])
def test_unusable_sign_key_uploads_nothing(
    case: str, registry: Any, checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    priv, pub, _ = _keypair(tmp_path, passphrase="right horse" if case == "wrong-passphrase" else None)
    spec = {"public-key": pub, "unset-env": "env:MODELPACK_TEST_UNSET_SIGNING_KEY", "wrong-passphrase": priv}[
        case
    ]
    monkeypatch.delenv("MODELPACK_TEST_UNSET_SIGNING_KEY", raising=False)
    if case == "wrong-passphrase":
        monkeypatch.setenv("MODELPACK_SIGNING_PASSPHRASE", "wrong battery")
    proxy = FaultProxy(registry.host)
    try:
        res = _run("push", str(checkpoint), f"{proxy.host}/trust7/{case}:v1", "--sign-key", spec)
        assert res.exit_code != 0, res.output
        assert "Traceback" not in res.output
        assert proxy.requests == [], (
            f"the registry was contacted before the key was checked: {proxy.requests}"
        )
    finally:
        proxy.close()
    assert _tags(registry, f"trust7/{case}") == []


def test_sign_with_unusable_key_contacts_nothing(registry: Any, tmp_path: Path) -> None:
    _, pub, _ = _keypair(tmp_path)
    proxy = FaultProxy(registry.host)
    try:
        res = _run("sign", f"{proxy.host}/trust7/sign-pub:v1", "--key", pub)
        assert res.exit_code != 0 and "public key cannot sign" in res.output, res.output
        assert proxy.requests == [], f"{len(proxy.requests)} requests before the key was checked"
    finally:
        proxy.close()


def test_signing_failure_after_upload_leaves_no_tag(registry: Any, checkpoint: Path, tmp_path: Path) -> None:
    priv, pub, _ = _keypair(tmp_path)
    repo = "trust7/fail-after-upload"
    # v1 is a signed model already in production
    assert _run("push", str(checkpoint), registry.ref(repo, "v1"), "--sign-key", priv).exit_code == 0
    before = open_target(parse_reference(registry.ref(repo, "v1"))).resolve("v1").digest

    newer = tmp_path / "newer"
    write_checkpoint(str(newer), SyntheticSpec(shards=1, seed=11))
    proxy = FaultProxy(registry.host)
    # the registry takes the model, then refuses to list its signatures (the fallback index PUT)
    proxy.add(Fault(match=request("PUT", r"/manifests/sha256-"), status=403, times=None))
    try:
        for tag in ("v2", "v1"):
            res = _run("push", str(newer), f"{proxy.host}/{repo}:{tag}", "--sign-key", priv)
            assert res.exit_code != 0, res.output
            assert "the tag was not written" in res.output and "Traceback" not in res.output
    finally:
        proxy.close()
    assert "v2" not in _tags(registry, repo), "a tag points at a model whose signing failed"
    after = open_target(parse_reference(registry.ref(repo, "v1"))).resolve("v1").digest
    assert after == before, "v1 was moved to a model whose signing failed"
    ok = _run("verify", registry.ref(repo, "v1"), "--key", pub)
    assert ok.exit_code == 0, ok.output


def test_push_signs_before_tagging(registry: Any, checkpoint: Path, tmp_path: Path) -> None:
    """The order on the wire: the model manifest by digest, its signatures, then the tag."""
    priv, pub, _ = _keypair(tmp_path)
    proxy = FaultProxy(registry.host)
    try:
        res = _run("push", str(checkpoint), f"{proxy.host}/trust7/order:v1", "--sign-key", priv, "--json")
        assert res.exit_code == 0, res.output
        digest = json.loads(res.output)["digest"]
        puts = [p for m, p, _ in proxy.requests if m == "PUT" and "/manifests/" in p]
    finally:
        proxy.close()
    tag_put = puts.index("/v2/trust7/order/manifests/v1")
    model_put = puts.index(f"/v2/trust7/order/manifests/{digest}")
    fallback = [i for i, p in enumerate(puts) if p.endswith(f"/manifests/sha256-{digest[7:]}")]
    assert model_put < min(fallback) and max(fallback) < tag_put == len(puts) - 1, puts
    assert _run("verify", registry.ref("trust7/order", "v1"), "--key", pub).exit_code == 0


# ----------------------------------------------------------------------------- item 8
def _slow_reads(delay: float) -> Any:
    def rewrite(body: bytes, rng: str | None) -> bytes:
        time.sleep(delay)
        return body

    return rewrite


def test_concurrent_signers_both_discoverable(registry: Any, checkpoint: Path, tmp_path: Path) -> None:
    ref0 = registry.ref("trust8/base", "v1")
    assert _run("push", str(checkpoint), ref0).exit_code == 0
    digest = str(open_target(parse_reference(ref0)).resolve("v1").digest)
    fallback = "sha256-" + digest[7:]
    events_path = tmp_path / "events.jsonl"
    proxy = FaultProxy(registry.host)
    # a slow registry: reading the fallback index takes a while, so read-modify-writes overlap
    proxy.add(Fault(match=manifest_get(fallback), rewrite=_slow_reads(0.1), times=None))
    try:
        for round_ in range(3):
            repo = f"trust8/round{round_}"
            assert _run("cp", ref0, registry.ref(repo, "v1")).exit_code == 0
            ref = f"{proxy.host}/{repo}:v1"
            keys = [generate_key(), generate_key()]
            errors: list[BaseException] = []
            barrier = threading.Barrier(2)

            def sign(
                key: PrivateKey,
                ref: str = ref,
                errors: list[BaseException] = errors,
                barrier: threading.Barrier = barrier,
            ) -> None:
                try:
                    target = open_target(parse_reference(ref), for_write=True)
                    desc = target.resolve("v1")
                    barrier.wait()
                    sign_artifact(
                        target,
                        desc,
                        key,
                        chunk_table=False,
                        directory_signature=False,
                        events=EventLog(str(events_path)),
                    )
                except BaseException as exc:  # reported below
                    errors.append(exc)

            threads = [threading.Thread(target=sign, args=(k,)) for k in keys]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            assert not errors, errors
            target = open_target(parse_reference(registry.ref(repo, "v1")))
            desc = target.resolve("v1")
            for k in keys:
                result = verify_artifact(target, registry.ref(repo, "v1"), desc, [k.public])
                assert result.verified, f"round {round_}: signer {k.key_id[:12]} lost its signature"
    finally:
        proxy.close()
    # the race did happen (an entry was overwritten) and was repaired, not merely avoided
    assert any(e["event"] == "signing.referrer_lost" for e in read_events(str(events_path)))


def test_signer_fails_when_signature_stays_undiscoverable(
    registry: Any, checkpoint: Path, tmp_path: Path
) -> None:
    priv, _, _ = _keypair(tmp_path)
    ref = registry.ref("trust8/dropped", "v1")
    assert _run("push", str(checkpoint), ref).exit_code == 0
    digest = str(open_target(parse_reference(ref)).resolve("v1").digest)
    with referrers_index_clobbered(registry.host, "trust8/dropped", digest):
        res = _run("sign", ref, "--key", priv, "--no-chunk-table", "--no-directory-signature")
    assert res.exit_code != 0, res.output
    assert "not discoverable" in res.output and digest in res.output, res.output


# ----------------------------------------------------------------------------- item 10
def _layout(tmp_path: Path, checkpoint: Path) -> tuple[Any, Descriptor, str]:
    from tests.signing_helpers import pack_layout

    packed = pack_layout(checkpoint, tmp_path / "layout")
    return packed.target, packed.desc, packed.ref


@pytest.mark.parametrize("payload_type", ["application/json", "text/plain", "application/vnd.in-toto+jsonx"])
def test_dsse_of_another_payload_type_is_not_a_signature(
    payload_type: str, checkpoint: Path, tmp_path: Path
) -> None:
    target, desc, ref = _layout(tmp_path, checkpoint)
    key = generate_key()
    statement = manifest_statement(desc.digest.hex)
    envelope = sign_envelope(statement.to_bytes(), key, payload_type=payload_type)
    push_bundle_referrer(
        target,
        desc,
        Bundle(envelope, key.key_id),
        artifact_type=ARTIFACT_TYPE_SIGNATURE,
        predicate_type=PREDICATE_COSIGN_SIGN,
    )
    with pytest.raises(SignatureRefused, match="payloadType"):
        verify_artifact(target, ref, desc, [key.public])


def test_chunk_table_of_another_payload_type_is_refused(checkpoint: Path, tmp_path: Path) -> None:
    from modelpack.signing.chunks import compute_chunk_table, load_chunk_table
    from modelpack.signing.statements import PREDICATE_CHUNK_DIGESTS, Statement

    target, desc, _ = _layout(tmp_path, checkpoint)
    key = generate_key()
    manifest = Manifest.parse(target.fetch_manifest(str(desc.digest))[0])
    table = compute_chunk_table(target, manifest, 64 * 1024)
    statement = Statement(
        ({"digest": {"sha256": desc.digest.hex}},), PREDICATE_CHUNK_DIGESTS, table.to_predicate()
    )
    envelope = sign_envelope(statement.to_bytes(), key, payload_type="application/json")
    push_bundle_referrer(
        target,
        desc,
        Bundle(envelope, key.key_id),
        artifact_type=ARTIFACT_TYPE_CHUNK_DIGESTS,
        predicate_type=PREDICATE_CHUNK_DIGESTS,
    )
    with pytest.raises(ModelpackError, match="payloadType"):
        load_chunk_table(target, desc, [key.public], manifest=manifest)


# ----------------------------------------------------------------------------- item 11
DEPTH = 5000


def _push_raw_referrer(
    target: Any, subject: Descriptor, layer_bytes: bytes, artifact_type: str, *, extra: bytes = b""
) -> Descriptor:
    """A referrer manifest (one layer of ``layer_bytes``), optionally with a raw extra JSON field."""
    config = empty_config_descriptor()
    target.push_blob(bytes_blob_source(Descriptor(config.media_type, config.digest, config.size), EMPTY_JSON))
    layer = Descriptor(BUNDLE_MEDIA_TYPE, Digest.from_bytes(layer_bytes), len(layer_bytes))
    target.push_blob(bytes_blob_source(layer, layer_bytes))
    doc = {
        "schemaVersion": 2,
        "mediaType": MEDIA_TYPE_OCI_MANIFEST,
        "artifactType": artifact_type,
        "config": config.to_dict(),
        "layers": [layer.to_dict()],
        "subject": subject_descriptor(subject).to_dict(),
    }
    raw = json.dumps(doc, separators=(",", ":")).encode()
    if not extra:
        return target.push_manifest(raw, MEDIA_TYPE_OCI_MANIFEST, None)
    # past our own parser: straight to the registry, with the fallback index entry added by hand
    raw = raw[:-1] + b',"x":' + extra + b"}"
    base = f"http://{target.client.api_host}/v2/{target.repository}"
    digest = Digest.from_bytes(raw)
    put = requests.put(
        f"{base}/manifests/{digest}", data=raw, headers={"Content-Type": MEDIA_TYPE_OCI_MANIFEST}, timeout=30
    )
    # the attack needs the registry to store the deep manifest; distribution 2.8 does
    assert put.status_code in (200, 201), (
        f"registry refused the deep manifest: {put.status_code} {put.text[:200]}"
    )
    entry = Descriptor(MEDIA_TYPE_OCI_MANIFEST, digest, len(raw), artifact_type=artifact_type)
    fallback = f"sha256-{subject.digest.hex}"
    index = requests.get(
        f"{base}/manifests/{fallback}", headers={"Accept": MEDIA_TYPE_OCI_INDEX}, timeout=30
    ).json()
    index["manifests"].append(entry.to_dict())
    requests.put(
        f"{base}/manifests/{fallback}",
        data=json.dumps(index).encode(),
        headers={"Content-Type": MEDIA_TYPE_OCI_INDEX},
        timeout=30,
    ).raise_for_status()
    return entry


def _deep(depth: int = DEPTH) -> bytes:
    return b"[" * depth + b"]" * depth


def _deep_statement_bundle(key: PrivateKey) -> bytes:
    """A trusted key's envelope whose payload is a deeply nested document (a broken signer)."""
    payload = b'{"_type":"https://in-toto.io/Statement/v1","subject":' + _deep() + b"}"
    return Bundle(sign_envelope(payload, key), key.key_id).to_bytes()


def test_deep_referrers_next_to_a_valid_signature(registry: Any, checkpoint: Path, tmp_path: Path) -> None:
    priv, pub, key = _keypair(tmp_path)
    ref = registry.ref("trust11/deep", "v1")
    assert _run("push", str(checkpoint), ref, "--sign-key", priv).exit_code == 0
    target = open_target(parse_reference(ref), for_write=True)
    desc = target.resolve("v1")
    bad = [
        _push_raw_referrer(target, desc, _deep(), ARTIFACT_TYPE_SIGNATURE),
        _push_raw_referrer(target, desc, b'{"mediaType":' + _deep() + b"}", ARTIFACT_TYPE_SIGNATURE),
        _push_raw_referrer(target, desc, _deep_statement_bundle(key), ARTIFACT_TYPE_SIGNATURE),
        _push_raw_referrer(target, desc, _deep(), ARTIFACT_TYPE_CHUNK_DIGESTS),
    ]
    events = tmp_path / "events.jsonl"

    # library
    result = verify_artifact(target, ref, desc, [key.public], events=EventLog(str(events)))
    assert result.verified and result.chunk_table == "verified"
    skipped = {e["referrer"] for e in read_events(str(events)) if e["event"] == "signing.referrer_skipped"}
    assert {str(d.digest) for d in bad} <= skipped

    # verify, pull --policy, pull --cache
    v = _run("verify", ref, "--key", pub, "--json")
    assert v.exit_code == 0 and json.loads(v.output)["status"] == "verified", v.output
    policy = tmp_path / "policy.yaml"
    policy.write_text(f"rules:\n  - match: '{registry.host}/trust11/*'\n    keys: ['{pub}']\n")
    pulled = _run("pull", ref, str(tmp_path / "out"), "--policy", str(policy))
    assert pulled.exit_code == 0, pulled.output
    cached = _run("pull", ref, "--cache", str(tmp_path / "cache"), "--policy", str(policy), "--json")
    assert cached.exit_code == 0, cached.output


def test_deep_referrers_alone_are_a_refusal_that_says_why(
    registry: Any, checkpoint: Path, tmp_path: Path
) -> None:
    _, pub, key = _keypair(tmp_path)
    ref = registry.ref("trust11/deep-only", "v1")
    assert _run("push", str(checkpoint), ref).exit_code == 0
    target = open_target(parse_reference(ref), for_write=True)
    desc = target.resolve("v1")
    _push_raw_referrer(target, desc, _deep_statement_bundle(key), ARTIFACT_TYPE_SIGNATURE)
    res = _run("verify", ref, "--key", pub)
    assert res.exit_code == 1, res.output
    assert "nested deeper" in res.output and "Traceback" not in res.output


def test_deep_referrer_manifest_is_skipped(registry: Any, checkpoint: Path, tmp_path: Path) -> None:
    """The referrer manifest itself nested 5000 levels (in a field the registry ignores)."""
    priv, pub, key = _keypair(tmp_path)
    ref = registry.ref("trust11/deep-manifest", "v1")
    assert _run("push", str(checkpoint), ref, "--sign-key", priv).exit_code == 0
    target = open_target(parse_reference(ref), for_write=True)
    desc = target.resolve("v1")
    good = Bundle(sign_envelope(manifest_statement(desc.digest.hex).to_bytes(), key), key.key_id).to_bytes()
    _push_raw_referrer(target, desc, good, ARTIFACT_TYPE_SIGNATURE, extra=_deep())
    v = _run("verify", ref, "--key", pub, "--json")
    assert v.exit_code == 0 and json.loads(v.output)["status"] == "verified", v.output
