"""A keyless (Sigstore) signature is trusted by the identity a policy names, offline.

The bundles come from a Sigstore instance made in the test process (``tests/fixtures/
local_sigstore.py``: CA, CT log and transparency log with their own keys); sigstore-python's
verifier, not modelpack, checks the certificate chain, SCT, log proofs and DSSE signature. The
attacks: another identity or issuer, a look-alike subject that a sloppy pattern would match, a
bundle from a Sigstore the node does not trust, a replayed signature of another manifest, a
payload changed after signing, a keyless signature where only keys are trusted, and a policy
that names a trusted root that is not there.
"""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from modelpack.signing.keyless import store_keyless_bundle
from modelpack.signing.policy import TrustPolicy
from modelpack.signing.statements import manifest_statement

from modelpack import api
from modelpack.cli import main
from modelpack.errors import PolicyError
from modelpack.oci.descriptor import Descriptor
from modelpack.targets.opener import open_target
from tests.fixtures.local_sigstore import LocalSigstore
from tests.fixtures.registry import RegistryServer
from tests.origin_down_support import run, serve  # noqa: F401 (serve: the fixture)
from tests.paths import REPO_ROOT

ISSUER = "https://token.actions.githubusercontent.com"
WORKFLOW = "https://github.com/acme/models/.github/workflows/publish-model.yml@refs/tags/v1"


@pytest.fixture(scope="module")
def sigstore() -> LocalSigstore:
    return LocalSigstore()


def _push(registry: RegistryServer, checkpoint: Path, repo: str) -> tuple[str, Descriptor]:
    ref = registry.ref(repo, "v1")
    api.push(str(checkpoint), ref)
    target = open_target(ref)
    return ref, target.resolve("v1")


def _sign(sigstore: LocalSigstore, ref: str, desc: Descriptor, identity: str = WORKFLOW, **kw: str) -> None:
    payload = manifest_statement(desc.digest.hex).to_bytes()
    store_keyless_bundle(
        open_target(ref), desc, sigstore.sign_dsse(payload, identity, kw.get("issuer", ISSUER))
    )


def _policy(tmp_path: Path, sigstore: LocalSigstore | None, identity: str) -> Path:
    root = "trusted_root.json"
    tmp_path.mkdir(parents=True, exist_ok=True)
    if sigstore is not None:
        sigstore.write_trusted_root(str(tmp_path / root))
    (tmp_path / "policy.yaml").write_text(
        "version: 1\n"
        "default:\n  require_signature: true\n"
        "rules:\n"
        "  - match: ['*']\n"
        f"    identities:\n      - issuer: {ISSUER}\n        {identity}\n"
        f"    trusted_root: {root}\n"
    )
    return tmp_path / "policy.yaml"


def _verify(ref: str, policy: Path) -> tuple[int, dict | str]:
    res = CliRunner().invoke(main, ["verify", ref, "--policy", str(policy), "--json"])
    if res.exit_code == 0:
        return 0, json.loads(res.output)
    return res.exit_code, res.output


def test_keyless_signature_is_trusted_by_its_identity_and_pulls(
    registry: RegistryServer, checkpoint: Path, sigstore: LocalSigstore, tmp_path: Path
) -> None:
    ref, desc = _push(registry, checkpoint, "keyless/ok")
    _sign(sigstore, ref, desc)
    policy = _policy(tmp_path, sigstore, f"subject: {WORKFLOW}")
    code, doc = _verify(ref, policy)
    assert code == 0, doc
    assert isinstance(doc, dict)
    assert doc["status"] == "verified" and doc["keyIds"] == [f"keyless:{ISSUER} {WORKFLOW}"]
    # the node path: pull into the cache under the policy, then a hit trusted from the record
    cache = tmp_path / "cache"
    outcomes = []
    pinned = f"{ref.rsplit(':', 1)[0]}@{desc.digest}"
    for r in (ref, pinned):
        res = CliRunner().invoke(main, ["pull", r, "--cache", str(cache), "--policy", str(policy), "--json"])
        assert res.exit_code == 0, res.output
        outcomes.append(json.loads(res.output))
    assert [(o["cache"]["state"], o["signature"]) for o in outcomes] == [
        ("cold", "verified"),
        ("hit", "verified"),
    ]
    # the pinned hit was trusted from the cache's record of the identity: no signature fetched
    assert "signature" not in outcomes[1]["timingsMs"]

    # a pattern matches the whole SAN (anchored by fullmatch), so the same rule by regex works
    regex_policy = _policy(
        tmp_path / "re", sigstore, "subject_regex: https://github\\.com/acme/models/.*@refs/tags/v.*"
    )
    assert _verify(ref, regex_policy)[0] == 0


