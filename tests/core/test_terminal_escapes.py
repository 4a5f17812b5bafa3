"""Text from outside never reaches the terminal as control sequences.

The attacks: a model name, an annotation, a file path, a tag or a registry's error message
carrying OSC 52 (a clipboard write), clear-screen, cursor moves, a carriage return, a newline
that starts a fake "signature: verified" line, a C1 control. Every command runs as a real
subprocess of the CLI; the outside is a real registry (a crafted manifest pushed to it), an OCI
layout, or a small hostile loopback registry for tags and error bodies. What crosses stdout and
stderr must hold no ESC, BEL, CR, C1 character or other C0 control but newline and tab, and an
outside value never adds a line. ``--json`` stays valid JSON carrying the value unchanged.
"""

from __future__ import annotations

import hashlib
import http.server
import io
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from modelpack.progress import Progress
from modelpack.terminal import for_terminal
from tests.fixtures.loopback import LoopbackServer
from tests.fixtures.registry import RegistryServer

pytestmark = pytest.mark.timeout(180)

OSC52 = "\x1b]52;c;ZWNobyBwd25lZA==\x07"
CLEAR = "\x1b[2J\x1b[H"
FAKE_LINE = "\nsignature: \x1b[32mverified\x1b[0m"
C1 = "\x9b31m"  # CSI as one C1 character
EVIL = f"llama{OSC52}{CLEAR}\r{C1}\x08\x7f{FAKE_LINE}"
#: what must never be written: every C0 control but \n and \t, DEL, C1
RAW = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "modelpack.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "CI": "1"},
    )


def _assert_inert(proc: subprocess.CompletedProcess[str]) -> None:
    for stream in (proc.stdout, proc.stderr):
        assert not RAW.findall(stream), repr(stream)
    if "--debug" not in proc.args:
        assert "Traceback" not in proc.stderr, proc.stderr
    # the fake line never starts a line of its own
    for line in (proc.stdout + proc.stderr).splitlines():
        assert not line.startswith("signature:"), repr(line)


def test_for_terminal_escapes_visibly() -> None:
    assert for_terminal("a\x1b[2Jb") == "a\\x1b[2Jb"
    assert for_terminal("x\ny\tz\r") == "x\\ny\\tz\\r"
    assert for_terminal("\x9b\x7f\u202e") == "\\x9b\\x7f\\u202e"
    assert for_terminal("plain ünïcode ✓") == "plain ünïcode ✓"
    assert not RAW.findall(for_terminal(EVIL)) and "\n" not in for_terminal(EVIL)


@pytest.fixture
def evil_layout(tmp_path: Path, checkpoint: Path) -> str:
    layout = f"oci:{tmp_path / 'layout'}:v1"
    proc = _cli("pack", str(checkpoint), layout, "--name", EVIL, "--description", EVIL)
    assert proc.returncode == 0, proc.stderr
    return layout


def test_inspect_of_an_evil_name_prints_it_escaped(evil_layout: str) -> None:
    proc = _cli("inspect", evil_layout)
    assert proc.returncode == 0, proc.stderr
    _assert_inert(proc)
    assert "\\x1b]52;c;" in proc.stdout  # shown, visibly
    as_json = _cli("inspect", evil_layout, "--json")
    assert as_json.returncode == 0, as_json.stderr
    assert not RAW.findall(as_json.stdout)
    assert EVIL in _strings(json.loads(as_json.stdout))  # the value itself, unchanged


def _strings(doc: Any) -> list[str]:
    if isinstance(doc, dict):
        return [s for v in doc.values() for s in _strings(v)]
    if isinstance(doc, list):
        return [s for v in doc for s in _strings(v)]
    return [doc] if isinstance(doc, str) else []


def _push_with_path(registry: RegistryServer, checkpoint: Path, repo: str, path: str) -> str:
    """A real registry holding a pushed model plus a manifest whose first layer claims ``path``."""
    src = registry.ref(repo, "v1")
    proc = _cli("push", str(checkpoint), src)
    assert proc.returncode == 0, proc.stderr
    url = f"{registry.url}/v2/{repo}/manifests/v1"
    accept = "application/vnd.oci.image.manifest.v1+json"
    manifest = requests.get(url, headers={"Accept": accept}, timeout=10).json()
    manifest["layers"][0].setdefault("annotations", {})["org.cncf.model.filepath"] = path
    put = requests.put(
        f"{registry.url}/v2/{repo}/manifests/evil",
        data=json.dumps(manifest).encode(),
        headers={"Content-Type": accept},
        timeout=10,
    )
    assert put.status_code == 201, put.text
    return registry.ref(repo, "evil")


@pytest.mark.parametrize("path", [f"model{CLEAR}.safetensors", "a\nb.safetensors", "x\x9bz", "d/\x07e"])
def test_control_characters_in_file_paths_are_refused_at_pull(
    registry: RegistryServer, checkpoint: Path, tmp_path: Path, path: str
) -> None:
    repo = f"term/paths-{abs(hash(path)) % 10**8}"
    ref = _push_with_path(registry, checkpoint, repo, path)
    proc = _cli("pull", ref, str(tmp_path / "out"))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    _assert_inert(proc)
    assert "control character" in proc.stderr, proc.stderr
    assert not any(RAW.search(p.name) or "\n" in p.name for p in tmp_path.rglob("*"))
    proc = _cli("inspect", ref)
    _assert_inert(proc)


def test_control_characters_in_file_paths_are_refused_at_pack(tmp_path: Path, checkpoint: Path) -> None:
    (checkpoint / f"notes{CLEAR}.txt").write_text("hi")
    proc = _cli("pack", str(checkpoint), f"oci:{tmp_path / 'l'}:v1")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    _assert_inert(proc)
    assert "control character" in proc.stderr, proc.stderr


