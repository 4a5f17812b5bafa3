"""Directories as model_signing sees them: the paths a signature records as ignored (its own
file, git metadata, ``--ignore-paths``) are not part of the checked file set, as model_signing's
own ``verify`` has it; everything else still is, and a signature can only ignore paths inside
the directory."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from modelpack.signing import generate_key, sign_artifact, verify_directory
from modelpack.signing.keys import write_keypair
from modelpack.signing.model_signing import statement_ignore_paths
from modelpack.signing.sign import write_directory_signature
from modelpack.signing.statements import Statement

from modelpack.errors import BundleError, DirectorySignatureError
from tests.signing_helpers import pack_layout

MODEL_SIGNING = str(Path(sys.executable).parent / "model_signing")


def _git_metadata(directory: Path) -> None:
    (directory / ".git").mkdir()
    (directory / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (directory / ".gitattributes").write_text("*.safetensors filter=lfs\n")


def _model_signing_sign(directory: Path, priv: str, sig: Path) -> None:
    proc = subprocess.run(
        [MODEL_SIGNING, "sign", "key", "--private_key", priv, "--signature", str(sig), str(directory)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_a_directory_model_signing_signed_in_place_verifies(checkpoint: Path, tmp_path: Path) -> None:
    """``model_signing sign key DIR`` writes ``DIR/model.sig`` and records it and the git paths
    as ignored; modelpack accepted none of it ("unsigned extra file model.sig", ".git/HEAD").
    The same directory now verifies with the signature read in place or from a copy kept
    elsewhere, and a file the signature does not cover is still refused."""
    key = generate_key()
    priv, pub = write_keypair(str(tmp_path / "keys" / "ci"), key)
    model = tmp_path / "model"
    shutil.copytree(checkpoint, model)
    _git_metadata(model)
    sig = model / "model.sig"
    _model_signing_sign(model, priv, sig)

    files = verify_directory(str(model), [key.public], signature_path=str(sig))
    assert ".git/HEAD" not in files and "model.sig" not in files and "config.json" in files

    outside = tmp_path / "elsewhere.sig"
    shutil.copy(sig, outside)
    assert verify_directory(str(model), [key.public], signature_path=str(outside)) == files

    (model / "extra.bin").write_bytes(b"not signed")
    with pytest.raises(DirectorySignatureError, match=r"unsigned extra file extra\.bin"):
        verify_directory(str(model), [key.public], signature_path=str(outside))
    # and model_signing agrees on each verdict
    cmd = [MODEL_SIGNING, "verify", "key", "--signature", str(outside), "--public_key", pub, str(model)]
    assert subprocess.run(cmd, capture_output=True, timeout=180).returncode != 0


def test_modelpacks_own_signature_verifies_the_git_checkout_it_packed(
    checkpoint: Path, tmp_path: Path
) -> None:
    """pack skips dot files, so a git checkout's signature lists no ``.git``; checking that very
    checkout against it failed on ``.git/HEAD``. Git metadata is ignored as model_signing's
    ``verify`` ignores it by default; other unsigned files are not."""
    _git_metadata(checkpoint)
    p = pack_layout(checkpoint, tmp_path / "layout")
    key = generate_key()
    sign_artifact(p.target, p.desc, key, chunk_table=False)
    sig = write_directory_signature(p.target, p.desc, tmp_path / "model.sig")
    files = verify_directory(str(checkpoint), [key.public], signature_path=sig)
    assert not any(f.startswith(".git") for f in files)
    (checkpoint / ".hidden-weights.bin").write_bytes(b"x")
    with pytest.raises(DirectorySignatureError, match=r"unsigned extra file \.hidden-weights\.bin"):
        verify_directory(str(checkpoint), [key.public], signature_path=sig)


def _statement_with_ignores(ignores: object) -> Statement:
    payload = {
        "_type": "https://in-toto.io/Statement/v1",
        "subject": [{"name": "m", "digest": {"sha256": "0" * 64}}],
        "predicateType": "https://model_signing/signature/v1.0",
        "predicate": {
            "serialization": {
                "method": "files",
                "hash_type": "sha256",
                "allow_symlinks": False,
                "ignore_paths": ignores,
            },
            "resources": [],
        },
    }
    return Statement.from_bytes(json.dumps(payload).encode())


@pytest.mark.parametrize(
    "ignores",
    [["../outside"], ["/etc/passwd"], ["a/../../b"], [7], "model.sig", ["x"] * 20_000],
)
def test_a_signature_cannot_ignore_paths_outside_the_directory(ignores: object) -> None:
    """The recorded ignore list is signed, but it is still input: a path that leaves the
    directory, an absolute path, a non-string or an unbounded list is refused, not honoured."""
    with pytest.raises(BundleError):
        statement_ignore_paths(_statement_with_ignores(ignores))


def test_a_recorded_ignore_list_is_read_relative_to_the_directory() -> None:
    assert statement_ignore_paths(_statement_with_ignores(["model.sig", "sub/dir/"])) == (
        "model.sig",
        "sub/dir",
    )
    assert statement_ignore_paths(_statement_with_ignores([])) == ()
