"""keygen / sign / verify through the CLI on an OCI layout (passphrase from stdin and env)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from modelpack.cli import main
from modelpack.events import read_events
from modelpack.targets.layout import OCILayoutTarget
from tests.signing_helpers import pack_layout

PASSPHRASE = "correct-horse-" + "battery"


def test_keygen_sign_verify_cli(checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MODELPACK_SIGNING_PASSPHRASE", raising=False)
    p = pack_layout(checkpoint, tmp_path / "layout")
    runner = CliRunner()
    prefix = str(tmp_path / "ci")
    kg = runner.invoke(
        main, ["keygen", "--out", prefix, "--passphrase-stdin", "--json"], input=PASSPHRASE + "\n"
    )
    assert kg.exit_code == 0, kg.output
    info = json.loads(kg.output)
    assert PASSPHRASE not in kg.output
    assert b"ENCRYPTED" in Path(info["privateKey"]).read_bytes()

    # no passphrase → a clear error naming the env variable, nothing signed
    nopass = runner.invoke(main, ["sign", p.ref, "--key", info["privateKey"]])
    assert nopass.exit_code == 1 and "MODELPACK_SIGNING_PASSPHRASE" in nopass.output

    monkeypatch.setenv("MODELPACK_SIGNING_PASSPHRASE", PASSPHRASE)
    signed = runner.invoke(
        main, ["sign", p.ref, "--key", info["privateKey"], "--chunk-size", "65536", "--json"]
    )
    assert signed.exit_code == 0, signed.output
    sdoc = json.loads(signed.output)
    assert sdoc["digest"] == str(p.desc.digest) and sdoc["keyId"] == info["keyId"]
    assert PASSPHRASE not in signed.output

    events = tmp_path / "ev.jsonl"
    ok = runner.invoke(main, ["verify", p.ref, "--key", info["publicKey"], "--events", str(events)])
    assert ok.exit_code == 0, ok.output
    assert ok.output.startswith(f"{p.ref}: verified")
    assert "chunk table: verified" in ok.output
    (ev,) = read_events(str(events))
    assert ev["event"] == "signing.verified" and ev["key_ids"] == [info["keyId"]]

    usage = runner.invoke(main, ["verify", p.ref])
    assert usage.exit_code == 2 and "--key, --policy or --certificate-identity" in usage.output
    both = runner.invoke(main, ["verify", p.ref, "--key", info["publicKey"], "--policy", info["publicKey"]])
    assert both.exit_code == 2


def test_push_sign_key_with_resharded_files(checkpoint: Path, tmp_path: Path) -> None:
    """--sign-key hashes chunk tables from local files, and falls back to reading the blobs back
    when the push re-sharded files (the layers are then not files on disk)."""
    from modelpack.signing import generate_key, load_public_key
    from modelpack.signing.chunks import load_chunk_table
    from modelpack.signing.keys import write_keypair

    from modelpack import api
    from modelpack.targets.layout import OCILayoutTarget

    priv, pub = write_keypair(str(tmp_path / "k"), generate_key())
    runner = CliRunner()
    for tag, extra in (("plain", []), ("resharded", ["--max-file-size", "1M"])):
        ref = f"oci:{tmp_path / 'layout'}:{tag}"
        res = runner.invoke(main, ["push", str(checkpoint), ref, "--sign-key", priv, "--json", *extra])
        assert res.exit_code == 0, res.output
        t = OCILayoutTarget(str(tmp_path / "layout"))
        manifest, digest = api.fetch_manifest(t, tag)
        table = load_chunk_table(t, t.resolve(tag), [load_public_key(pub)], manifest=manifest)
        assert table is not None and table.manifest_digest == digest
        weights = [layer for layer in manifest.layers if layer.media_type.endswith(".weight.v1.raw")]
        assert set(table.layers) == {str(layer.digest) for layer in weights}
        if tag == "resharded":
            assert len(weights) > 2  # really re-sharded


def test_pull_with_key_from_layout_pins_digest(checkpoint: Path, tmp_path: Path) -> None:
    from modelpack.signing import generate_key, sign_artifact
    from modelpack.signing.keys import write_keypair

    p = pack_layout(checkpoint, tmp_path / "layout")
    key = generate_key()
    _, pub = write_keypair(str(tmp_path / "k"), key)
    runner = CliRunner()
    refused = runner.invoke(main, ["pull", p.ref, str(tmp_path / "out"), "--key", pub])
    assert refused.exit_code == 1 and "unsigned" in refused.output
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    sign_artifact(p.target, p.desc, key, chunk_table=False)
    sig = tmp_path / "model.sig"
    ok = runner.invoke(
        main, ["pull", p.ref, str(tmp_path / "out"), "--key", pub, "--signature", str(sig), "--json"]
    )
    assert ok.exit_code == 0, ok.output
    assert json.loads(ok.output)["digest"] == str(p.desc.digest)
    assert sig.exists() and (tmp_path / "out" / "config.json").exists()


def test_private_key_text_argument_is_refused_unread(checkpoint: Path, tmp_path: Path) -> None:
    """A private key's PEM text as --key/--sign-key (readable by every local user in
    /proc/*/cmdline) is a usage error (exit 2) that echoes no part of the key and signs nothing;
    a key file, env:NAME and /dev/fd/N still sign."""
    from modelpack.signing import generate_key
    from modelpack.signing.keys import private_key_pem

    p = pack_layout(checkpoint, tmp_path / "layout")
    pem = private_key_pem(generate_key()).decode()
    body_lines = [line for line in pem.splitlines() if line and not line.startswith("-----")]
    runner = CliRunner()
    for args in (
        ["sign", p.ref, "--key", pem],
        ["sign", p.ref, "--key", "  " + pem],
        ["push", str(checkpoint), f"oci:{tmp_path / 'pushed'}:v1", "--sign-key", pem],
    ):
        res = runner.invoke(main, args)
        assert res.exit_code == 2, res.output
        assert "env:NAME" in res.output and "/proc" in res.output
        assert not any(line in res.output for line in body_lines)
        assert "Traceback" not in res.output
    assert OCILayoutTarget(str(tmp_path / "layout")).referrers(p.desc) == []
    assert not (tmp_path / "pushed").exists()

    key_file = tmp_path / "ci.key"
    key_file.write_text(pem)
    fd = os.open(key_file, os.O_RDONLY)
    try:
        for spec, env in ((str(key_file), {}), ("env:CI_KEY", {"CI_KEY": pem}), (f"/dev/fd/{fd}", {})):
            ok = runner.invoke(main, ["sign", p.ref, "--key", spec, "--no-directory-signature"], env=env)
            assert ok.exit_code == 0, ok.output
            os.lseek(fd, 0, os.SEEK_SET)
    finally:
        os.close(fd)
