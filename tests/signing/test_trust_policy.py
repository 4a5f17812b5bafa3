"""Trust-policy rules match canonical names, so another spelling of the same
registry, repository or layout never falls through to a more permissive rule."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from modelpack.signing import TrustPolicy, generate_key
from modelpack.signing.keys import write_keypair

from modelpack.cli import main
from modelpack.errors import PolicyError
from modelpack.oci.reference import parse_reference

STRICT = "strict"


@pytest.mark.parametrize(
    ("text", "canonical"),
    [
        ("LOCALHOST:5000/models/x:v1", "localhost:5000/models/x"),
        ("Registry.Example.COM/models/x", "registry.example.com/models/x"),
        ("registry.example.com:443/models/x", "registry.example.com/models/x"),
        ("registry.example.com:0443/models/x", "registry.example.com/models/x"),
        ("localhost:05000/models/x", "localhost:5000/models/x"),
        ("docker.io/library/ubuntu", "docker.io/library/ubuntu"),
        ("ubuntu", "docker.io/library/ubuntu"),
        ("docker.io/ubuntu", "docker.io/library/ubuntu"),
        ("index.docker.io/ubuntu", "docker.io/library/ubuntu"),
        ("registry-1.docker.io/library/ubuntu:22.04", "docker.io/library/ubuntu"),
        ("Index.Docker.IO:443/acme/model", "docker.io/acme/model"),
        ("127.0.0.1:5000/models/x", "127.0.0.1:5000/models/x"),
        ("127.000.000.001:5000/models/x", "127.0.0.1:5000/models/x"),
        ("127.1:5000/models/x", "127.0.0.1:5000/models/x"),
        ("[0:0:0:0:0:0:0:1]:5000/models/x", "[::1]:5000/models/x"),
        ("[::FFFF:7F00:1]:5000/m/x", "[::ffff:7f00:1]:5000/m/x"),
        ("oci:/srv/./models/x:v1", "oci:/srv/models/x"),
        ("oci:/srv//models/../models/x@sha256:" + "a" * 64, "oci:/srv/models/x"),
        ("s3://bucket/models/x:v1", "s3://bucket/models/x"),
        ("oci://Registry.Example.COM/models/x:v1", "registry.example.com/models/x"),
    ],
)
def test_canonical_names(text: str, canonical: str) -> None:
    ref = parse_reference(text)
    assert ref.canonical_name == canonical
    # canonical() keeps tag and digest and is idempotent
    c = ref.canonical()
    assert (c.tag, c.digest) == (ref.tag, ref.digest)
    assert c.canonical() == c and parse_reference(str(c)).canonical_name == canonical


def test_relative_layout_is_made_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert parse_reference("oci:./models/x:v1").canonical_name == f"oci:{tmp_path}/models/x"


def _policy(tmp_path: Path, *globs: str) -> TrustPolicy:
    key = generate_key()
    _, pub = write_keypair(str(tmp_path / "strict"), key)
    match = ", ".join(f"'{g}'" for g in globs)
    (tmp_path / "policy.yaml").write_text(
        f"rules:\n  - match: [{match}]\n    keys: ['{pub}']\ndefault:\n  require_signature: false\n"
    )
    return TrustPolicy.load(tmp_path / "policy.yaml")


@pytest.mark.parametrize(
    "text",
    [
        "LOCALHOST:5000/models/x:v1",
        "localhost:05000/models/x",
        "Registry.Example.com/models/x",
        "registry.example.com:443/models/x",
        "index.docker.io/acme/model:v1",
        "registry-1.docker.io/acme/model",
        "acme/model",
        "docker.io/ubuntu",
        "ubuntu",
        "oci:/srv/./models/x:v1",
        "oci:/srv//models/x",
        "oci:/srv/other/../models/x",
        "oci://registry.example.com/models/x:v1",
    ],
)
def test_other_spellings_do_not_escape_a_strict_rule(text: str, tmp_path: Path) -> None:
    policy = _policy(
        tmp_path,
        "localhost:5000/models/*",
        "registry.example.com/models/*",
        "docker.io/acme/*",
        "docker.io/library/*",
        "oci:/srv/models/*",
    )
    rp = policy.for_reference(text)
    assert rp.require_signature and rp.keys, f"{text} fell through to rule {rp.rule}"


@pytest.mark.parametrize(
    "glob",
    [
        "LOCALHOST:5000/models/*",
        "registry.example.com:443/models/*",
        "index.docker.io/library/*",
        "oci:/srv/./models/*",
        "oci://registry.example.com/models/*",
    ],
)
def test_policy_globs_are_canonical_too(glob: str, tmp_path: Path) -> None:
    policy = _policy(tmp_path, glob)
    for text in ("localhost:5000/models/x", "registry.example.com/models/x", "ubuntu", "oci:/srv/models/x"):
        if policy.for_reference(text).keys:
            return
    pytest.fail(f"glob {glob!r} matches none of its own spellings")


def test_symlinked_layout_does_not_escape(tmp_path: Path) -> None:
    strict_dir = tmp_path / "srv" / "models"
    (strict_dir / "x").mkdir(parents=True)
    link = tmp_path / "innocent"
    os.symlink(strict_dir / "x", link)
    policy = _policy(tmp_path, f"oci:{strict_dir}/*")
    assert policy.for_reference(f"oci:{link}:v1").keys


def test_relative_layout_globs_are_refused(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match="absolute"):
        _policy(tmp_path, "oci:models/*")


def test_pull_with_uppercase_host_is_refused(registry: Any, checkpoint: Path, tmp_path: Path) -> None:
    """End to end: the unsigned model under a strict rule, named with another spelling."""
    key = generate_key()
    _, pub = write_keypair(str(tmp_path / "k"), key)
    port = registry.host.rsplit(":", 1)[1]
    ref = f"localhost:{port}/trust9/model:v1"
    assert CliRunner().invoke(main, ["push", str(checkpoint), ref]).exit_code == 0
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        f"rules:\n  - match: 'localhost:{port}/trust9/*'\n    keys: ['{pub}']\n"
        "default:\n  require_signature: false\n"
    )
    for spelling in (f"LOCALHOST:{port}/trust9/model:v1", f"localhost:0{port}/trust9/model:v1"):
        out = tmp_path / "out"
        res = CliRunner().invoke(main, ["pull", spelling, str(out), "--policy", str(policy), "--plain-http"])
        assert res.exit_code == 1, f"{spelling}: {res.output}"
        assert "unsigned" in res.output and not (out.exists() and any(out.iterdir()))


def test_deeply_nested_policy_file_is_a_policy_error(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text("[" * 5000 + "]" * 5000)
    with pytest.raises(PolicyError, match="nested"):
        TrustPolicy.load(path)
