"""The bundles modelpack writes verify with sigstore-js, a verifier nobody here wrote.

``modelpack push --sign-key`` (a real process) publishes its three signed referrers to a real
registry. This test fetches them the way any OCI client does (the referrers API, else the
``sha256-<hex>`` tag-schema index, then the bundle layer) and runs sigstore-js
(``@sigstore/verify``, installed by ``.ci/sigstore-js.sh`` into ``.node/sigstore-js``) on each,
key-based and offline, with the published public key as the only trusted key material
(``tests/sigstore_js_verify.cjs``). Bundles tampered in the payload (the signing time, the
subject), the signature, or checked against another key must fail.

node and the sigstore-js install are declared parts of the test set-up (``.ci/bootstrap.sh``):
when either is missing the test FAILS, it never skips.
"""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import requests

from modelpack.testdata.synthetic import SyntheticSpec, write_checkpoint
from tests.paths import REPO_ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = REPO_ROOT
SIGSTORE_JS = ROOT / ".node" / "sigstore-js"
VERIFY_SCRIPT = ROOT / "tests" / "sigstore_js_verify.cjs"
MODELPACK = str(Path(sys.executable).with_name("modelpack"))
INDEX = "application/vnd.oci.image.index.v1+json"
MANIFEST = "application/vnd.oci.image.manifest.v1+json"
KINDS = {
    "application/vnd.dev.sigstore.bundle.v0.3+json": "https://sigstore.dev/cosign/sign/v1",
    "application/vnd.modelpack.model-signing.v1+json": "https://model_signing/signature/v1.0",
    "application/vnd.modelpack.chunk-digests.v1+json": "https://modelpack.dev/chunk-digests/v1",
}


def node() -> str:
    found = shutil.which("node")
    assert found, "node is not installed: .ci/bootstrap.sh installs nodejs and npm"
    pkg = SIGSTORE_JS / "node_modules" / "@sigstore" / "verify" / "package.json"
    assert pkg.is_file(), f"sigstore-js is not installed in {SIGSTORE_JS}: run .ci/sigstore-js.sh"
    assert json.loads(pkg.read_text())["version"] == "3.1.1", "pinned @sigstore/verify changed"
    return found


def sigstore_js(bundle: Path, pub: str, predicate_type: str, subject: str = "") -> dict[str, Any]:
    args = [node(), str(VERIFY_SCRIPT), str(SIGSTORE_JS), str(bundle), pub, predicate_type]
    proc = subprocess.run(
        [*args, *([subject] if subject else [])], capture_output=True, text=True, timeout=60
    )
    lines = proc.stdout.strip().splitlines()
    assert lines, proc.stderr
    doc: dict[str, Any] = json.loads(lines[-1])
    assert (proc.returncode == 0) == doc["ok"], (proc.returncode, doc, proc.stderr)
    return doc


def cli(*args: str) -> str:
    proc = subprocess.run([MODELPACK, *args], capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def referrer_bundles(host: str, repo: str, digest: str) -> dict[str, bytes]:
    """artifactType → bundle bytes, read as any OCI client reads referrers."""
    base = f"http://{host}/v2/{repo}"
    r = requests.get(f"{base}/referrers/{digest}", headers={"Accept": INDEX}, timeout=30)
    if r.status_code == 404:  # distribution 2.8: the tag-schema fallback index
        r = requests.get(f"{base}/manifests/sha256-{digest[7:]}", headers={"Accept": INDEX}, timeout=30)
    r.raise_for_status()
    out = {}
    for entry in r.json()["manifests"]:
        m = requests.get(f"{base}/manifests/{entry['digest']}", headers={"Accept": MANIFEST}, timeout=30)
        m.raise_for_status()
        doc = m.json()
        assert doc["subject"]["digest"] == digest
        (layer,) = doc["layers"]
        blob = requests.get(f"{base}/blobs/{layer['digest']}", timeout=30)
        blob.raise_for_status()
        out[doc["artifactType"]] = blob.content
    return out


def tampered(raw: bytes, how: str) -> bytes:
    doc = json.loads(raw)
    env = doc["dsseEnvelope"]
    if how == "signature":
        sig = bytearray(base64.b64decode(env["signatures"][0]["sig"]))
        sig[-1] ^= 0x01
        env["signatures"][0]["sig"] = base64.b64encode(bytes(sig)).decode()
        return json.dumps(doc).encode()
    statement = json.loads(base64.b64decode(env["payload"]))
    subject = statement["subject"][0]
    if how == "signing-time":  # claim v1 was signed far in the future: would raise the bar
        subject["annotations"]["dev.modelpack.signed-at"] = "2099-01-01T00:00:00.000000Z"
    else:  # the signature replayed onto another manifest
        subject["digest"]["sha256"] = "0" * 64
    env["payload"] = base64.b64encode(json.dumps(statement).encode()).decode()
    return json.dumps(doc).encode()


def test_sigstore_js_verifies_what_modelpack_signed_and_refuses_tampering(
    registry: Any, tmp_path: Path
) -> None:
    ck = tmp_path / "ck"
    write_checkpoint(str(ck), SyntheticSpec(seed=11))
    cli("keygen", "--out", str(tmp_path / "ci"))
    cli("keygen", "--out", str(tmp_path / "other"))
    pub, other = str(tmp_path / "ci.pub"), str(tmp_path / "other.pub")
    repo = "interop/sigstore-js"
    ref = registry.ref(repo, "v1")
    digest = json.loads(cli("push", str(ck), ref, "--sign-key", str(tmp_path / "ci.key"), "--json"))["digest"]
    ours = json.loads(cli("verify", ref, "--key", pub, "--json"))
    assert ours["status"] == "verified" and ours["digest"] == digest

    bundles = referrer_bundles(registry.host, repo, digest)
    assert set(bundles) == set(KINDS), bundles.keys()
    for artifact_type, raw in bundles.items():
        path = tmp_path / (artifact_type.rsplit("/", 1)[-1].replace("+", "-") + ".json")
        path.write_bytes(raw)
        # the model_signing subject is the root of the file digests, the others the manifest
        subject = "" if "model-signing" in artifact_type else digest[7:]
        doc = sigstore_js(path, pub, KINDS[artifact_type], subject)
        assert doc["ok"], (artifact_type, doc)
        assert doc["keyId"] == ours["keyIds"][0]
        if artifact_type.endswith("bundle.v0.3+json"):
            # the signing time sigstore-js read from the verified payload is the one modelpack uses
            assert doc["signedAt"] == ours["signedAt"] and doc["signedAt"], doc

    signature = tmp_path / "vnd.dev.sigstore.bundle.v0.3-json.json"
    cosign_type = KINDS["application/vnd.dev.sigstore.bundle.v0.3+json"]
    wrong_key = sigstore_js(signature, other, cosign_type, digest[7:])
    assert not wrong_key["ok"] and wrong_key["code"] == "PUBLIC_KEY_ERROR", wrong_key
    for how in ("signing-time", "subject", "signature"):
        bad = tmp_path / f"tampered-{how}.json"
        bad.write_bytes(tampered(signature.read_bytes(), how))
        doc = sigstore_js(bad, pub, cosign_type, digest[7:])
        assert not doc["ok"] and doc["code"] == "SIGNATURE_ERROR", (how, doc)
    # a bundle that only claims the right subject after verification would also be refused
    wrong_subject = sigstore_js(signature, pub, cosign_type, "f" * 64)
    assert not wrong_subject["ok"] and wrong_subject["code"] == "SUBJECT", wrong_subject