MANIFEST: dict[str, Any] = {
    "schemaVersion": 2,
    "mediaType": "application/vnd.oci.image.manifest.v1+json",
    "artifactType": f"application/vnd.cncf.model.manifest.v1+json{FAKE_LINE}",
    "config": {
        "mediaType": "application/vnd.cncf.model.config.v1+json",
        "digest": "sha256:" + "ab" * 32,
        "size": 2,
    },
    "layers": [],
    "annotations": {"org.opencontainers.image.created": f"2026{FAKE_LINE}{OSC52}"},
}


class HostileRegistry(LoopbackServer):
    """A loopback 'registry' whose tags and error messages carry terminal escapes."""

    def __init__(self) -> None:
        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/v2/":
                    status, doc = 200, {}
                elif path == "/v2/m/x/tags/list":  # valid tags, hostile manifests: rows are printed
                    status, doc = 200, {"name": "m/x", "tags": ["v1", "v2"]}
                elif path.endswith("/tags/list"):
                    status, doc = 200, {"name": "m/evil", "tags": [f"v1{OSC52}", f"v2{FAKE_LINE}"]}
                elif path == "/v2/_catalog":
                    status, doc = 200, {"repositories": [f"m/x{CLEAR}", "m/x"]}
                elif "/manifests/v" in path:  # the tags listed: a manifest whose text is hostile
                    status, doc = 200, MANIFEST
                else:
                    message = f"not here{CLEAR}{FAKE_LINE}{OSC52}"
                    status, doc = 404, {"errors": [{"code": "MANIFEST_UNKNOWN", "message": message}]}
                body = json.dumps(doc).encode()
                self.send_response(status)
                kind = "application/vnd.oci.image.manifest.v1+json" if doc is MANIFEST else "application/json"
                self.send_header("Content-Type", kind)
                if doc is MANIFEST:
                    self.send_header("Docker-Content-Digest", "sha256:" + hashlib.sha256(body).hexdigest())
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_HEAD = do_GET

        super().__init__(Handler)


@pytest.fixture
def hostile() -> Iterator[HostileRegistry]:
    server = HostileRegistry()
    yield server
    server.close()


@pytest.mark.parametrize(
    "args",
    [
        ("inspect", "{host}/m/x:v1"),
        ("verify", "{host}/m/x:v1", "--key", "{key}"),
        ("ls", "{host}/m/x"),
        ("ls", "{host}/m/evil"),
        ("audit", "{host}/m/evil"),
        ("audit", "{host}/m/x"),
        ("audit", "{host}"),
        ("pull", "{host}/m/x:v1", "{tmp}/out"),
        ("--debug", "inspect", "{host}/m/x:v1"),
        ("audit", "{host}/m/x", "--json"),
    ],
    ids=lambda a: " ".join(a),
)
def test_registry_text_reaches_the_terminal_escaped(
    hostile: HostileRegistry, tmp_path: Path, args: tuple[str, ...]
) -> None:
    key = tmp_path / "k.pub"
    if "--key" in args:
        gen = _cli("keygen", "--out", str(tmp_path / "k"))
        assert gen.returncode == 0, gen.stderr
        key = tmp_path / "k.pub"
    argv = [a.format(host=hostile.host, tmp=tmp_path, key=key) for a in args]
    proc = _cli(*argv, "--retry-for", "0")
    _assert_inert(proc)
    if "--json" in argv:
        json.loads(proc.stdout)


def test_progress_bars_show_outside_names_escaped(monkeypatch: pytest.MonkeyPatch) -> None:
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    with Progress(100, f"pull{OSC52}", mode="on") as progress:
        bar = progress.transfer(100, f"model{CLEAR}.safetensors")
        bar.update(100)
        bar.close()
    out = err.getvalue()
    assert "\x1b]52" not in out and "\x1b[2J" not in out and "\x07" not in out, repr(out)
    assert "\\x1b" in out


def _safetensors(path: Path, names: list[str]) -> None:
    header = {
        n: {"dtype": "F32", "shape": [2], "data_offsets": [8 * i, 8 * i + 8]} for i, n in enumerate(names)
    }
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + b"\x00" * (8 * len(names)))


def test_diff_shows_tensor_names_from_headers_escaped(tmp_path: Path) -> None:
    """A tensor name is header text: ``diff`` prints it as one inert line."""
    for name, tensors in (("a", ["w"]), ("b", ["w", f"x{FAKE_LINE}{OSC52}"])):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text('{"model_type": "llama"}')
        _safetensors(d / "model.safetensors", tensors)
        packed = _cli("pack", str(d), f"oci:{tmp_path / 'l'}:{name}")
        assert packed.returncode == 0, packed.stderr
    proc = _cli("diff", f"oci:{tmp_path / 'l'}:a", f"oci:{tmp_path / 'l'}:b")
    assert proc.returncode == 0, proc.stderr
    _assert_inert(proc)
    assert "x\\nsignature:" in proc.stdout, proc.stdout


def test_pull_reports_planted_file_names_escaped(
    registry: RegistryServer, checkpoint: Path, tmp_path: Path
) -> None:
    """Names of files already in a pull's destination were chosen by whoever could write there."""
    ref = registry.ref("term/planted", "v1")
    pushed = _cli("push", str(checkpoint), ref)
    assert pushed.returncode == 0, pushed.stderr
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / f"x{FAKE_LINE}{CLEAR}").write_text("planted")
    proc = _cli("pull", ref, str(dest))
    assert proc.returncode == 0, proc.stderr
    _assert_inert(proc)
    assert "x\\nsignature:" in proc.stderr, proc.stderr