@pytest.mark.parametrize(
    ("signer", "issuer", "why"),
    [
        (
            "https://github.com/mallory/models/.github/workflows/x.yml@refs/heads/main",
            ISSUER,
            "not by an identity",
        ),
        (WORKFLOW, "https://accounts.google.com", "does not verify"),
        # a look-alike: the trusted pattern is a prefix of it, fullmatch refuses it
        (WORKFLOW + ".evil", ISSUER, "not by an identity"),
    ],
)
def test_other_identities_are_refused(
    registry: RegistryServer,
    checkpoint: Path,
    sigstore: LocalSigstore,
    tmp_path: Path,
    signer: str,
    issuer: str,
    why: str,
) -> None:
    ref, desc = _push(registry, checkpoint, f"keyless/other-{abs(hash((signer, issuer))) % 10**8}")
    _sign(sigstore, ref, desc, signer, issuer=issuer)
    policy = _policy(tmp_path, sigstore, "subject_regex: https://github\\.com/acme/models/.*@refs/tags/v1")
    code, out = _verify(ref, policy)
    assert code == 1 and why in str(out), out
    assert "Traceback" not in str(out)


def test_a_sigstore_the_node_does_not_trust_is_refused(
    registry: RegistryServer, checkpoint: Path, sigstore: LocalSigstore, tmp_path: Path
) -> None:
    ref, desc = _push(registry, checkpoint, "keyless/foreign")
    _sign(LocalSigstore(), ref, desc)  # same identity, another CA and logs
    code, out = _verify(ref, _policy(tmp_path, sigstore, f"subject: {WORKFLOW}"))
    assert code == 1 and "does not verify" in str(out), out


def test_replayed_and_altered_bundles_are_refused(
    registry: RegistryServer, checkpoint: Path, sigstore: LocalSigstore, tmp_path: Path
) -> None:
    ref, desc = _push(registry, checkpoint, "keyless/replay")
    other = Descriptor(desc.media_type, desc.digest.__class__("sha256:" + "ab" * 32), 1)
    # a valid keyless signature of another manifest, stored as this one's referrer
    bundle = sigstore.sign_dsse(manifest_statement(other.digest.hex).to_bytes(), WORKFLOW, ISSUER)
    store_keyless_bundle(open_target(ref), desc, bundle)
    policy = _policy(tmp_path, sigstore, f"subject: {WORKFLOW}")
    code, out = _verify(ref, policy)
    assert code == 1 and "replayed signature" in str(out), out

    ref2, desc2 = _push(registry, checkpoint, "keyless/altered")
    doc = json.loads(sigstore.sign_dsse(manifest_statement("cd" * 32).to_bytes(), WORKFLOW, ISSUER))
    # the payload swapped for a statement about this manifest after signing
    doc["dsseEnvelope"]["payload"] = base64.b64encode(
        manifest_statement(desc2.digest.hex).to_bytes()
    ).decode()
    store_keyless_bundle(open_target(ref2), desc2, json.dumps(doc).encode())
    code, out = _verify(ref2, policy)
    assert code == 1 and "does not verify" in str(out), out


def test_keyless_signature_where_only_keys_are_trusted(
    registry: RegistryServer, checkpoint: Path, sigstore: LocalSigstore, tmp_path: Path
) -> None:
    from modelpack.signing import generate_key
    from modelpack.signing.keys import write_keypair

    ref, desc = _push(registry, checkpoint, "keyless/keys-only")
    _sign(sigstore, ref, desc)
    write_keypair(str(tmp_path / "k"), generate_key())
    res = CliRunner().invoke(main, ["verify", ref, "--key", str(tmp_path / "k.pub")])
    assert res.exit_code == 1 and "keyless and the policy trusts no identity" in res.output, res.output


