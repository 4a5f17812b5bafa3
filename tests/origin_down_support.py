"""Shared by the origin-down tests (not a test module): a signed model at a real origin, a node
cache that pulled it under the key, real ``cache serve`` processes, the CLI as a subprocess."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from modelpack.signing.keys import generate_key, write_keypair

from modelpack.cli import main


def cli(*argv: str) -> list[str]:
    return [sys.executable, "-m", "modelpack.cli", *argv]


def env(tmp_path: Path, **extra: str) -> dict[str, str]:
    out = dict(os.environ, MODELPACK_HOSTS_DIR=str(tmp_path / "no-hosts"))
    out.pop("MODELPACK_MIRRORS", None)  # only the mirrors a test names
    out.update(extra)
    return out


def run(tmp_path: Path, *argv: str, timeout: float = 120, **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cli(*argv), env=env(tmp_path, **extra), capture_output=True, text=True, timeout=timeout
    )


def events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@dataclass
class SignedModel:
    host: str
    repo: str
    digest: str
    pub: str
    key_id: str

    @property
    def pinned(self) -> str:
        return f"{self.host}/{self.repo}@{self.digest}"

    @property
    def tagged(self) -> str:
        return f"{self.host}/{self.repo}:v1"

    def key_policy(self, match: str) -> str:
        """A trust policy that requires this model's key (inline PEM) for ``match``."""
        pem = "\n".join("          " + line for line in Path(self.pub).read_text().strip().splitlines())
        return (
            f"rules:\n  - match: '{match}'\n    keys:\n      - pem: |\n{pem}\n    require_signature: true\n"
        )


def push_signed(origin: Any, checkpoint: Path, tmp_path: Path, repo: str) -> SignedModel:
    """Push ``checkpoint`` signed (manifest signature, directory signature, chunk table)."""
    key = generate_key()
    priv, pub = write_keypair(str(tmp_path / "keys" / repo.replace("/", "-")), key)
    res = CliRunner().invoke(
        main, ["push", str(checkpoint), origin.ref(repo, "v1"), "--sign-key", priv, "--json"]
    )
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    return SignedModel(origin.host, repo, doc["digest"], pub, key.key_id)


def warm_node(tmp_path: Path, node: Path, model: SignedModel, *, key: bool = True) -> None:
    """Pull ``model`` into the node cache ``node`` (under its key unless ``key=False``: then the
    cache holds the model but no verified signature)."""
    got = run(tmp_path, "pull", "--cache", str(node), *(("--key", model.pub) if key else ()), model.pinned)
    assert got.returncode == 0, got.stderr


def signed_peer(
    registry_factory: Any, checkpoint: Path, tmp_path: Path, serve: Any, repo: str, *, key: bool = True
) -> tuple[Any, SignedModel, Any]:
    """(origin, model, peer): ``checkpoint`` pushed signed to a fresh origin, pulled into node A's
    cache (``warm_node``) and served by node A's ``cache serve``; the origin still up."""
    origin = registry_factory.start()
    model = push_signed(origin, checkpoint, tmp_path, repo)
    node_a = tmp_path / "node-a"
    warm_node(tmp_path, node_a, model, key=key)
    return origin, model, serve(node_a)


class Served:
    def __init__(self, proc: subprocess.Popen[str], url: str) -> None:
        self.proc = proc
        self.url = url
        self.host = url.split("://", 1)[1]


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Any]:
    """Start real ``modelpack cache serve`` processes on free loopback ports; stopped at the end."""
    started: list[subprocess.Popen[str]] = []

    def start(cache: Path) -> Served:
        proc = subprocess.Popen(
            cli("cache", "serve", "--cache", str(cache), "--listen", "127.0.0.1:0"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env(tmp_path),
        )
        started.append(proc)
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 30)
        assert ready, "cache serve printed no URL within 30 s"
        url = proc.stdout.readline().strip()
        assert url.startswith("http"), (url, proc.poll())
        return Served(proc, url)

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
