"""Trust policy files: rule matching, key sources, strict parsing with the file and field named."""

from __future__ import annotations

from pathlib import Path

import pytest
from modelpack.signing import TrustPolicy, generate_key
from modelpack.signing.policy import RepositoryPolicy

from modelpack.errors import PolicyError
from modelpack.oci.reference import parse_reference


def _pub(tmp_path: Path, name: str) -> tuple[Path, str]:
    key = generate_key()
    p = tmp_path / f"{name}.pub"
    p.write_bytes(key.public.pem)
    return p, key.key_id


def test_rules_first_match_and_key_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    prod, prod_id = _pub(tmp_path, "prod")
    _, dev_id = _pub(tmp_path, "dev")
    monkeypatch.setenv("DEV_KEY", (tmp_path / "dev.pub").read_text())
    inline_key = generate_key()
    pem = inline_key.public.pem.decode().replace("\n", "\n          ")
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        f"""version: 1
default:
  require_signature: false
rules:
  - match: ["registry.example.com/models/prod/*", "registry.example.com/models/release-*"]
    keys: [{{path: {prod.name}}}]
    require_directory_signature: true
  - match: "registry.example.com/models/*"
    keys:
      - env: DEV_KEY
      - pem: |
          {pem}
    require_chunk_table: true
"""
    )
    pol = TrustPolicy.load(policy)
    p = pol.for_reference("registry.example.com/models/prod/llama:v1")
    assert p.key_ids == [prod_id] and p.require_signature and p.require_directory_signature
    assert pol.for_reference(
        parse_reference("registry.example.com/models/release-7@sha256:" + "a" * 64)
    ).key_ids == [prod_id]
    d = pol.for_reference("registry.example.com/models/dev/x:1")
    assert (
        d.key_ids == [dev_id, inline_key.key_id]
        and d.require_chunk_table
        and not d.require_directory_signature
    )
    other = pol.for_reference("ghcr.io/someone/else:1")
    assert other.rule == "default" and not other.require_signature and other.keys == ()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("rules: {}\n", "'rules' must be a list"),
        ("rules:\n  - keys: []\n", "'match' must be a glob"),
        ("rules:\n  - match: x\n    require_signature: maybe\n", "require_signature must be true or false"),
        ("rules:\n  - match: x\n    trusted: []\n", "unknown keys ['trusted']"),
        ("rules:\n  - match: x\n    keys: [{path: missing.pub}]\n", "rules[0].keys[0]"),
        ("rules:\n  - match: x\n    keys: [{url: http://x}]\n", "unknown key source 'url'"),
        ("version: 2\n", "unsupported policy version"),
        ("- a\n", "a policy is a mapping"),
        ("rules: [\n", "not YAML"),
    ],
)
def test_policy_errors_name_file_and_field(tmp_path: Path, text: str, message: str) -> None:
    p = tmp_path / "bad.yaml"
    p.write_text(text)
    with pytest.raises(PolicyError) as info:
        TrustPolicy.load(p)
    assert message in str(info.value) and str(p) in str(info.value)


def test_decisions_carry_reasons() -> None:
    key = generate_key()
    strict = RepositoryPolicy((key.public,), rule="r")
    assert strict.decide([key.key_id], []).allowed
    no = strict.decide([], [])
    assert not no.allowed and no.reason.startswith("unsigned")
    bad = strict.decide([], ["signature X is not by a trusted key"])
    assert not bad.allowed and "not by a trusted key" in bad.reason
    lenient = RepositoryPolicy((), require_signature=False, rule="r")
    assert lenient.decide([], []).allowed
    empty = RepositoryPolicy((), require_signature=True, rule="r")
    assert not empty.decide([], []).allowed and "trusts no key" in empty.decide([], []).reason