def test_policy_errors_for_identities(tmp_path: Path) -> None:
    def load(rule: str) -> TrustPolicy:
        (tmp_path / "p.yaml").write_text(f"version: 1\nrules:\n  - match: ['*']\n{rule}")
        return TrustPolicy.load(tmp_path / "p.yaml")

    for rule, message in [
        (f"    identities:\n      - issuer: {ISSUER}\n", "exactly one of subject"),
        (
            f"    identities:\n      - issuer: {ISSUER}\n        subject: a\n        subject_regex: b\n",
            "exactly one",
        ),
        ("    identities:\n      - subject: a\n", "needs an issuer"),
        (f"    identities:\n      - issuer: {ISSUER}\n        subject_regex: '('\n", "subject_regex"),
        ("    trusted_root: r.json\n", "without identities"),
        (f"    identities:\n      - issuer: {ISSUER}\n        subjet: typo\n", r"identities\[0\]"),
    ]:
        with pytest.raises(PolicyError, match=message):
            load(rule)


def test_missing_trusted_root_refuses_with_its_path(
    registry: RegistryServer, checkpoint: Path, sigstore: LocalSigstore, tmp_path: Path
) -> None:
    ref, desc = _push(registry, checkpoint, "keyless/no-root")
    _sign(sigstore, ref, desc)
    policy = _policy(tmp_path, None, f"subject: {WORKFLOW}")  # trusted_root.json never written
    code, out = _verify(ref, policy)
    assert code == 1 and "trusted_root.json" in str(out) and "cannot read" in str(out), out


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (b"{not json", "not a Sigstore trusted root"),
        (
            b'{"mediaType": "application/vnd.dev.sigstore.trustedroot+json;version=0.1", "tlogs": 5}',
            "not a Sigstore",
        ),
        (b'{"a": "' + b"x" * (1024 * 1024) + b'"}', "larger than"),
    ],
    ids=["not-json", "wrong-shape", "oversized"],
)
def test_a_malformed_trusted_root_refuses_naming_it_and_never_falls_back(
    registry: RegistryServer,
    checkpoint: Path,
    sigstore: LocalSigstore,
    tmp_path: Path,
    content: bytes,
    needle: str,
) -> None:
    ref, desc = _push(registry, checkpoint, "keyless/bad-root")
    _sign(sigstore, ref, desc)
    policy = _policy(tmp_path, None, f"subject: {WORKFLOW}")
    (tmp_path / "trusted_root.json").write_bytes(content)
    code, out = _verify(ref, policy)
    assert code == 1 and "trusted_root.json" in str(out) and needle in str(out), out
    assert "Traceback" not in str(out)


EXAMPLE_POLICY = REPO_ROOT / "examples" / "policy.yaml"


@pytest.mark.parametrize(
    ("identity", "issuer", "trusted"),
    [
        ("https://github.com/ORG/REPO/.github/workflows/publish-model.yml@refs/tags/v1", ISSUER, True),
        ("https://gitlab.com/GROUP/PROJECT//.gitlab-ci.yml@refs/tags/v2.0", "https://gitlab.com", True),
        # the same workflow from a branch, another repository's workflow, another issuer
        ("https://github.com/ORG/REPO/.github/workflows/publish-model.yml@refs/heads/main", ISSUER, False),
        ("https://github.com/ORG/REPO-fork/.github/workflows/publish-model.yml@refs/tags/v1", ISSUER, False),
        (
            "https://github.com/ORG/REPO/.github/workflows/publish-model.yml@refs/tags/v1",
            "https://gitlab.com",
            False,
        ),
    ],
)
def test_example_policy_trusts_the_example_ci_identities(
    registry: RegistryServer,
    checkpoint: Path,
    sigstore: LocalSigstore,
    tmp_path: Path,
    identity: str,
    issuer: str,
    trusted: bool,
) -> None:
    """examples/policy.yaml's keyless rule, as committed, with only its host made the local
    registry's and the local Sigstore's root as its trusted_root."""
    import yaml

    doc = yaml.safe_load(EXAMPLE_POLICY.read_text().replace("registry.example.com", registry.host))
    (rule,) = [r for r in doc["rules"] if "identities" in r]
    rule["trusted_root"] = sigstore.write_trusted_root(str(tmp_path / "trusted_root.json"))
    shutil.copytree(EXAMPLE_POLICY.parent / "keys", tmp_path / "keys")
    (tmp_path / "policy.yaml").write_text(yaml.safe_dump(doc))
    ref, desc = _push(registry, checkpoint, f"models/llama-{abs(hash((identity, issuer))) % 10**8}")
    _sign(sigstore, ref, desc, identity, issuer=issuer)
    code, out = _verify(ref, tmp_path / "policy.yaml")
    assert (code == 0) is trusted, out


