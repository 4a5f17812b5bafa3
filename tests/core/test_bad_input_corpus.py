"""A corpus of bad inputs through the real CLI.

Each case is something a new user types by mistake or an attacker crafts: a malformed reference,
a missing directory, a file that is not a key, a hand-made layout whose manifest, config or
safetensors header is hostile, a registry hop that cuts every blob, a disk that fills up. Every
one must end the same way: a non-zero exit, no "Traceback" on stderr, and the culprit (the
reference, path, flag, tensor or digest to look at) named in the message.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from modelpack.testdata.synthetic import SyntheticSpec, write_checkpoint
from tests.fixtures.faultproxy import Fault, FaultProxy, blob_get

pytestmark = pytest.mark.timeout(300)

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MODEL_CONFIG = "application/vnd.cncf.model.config.v1+json"
WEIGHT_RAW = "application/vnd.cncf.model.weight.v1.raw"
DEEP = 100_000


def run_cli(
    *argv: str, cwd: Path | None = None, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, MODELPACK_RETRY_FOR="1s")
    return subprocess.run(
        [sys.executable, "-m", "modelpack.cli", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        input=stdin,
        env=env,
    )


def assert_refused(proc: subprocess.CompletedProcess[str], *culprits: str) -> None:
    where = f"modelpack {' '.join(proc.args[3:])}\n--- stderr:\n{proc.stderr}"
    assert proc.returncode != 0, where
    assert "Traceback" not in proc.stderr, where
    assert "Exception ignored" not in proc.stderr, where
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    if proc.returncode == 2 and lines and lines[0].startswith("Usage:"):  # click's usage error
        lines = [line for line in lines if line.startswith("Error:")]
    assert len(lines) == 1, f"not one line\n{where}"
    assert len(lines[0]) <= 1100, f"a line of {len(lines[0])} characters\n{where}"
    for culprit in culprits:
        assert culprit in proc.stderr, f"culprit {culprit!r} not named\n{where}"


# --- hand-made layouts ---------------------------------------------------------------------------


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def craft_layout(
    root: Path, manifest: bytes | dict[str, object], blobs: list[bytes] = (), tag: str = "v1"
) -> str:
    """An OCI layout written by hand (no modelpack code), tagged ``tag``; returns the manifest digest."""
    raw = manifest if isinstance(manifest, bytes) else json.dumps(manifest).encode()
    (root / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
    (root / "oci-layout").write_text('{"imageLayoutVersion":"1.0.0"}')
    for blob in [*blobs, raw]:
        (root / "blobs" / "sha256" / _digest(blob)[7:]).write_bytes(blob)
    index = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [
            {
                "mediaType": OCI_MANIFEST,
                "digest": _digest(raw),
                "size": len(raw),
                "annotations": {"org.opencontainers.image.ref.name": tag},
            }
        ],
    }
    (root / "index.json").write_text(json.dumps(index))
    return _digest(raw)


def model_config(diff_ids: list[str]) -> bytes:
    return json.dumps(
        {"descriptor": {"name": "x"}, "config": {}, "modelfs": {"type": "layers", "diffIds": diff_ids}}
    ).encode()


def model_manifest(config: bytes, layers: list[tuple[bytes, str]]) -> dict[str, object]:
    return {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "artifactType": "application/vnd.cncf.model.manifest.v1+json",
        "config": {"mediaType": MODEL_CONFIG, "digest": _digest(config), "size": len(config)},
        "layers": [
            {
                "mediaType": WEIGHT_RAW,
                "digest": _digest(blob),
                "size": len(blob),
                "annotations": {"org.cncf.model.filepath": path},
            }
            for blob, path in layers
        ],
    }


def weight_layout(root: Path, weight: bytes, path: str = "model.safetensors") -> str:
    config = model_config([_digest(weight)])
    return craft_layout(root, model_manifest(config, [(weight, path)]), [config, weight])


def safetensors_bytes(header: dict[str, object] | bytes, data: bytes = b"") -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


# --- the corpus ----------------------------------------------------------------------------------


@dataclass
class Case:
    argv: list[str]
    culprits: list[str]
    cwd: Path | None = None
    stdin: str | None = None


Builder = Callable[[Path], Case]
CORPUS: dict[str, Builder] = {}


def case(name: str) -> Callable[[Builder], Builder]:
    def register(fn: Builder) -> Builder:
        CORPUS[name] = fn
        return fn

    return register


def _ckpt(tmp: Path, name: str = "ckpt") -> Path:
    d = tmp / name
    if not d.exists():
        write_checkpoint(str(d), SyntheticSpec(shards=1))
    return d


# bad references
for _name, _ref, _culprit in [
    ("uppercase repository", "localhost:5000/UPPER/model:v1", "UPPER"),
    ("empty layout path", "oci:", "oci:"),
    ("bad digest", "localhost:5000/m@sha256:xyz", "sha256:xyz"),
    ("unknown scheme", "ftp://host/model:v1", "ftp://host/model:v1"),
    ("bad tag", "localhost:5000/m:bad!tag", "bad!tag"),
    ("bad bucket", "s3://Bad_Bucket/x:v1", "Bad_Bucket"),
    ("huge reference", "localhost:5000/" + "a" * 5000 + ":v1", "invalid reference"),
    ("huge tag", "localhost:5000/m:" + "t" * 50_000, "invalid reference"),
]:

    def _build(tmp: Path, ref: str = _ref, culprit: str = _culprit) -> Case:
        return Case(["inspect", ref], [culprit])

    case(f"reference: {_name}")(_build)


@case("reference: a path where a layout reference belongs")
def _(tmp: Path) -> Case:
    return Case(["pack", str(_ckpt(tmp)), "./layout"], ["oci:./layout"], cwd=tmp)


@case("missing checkpoint directory")
def _(tmp: Path) -> Case:
    return Case(["pack", str(tmp / "nope"), f"oci:{tmp / 'l'}:v1"], [str(tmp / "nope")])


@case("missing layout")
def _(tmp: Path) -> Case:
    return Case(["inspect", f"oci:{tmp / 'nope'}:v1"], [str(tmp / "nope")])


@case("missing tag in a layout")
def _(tmp: Path) -> Case:
    weight_layout(
        tmp / "l", safetensors_bytes({"w": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}, b"x")
    )
    return Case(["pull", f"oci:{tmp / 'l'}:v9", str(tmp / "out")], ["v9"])


@case("key: a file that is not a key")
def _(tmp: Path) -> Case:
    weight_layout(
        tmp / "l", safetensors_bytes({"w": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}, b"x")
    )
    (tmp / "garbage.pem").write_text(
        "-----BEGIN PUBLIC KEY-----\nnot base64 at all\n-----END PUBLIC KEY-----\n"
    )
    return Case(["verify", f"oci:{tmp / 'l'}:v1", "--key", str(tmp / "garbage.pem")], ["garbage.pem"])


@case("key: a missing key file")
def _(tmp: Path) -> Case:
    weight_layout(
        tmp / "l", safetensors_bytes({"w": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}, b"x")
    )
    return Case(["verify", f"oci:{tmp / 'l'}:v1", "--key", str(tmp / "none.pub")], ["none.pub"])


@case("key: a public key where the signing key belongs")
def _(tmp: Path) -> Case:
    weight_layout(
        tmp / "l", safetensors_bytes({"w": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}, b"x")
    )
    keys = tmp / "keys"
    subprocess.run(
        [sys.executable, "-m", "modelpack.cli", "keygen", "--out", str(keys / "k")],
        check=True,
        capture_output=True,
    )
    pub = next(p for p in keys.iterdir() if p.suffix == ".pub")
    return Case(["sign", f"oci:{tmp / 'l'}:v1", "--key", str(pub)], [pub.name])


@case("policy: not YAML")
def _(tmp: Path) -> Case:
    weight_layout(
        tmp / "l", safetensors_bytes({"w": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}, b"x")
    )
    (tmp / "policy.yaml").write_text("rules: [unclosed\n  - {")
    return Case(
        ["pull", f"oci:{tmp / 'l'}:v1", str(tmp / "out"), "--policy", str(tmp / "policy.yaml")],
        ["policy.yaml"],
    )


@case("manifest: 100k levels deep")
def _(tmp: Path) -> Case:
    raw = b'{"schemaVersion":2,"annotations":' + b"[" * DEEP + b"]" * DEEP + b"}"
    digest = craft_layout(tmp / "l", raw)
    return Case(["inspect", f"oci:{tmp / 'l'}:v1"], [digest])


@case("manifest: annotations that are a list")
def _(tmp: Path) -> Case:
    config = model_config(["sha256:" + "0" * 64])
    m = model_manifest(config, [])
    m["annotations"] = ["a", "b"]
    craft_layout(tmp / "l", m, [config])
    return Case(["inspect", f"oci:{tmp / 'l'}:v1"], ["annotations"])


@case("manifest: a file path that leaves the directory")
def _(tmp: Path) -> Case:
    blob = b"escape"
    config = model_config([_digest(blob)])
    craft_layout(tmp / "l", model_manifest(config, [(blob, "../../evil.txt")]), [config, blob])
    return Case(["pull", f"oci:{tmp / 'l'}:v1", str(tmp / "out")], ["../../evil.txt"])


@case("manifest: a layer blob that is missing")
def _(tmp: Path) -> Case:
    blob = b"never stored"
    config = model_config([_digest(blob)])
    craft_layout(tmp / "l", model_manifest(config, [(blob, "a.txt")]), [config])
    return Case(["pull", f"oci:{tmp / 'l'}:v1", str(tmp / "out")], [_digest(blob)[:19]])


@case("manifest: a layer whose bytes do not match its digest")
def _(tmp: Path) -> Case:
    blob = b"the real bytes"
    config = model_config([_digest(blob)])
    craft_layout(tmp / "l", model_manifest(config, [(blob, "a.txt")]), [config, blob])
    (tmp / "l" / "blobs" / "sha256" / _digest(blob)[7:]).write_bytes(b"forged bytes!!")
    return Case(["pull", f"oci:{tmp / 'l'}:v1", str(tmp / "out")], [_digest(blob)[:19]])


@case("config: 100k levels deep")
def _(tmp: Path) -> Case:
    config = b'{"descriptor":' + b"[" * DEEP + b"]" * DEEP + b"}"
    craft_layout(tmp / "l", model_manifest(config, []), [config])
    return Case(["inspect", f"oci:{tmp / 'l'}:v1"], ["config"])


@case("header: a dimension of 2^63 beside a zero")
def _(tmp: Path) -> Case:
    weight = safetensors_bytes({"w": {"dtype": "F32", "shape": [0, 2**63], "data_offsets": [0, 0]}})
    digest = weight_layout(tmp / "l", weight)
    return Case(["load", f"oci:{tmp / 'l'}@{digest}", "--progress", "off"], ["model.safetensors", "'w'"])


@case("header: dimensions whose product overflows")
def _(tmp: Path) -> Case:
    ckpt = tmp / "ckpt"
    ckpt.mkdir()
    header = {"w": {"dtype": "F32", "shape": [0, 2**40, 2**40], "data_offsets": [0, 0]}}
    (ckpt / "model.safetensors").write_bytes(safetensors_bytes(header))
    return Case(["pack", str(ckpt), f"oci:{tmp / 'l'}:v1"], ["model.safetensors", "'w'"])


@case("header: __metadata__ 100k levels deep")
def _(tmp: Path) -> Case:
    ckpt = tmp / "ckpt"
    ckpt.mkdir()
    (ckpt / "model.safetensors").write_bytes(
        safetensors_bytes(b'{"__metadata__":' + b"[" * DEEP + b"]" * DEEP + b"}")
    )
    return Case(["pack", str(ckpt), f"oci:{tmp / 'l'}:v1"], ["model.safetensors", "nested"])


@case("header: a text file named .safetensors")
def _(tmp: Path) -> Case:
    ckpt = tmp / "ckpt"
    ckpt.mkdir()
    (ckpt / "model.safetensors").write_text("version https://git-lfs.github.com/spec/v1\noid sha256:abc\n")
    return Case(["pack", str(ckpt), f"oci:{tmp / 'l'}:v1"], ["model.safetensors", "not a safetensors file"])


@case("header: a text file named .safetensors, at load")
def _(tmp: Path) -> Case:
    digest = weight_layout(tmp / "l", b"version https://git-lfs.github.com/spec/v1\n")
    return Case(
        ["load", f"oci:{tmp / 'l'}@{digest}", "--progress", "off"],
        ["model.safetensors", "not a safetensors file"],
    )


@case("flag: --created without a time")
def _(tmp: Path) -> Case:
    return Case(["pack", str(_ckpt(tmp)), f"oci:{tmp / 'l'}:v1", "--created", "2025-01-02"], ["--created"])


@case("flag: --max-file-size that is not a size")
def _(tmp: Path) -> Case:
    return Case(["pack", str(_ckpt(tmp)), f"oci:{tmp / 'l'}:v1", "--max-file-size", "lots"], ["lots"])


@case("audit: a --since-digests file 100k levels deep")
def _(tmp: Path) -> Case:
    weight_layout(
        tmp / "l", safetensors_bytes({"w": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}, b"x")
    )
    (tmp / "since.json").write_bytes(b"[" * DEEP + b"]" * DEEP)
    return Case(["audit", f"oci:{tmp / 'l'}", "--since-digests", str(tmp / "since.json")], ["since.json"])


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_bad_input(name: str, tmp_path: Path) -> None:
    c = CORPUS[name](tmp_path)
    assert_refused(run_cli(*c.argv, cwd=c.cwd, stdin=c.stdin), *c.culprits)


# --- a hostile network hop and a full disk -------------------------------------------------------


@pytest.fixture(scope="module")
def pushed(registry, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, int]]:  # type: ignore[no-untyped-def]
    """A 2-shard model in the session registry: (repository reference, largest layer digest, size)."""
    from modelpack.api import transfer
    from modelpack.oci.reference import parse_reference
    from modelpack.targets.fetch import fetch_manifest
    from modelpack.targets.opener import open_readable

    ckpt = tmp_path_factory.mktemp("corpus") / "ckpt"
    write_checkpoint(str(ckpt), SyntheticSpec(shards=2))
    ref = registry.ref("corpus/model", "v1")
    transfer.push(str(ckpt), ref)
    parsed = parse_reference(ref)
    manifest, _ = fetch_manifest(open_readable(parsed), parsed.identifier)
    total = sum(layer.size for layer in manifest.layers)
    yield ref, str(max(manifest.layers, key=lambda d: d.size).digest), total


def test_a_connection_cut_mid_blob_every_time(registry, pushed, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    ref, digest, _ = pushed
    proxy = FaultProxy(registry.host)
    try:
        proxy.add(Fault(match=blob_get(digest), cut_after=1000, times=None))
        proc = run_cli(
            "pull", ref.replace(registry.host, proxy.host), str(tmp_path / "out"), "--retry-for", "1s"
        )
    finally:
        proxy.close()
    assert_refused(proc, proxy.host)
    assert digest[:19] in proc.stderr, proc.stderr


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB filesystem: a full disk without filling the machine's."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip() or proc.returncode}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _big_checkpoint(tmp: Path) -> Path:
    ckpt = tmp / "big"
    ckpt.mkdir()
    n = 3 * 1024 * 1024 // 2  # two tensors, so --max-file-size can split them
    header = {
        "a": {"dtype": "U8", "shape": [n], "data_offsets": [0, n]},
        "b": {"dtype": "U8", "shape": [n], "data_offsets": [n, 2 * n]},
    }
    (ckpt / "model.safetensors").write_bytes(safetensors_bytes(header, os.urandom(2 * n)))
    return ckpt


@pytest.mark.parametrize(
    "extra",
    [[], ["--max-file-size", "2MiB"], ["--format", "image"]],
    ids=["blobs", "re-sharded files", "image tar layers"],
)
def test_full_disk_while_packing_into_a_layout(small_tmpfs: Path, tmp_path: Path, extra: list[str]) -> None:
    """Blobs, re-sharded files and tar layers are all written beside the layout (same filesystem)."""
    proc = run_cli("pack", str(_big_checkpoint(tmp_path)), f"oci:{small_tmpfs / 'layout'}:v1", *extra)
    assert_refused(proc, str(small_tmpfs), "No space left on device")
    assert not [p for p in (small_tmpfs / "layout").rglob("*") if p.is_file() and p.name.startswith(".")]


def test_full_disk_while_pulling_into_a_directory(registry, small_tmpfs: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from modelpack.api import transfer

    ref = registry.ref("corpus/big", "v1")
    transfer.push(str(_big_checkpoint(tmp_path)), ref)
    proc = run_cli("pull", ref, str(small_tmpfs / "model"))
    # refused before the first byte (free space checked up front) or at ENOSPC: either way the
    # destination is named and the way out is said
    assert_refused(proc, str(small_tmpfs), "free space")