def test_verify_with_cosign_style_identity_flags(
    registry: RegistryServer, checkpoint: Path, sigstore: LocalSigstore, tmp_path: Path
) -> None:
    ref, desc = _push(registry, checkpoint, "keyless/flags")
    _sign(sigstore, ref, desc)
    root = sigstore.write_trusted_root(str(tmp_path / "trusted_root.json"))
    base = ["verify", ref, "--trusted-root", root, "--certificate-oidc-issuer", ISSUER, "--json"]
    ok = CliRunner().invoke(main, [*base, "--certificate-identity", WORKFLOW])
    assert ok.exit_code == 0 and json.loads(ok.output)["status"] == "verified", ok.output
    ok_re = CliRunner().invoke(main, [*base, "--certificate-identity-regexp", r"https://github\.com/acme/.*"])
    assert ok_re.exit_code == 0, ok_re.output
    wrong = CliRunner().invoke(main, [*base, "--certificate-identity", WORKFLOW + "x"])
    assert wrong.exit_code == 1 and "not by an identity the policy trusts" in wrong.output, wrong.output
    # the issuer is required, and one of the two subject forms
    no_issuer = CliRunner().invoke(main, ["verify", ref, "--certificate-identity", WORKFLOW])
    assert no_issuer.exit_code == 2 and "--certificate-oidc-issuer" in no_issuer.output
    both = CliRunner().invoke(
        main, [*base, "--certificate-identity", WORKFLOW, "--certificate-identity-regexp", "x"]
    )
    assert both.exit_code == 2


def test_keyless_signed_pinned_start_through_a_peer_with_the_origin_down(
    registry_factory: Any,
    checkpoint: Path,
    sigstore: LocalSigstore,
    tmp_path: Path,
    serve: Any,  # noqa: F811
) -> None:
    """Node A verified the keyless signature and keeps it; node B, origin down, gets model and
    signature from A's ``cache serve`` and trusts it by the same identity rule."""
    origin = registry_factory.start()
    ref, desc = _push(origin, checkpoint, "keyless/peers")
    _sign(sigstore, ref, desc)
    policy = _policy(tmp_path, sigstore, f"subject: {WORKFLOW}")
    pinned = f"{origin.host}/keyless/peers@{desc.digest}"
    node_a = tmp_path / "node-a"
    assert run(tmp_path, "pull", "--cache", str(node_a), "--policy", str(policy), pinned).returncode == 0
    peer = serve(node_a)
    origin.kill()
    b = run(
        tmp_path,
        "pull", "--cache", str(tmp_path / "node-b"), "--policy", str(policy), "--mirror", peer.url,
        "--retry-for", "2s", "--json", pinned,
    )  # fmt: skip
    assert b.returncode == 0, b.stderr
    doc = json.loads(b.stdout)
    assert doc["signature"] == "verified" and set(doc["bytesBySource"]) == {peer.host}, doc
    # a peer cannot vouch for an identity the policy does not name: node C trusts another subject
    other = _policy(tmp_path / "other", sigstore, f"subject: {WORKFLOW}-other")
    c = run(
        tmp_path,
        "pull", "--cache", str(tmp_path / "node-c"), "--policy", str(other), "--mirror", peer.url,
        "--retry-for", "2s", pinned,
    )  # fmt: skip
    assert c.returncode == 1 and "not by an identity the policy trusts" in c.stderr, c.stderr
