"""Runtime assets are code: each test is an attack from the second hostile review.

A model and its ``inductor`` assets live in the session's distribution registry; the caches are
small generated directories (the compile itself is tests/assets/test_assets.py's business). Every pull
runs through the library or a real ``modelpack`` subprocess; the other user is ``nobody`` by
``setpriv``.

1. an asset nobody signed (pushed by anyone with push access) is never used without a policy —
   ``assets pull`` refuses up front, the library and the engine hook return ``refused`` — and
   under a policy it needs a trusted signature even where the rule lets the weights go unsigned;
2. a destination another uid prepared (its ``sub/k.py`` beside a marker naming the real, signed
   asset) is neither reported present nor replaced; the caller's own files are hashed, not
   taken from the marker;
3. a layer that expands past its record (bytes or files) or past ``--max-bytes`` is refused
   before those bytes are written;
4. a writable view of a node-cache asset is a copy: editing it leaves the shared snapshot, and
   the next replica's view, as signed.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from modelpack import api
from modelpack.assets import pull_asset, push_asset, running_fingerprint
from modelpack.assets.archive import PackedCache
from modelpack.assets.kinds import MARKER_FILE
from modelpack.errors import AssetError
from modelpack.events import EventLog, read_events
from modelpack.files import TEMP_PREFIX
from modelpack.oci.digest import Digest
from modelpack.oci.reference import parse_reference
from modelpack.targets.opener import open_readable
from modelpack.testdata.synthetic import SyntheticSpec, write_checkpoint
from tests.fixtures.registry import RegistryServer

pytestmark = pytest.mark.timeout(300)

NOBODY = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
PY = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable  # stdlib only
needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root and setpriv (another uid)"
)


@dataclass
class Model:
    ref: str  # pinned
    private_key: str
    public_key: str
    signed_asset: str  # signed by private_key, fingerprint of this machine
    tmp: Path


def _cache_dir(path: Path, payload: bytes) -> Path:
    (path / "fxgraph" / "ab").mkdir(parents=True)
    (path / "fxgraph" / "ab" / "entry").write_bytes(payload)
    (path / "sub").mkdir()
    (path / "sub" / "k.py").write_text("KERNEL = 'built by CI'\n")
    return path


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory, registry: RegistryServer) -> Model:
    from modelpack.signing.keys import generate_key, write_keypair

    tmp = tmp_path_factory.mktemp("assets-trust")
    write_checkpoint(str(tmp / "ckpt"), SyntheticSpec(shards=1, seed=11))
    digest = str(api.push(str(tmp / "ckpt"), registry.ref("assets-trust/m", "v1")).digest)
    ref = f"{registry.host}/assets-trust/m@{digest}"
    priv, pub = write_keypair(str(tmp / "ci"), generate_key())
    signed = push_asset(ref, _cache_dir(tmp / "ci-cache", b"graph from CI"), "inductor", sign_key=priv)
    return Model(ref, priv, pub, str(signed.asset.digest), tmp)


def _cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "modelpack.cli", "assets", *argv], capture_output=True, text=True, timeout=300
    )


def _pub(model: Model) -> Any:
    from modelpack.signing.keys import load_public_key

    return [load_public_key(model.public_key)]


def _unsigned_model(registry: RegistryServer, tmp: Path, name: str) -> tuple[str, str]:
    """A model whose only asset is one anybody with push access attached: (model ref, asset)."""
    write_checkpoint(str(tmp / f"ckpt-{name}"), SyntheticSpec(shards=1, seed=len(name)))
    digest = str(api.push(str(tmp / f"ckpt-{name}"), registry.ref(f"assets-trust/{name}", "v1")).digest)
    ref = f"{registry.host}/assets-trust/{name}@{digest}"
    pushed = push_asset(ref, _cache_dir(tmp / f"attacker-{name}", b"attacker's graph"), "inductor")
    assert pushed.signature is None
    return ref, str(pushed.asset.digest)


# --------------------------------------------------------------------------- 1. signatures


def test_an_unsigned_asset_is_never_used_without_a_policy(
    model: Model, registry: RegistryServer, tmp_path: Path
) -> None:
    from modelpack.assets import fetch_before_compile

    ref, attacker = _unsigned_model(registry, tmp_path, "nokey")
    log = tmp_path / "events.jsonl"
    dest = tmp_path / "lib"
    res = pull_asset(ref, dest, "inductor", events=EventLog(str(log)))
    assert (res.state, res.signature) == ("refused", "no policy"), res.to_json()
    assert "no trust policy" in res.reason and not dest.exists()
    (refused,) = [e for e in read_events(str(log)) if e["event"] == "assets.refused"]
    assert refused["signature"] == "no policy"
    # the engine hook: the same refusal, the start compiles cold
    hook = fetch_before_compile(ref, tmp_path / "hook", "inductor", apply_environment=False)
    assert hook.state == "refused" and not (tmp_path / "hook").exists()

    # the CLI refuses before any network, naming the way out
    proc = _cli("pull", ref, str(tmp_path / "cli"), "--kind", "inductor", "--json")
    assert proc.returncode == 2 and "--allow-unsigned" in proc.stderr, proc.stderr
    assert not (tmp_path / "cli").exists()
    # ... which is explicit, and says so
    proc = _cli("pull", ref, str(tmp_path / "cli"), "--kind", "inductor", "--allow-unsigned", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert (doc["state"], doc["asset"], doc["signature"]) == ("hit", attacker, "unsigned allowed")


def test_an_asset_needs_a_trusted_signature_even_where_the_weights_may_be_unsigned(
    model: Model, registry: RegistryServer, tmp_path: Path
) -> None:
    ref, _ = _unsigned_model(registry, tmp_path, "lax")
    lax = tmp_path / "policy.yaml"
    lax.write_text(
        "version: 1\nrules:\n"
        f"  - match: ['{registry.host}/assets-trust/*']\n"
        f"    keys: [{{path: {model.public_key}}}]\n"
        "    require_signature: false\n"  # the weights may be unsigned here; code may not
    )
    proc = _cli("pull", ref, str(tmp_path / "d"), "--kind", "inductor", "--policy", str(lax), "--json")
    doc = json.loads(proc.stdout)
    assert (doc["state"], doc["signature"]) == ("refused", "refused"), doc
    assert "unsigned" in doc["reason"] and not (tmp_path / "d").exists()
    # the signed one under the same lax rule: verified
    proc = _cli("pull", model.ref, str(tmp_path / "ok"), "--kind", "inductor", "--policy", str(lax), "--json")
    doc = json.loads(proc.stdout)
    assert (doc["state"], doc["signature"], doc["asset"]) == ("hit", "verified", model.signed_asset)


# --------------------------------------------------------------------------- 2. the destination


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A sticky, world-writable directory (like /tmp) that user nobody can reach."""
    d = Path(tempfile.mkdtemp(prefix="modelpack-assets-", dir="/tmp"))
    d.chmod(0o1777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _forge(dest: Path, asset: str, listed: list[tuple[str, bytes]], marker_format: str) -> str:
    """nobody's script: the destination with its own files and a marker naming the real asset
    (the format the review forged, or today's, listing the planted files' real digests)."""
    import hashlib

    files = [[rel, len(data), "sha256:" + hashlib.sha256(data).hexdigest()] for rel, data in listed]
    marker: dict[str, Any] = {"asset": asset, "files": len(files), "bytes": sum(len(d) for _, d in listed)}
    if marker_format == "listing":
        marker.update(version=2, model="", kind="inductor", fingerprintDigest="", files=files)
    lines = [f"import os; d = {str(dest)!r}; os.makedirs(d, 0o755)"]
    for rel, data in listed:
        lines.append(f"os.makedirs(os.path.dirname(os.path.join(d, {rel!r})), exist_ok=True)")
        lines.append(f"open(os.path.join(d, {rel!r}), 'wb').write({data!r})")
    lines.append(f"open(os.path.join(d, {MARKER_FILE!r}), 'w').write({json.dumps(marker)!r})")
    return "\n".join(lines)


@needs_root
@pytest.mark.parametrize("marker_format", ["counts", "listing"])
def test_a_destination_another_user_prepared_is_never_used_or_replaced(
    model: Model, shared_dir: Path, marker_format: str
) -> None:
    dest = shared_dir / "inductor"
    planted = [("sub/k.py", b"import os; os.system('id > /tmp/owned')\n"), ("fxgraph/ab/entry", b"x")]
    r = subprocess.run(
        [*NOBODY, PY, "-c", _forge(dest, model.signed_asset, planted, marker_format)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    proc = _cli("pull", model.ref, str(dest), "--kind", "inductor", "--key", model.public_key, "--json")
    assert proc.returncode != 0 and "hit" not in proc.stdout, (proc.stdout, proc.stderr)
    assert "belongs to uid 65534" in proc.stderr and "neither used nor replaced" in proc.stderr, proc.stderr
    assert (dest / "sub" / "k.py").read_bytes() == planted[0][1]  # not ours to delete
    assert not [p for p in shared_dir.iterdir() if p.name.startswith(TEMP_PREFIX)]


@needs_root
def test_a_destination_below_another_users_directory_is_refused(model: Model, shared_dir: Path) -> None:
    """nobody owns a directory above DEST: it could rename DEST away after the check and put its
    own in place, so nothing is materialised there."""
    theirs = shared_dir / "nobodys"
    r = subprocess.run([*NOBODY, "mkdir", "-m", "0755", str(theirs)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    with pytest.raises(AssetError, match="belongs to uid 65534"):
        pull_asset(model.ref, theirs / "sub" / "dest", "inductor", policy=_pub(model))
    assert not (theirs / "sub").exists()


@needs_root
def test_a_foreign_file_inside_the_callers_destination_refuses_it(model: Model, shared_dir: Path) -> None:
    dest = shared_dir / "mine"
    assert pull_asset(model.ref, dest, "inductor", policy=_pub(model)).state == "hit"
    # another uid's file inside (planted through a directory left writable, then closed again)
    (dest / "sub").chmod(0o777)
    r = subprocess.run(
        [*NOBODY, "sh", "-c", f"printf evil > '{dest}/sub/extra.py'"], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    (dest / "sub").chmod(0o755)
    with pytest.raises(AssetError, match="belongs to uid 65534"):
        pull_asset(model.ref, dest, "inductor", policy=_pub(model))


def test_the_callers_own_destination_is_compared_by_content_not_by_its_marker(
    model: Model, tmp_path: Path
) -> None:
    dest = tmp_path / "inductor"
    first = pull_asset(model.ref, dest, "inductor", policy=_pub(model))
    assert first.state == "hit" and not first.present
    again = pull_asset(model.ref, dest, "inductor", policy=_pub(model))
    assert again.state == "hit" and again.present and again.signature == "verified"
    # a listed file changed (same size): not present any more — materialised again from the asset
    k = dest / "sub" / "k.py"
    k.chmod(0o644)
    k.write_text("KERNEL = 'built by me'\n")  # same size: only the digest can tell
    res = pull_asset(model.ref, dest, "inductor", policy=_pub(model))
    assert res.state == "hit" and not res.present
    assert k.read_text() == "KERNEL = 'built by CI'\n"
    # a file the runtime added since is the caller's: the asset still counts as present
    (dest / "fxgraph" / "new-entry").write_bytes(b"compiled here")
    assert pull_asset(model.ref, dest, "inductor", policy=_pub(model)).present
    # group-writable: anyone in the group could have planted code; refused, not used
    (dest / "fxgraph" / "new-entry").chmod(0o664)
    with pytest.raises(AssetError, match="writable by group or others"):
        pull_asset(model.ref, dest, "inductor", policy=_pub(model))


# --------------------------------------------------------------------------- 3. extraction caps


def _tar_gz(members: list[tuple[str, int]]) -> bytes:
    raw = io.BytesIO()
    with gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as gz, tarfile.open(fileobj=gz, mode="w|") as tar:
        for name, size in members:
            info = tarfile.TarInfo(name)
            info.size = size
            tar.addfile(info, io.BytesIO(b"\0" * size))
    return raw.getvalue()


def _push_lying_asset(
    model: Model, tmp: Path, layer: bytes, files: int, size: int, monkeypatch: pytest.MonkeyPatch
) -> str:
    """An asset whose record (signed, by a careless or compromised CI key) understates its layer."""
    import modelpack.assets.push as push_module

    path = tmp / f"lying-{files}-{size}.tar.gz"
    path.write_bytes(layer)

    def lying_pack(directory: str, kind: Any, *, work_dir: str | None = None) -> PackedCache:
        copy = Path(tempfile.mkstemp(dir=tmp)[1])
        copy.write_bytes(layer)
        return PackedCache(str(copy), Digest.from_bytes(layer), len(layer), files, size)

    monkeypatch.setattr(push_module, "pack_cache", lying_pack)
    target = open_readable(parse_reference(model.ref))
    fp = running_fingerprint(target, target.resolve(model.ref.split("@")[1]))
    # each lying asset gets its own model version, so it is the only exact match
    fp = fp.replace(torch_version=f"{fp.torch_version}+lie{files}x{size}")
    fp.write(tmp / f"fp-{files}-{size}.json")
    pushed = push_asset(model.ref, tmp, "inductor", fingerprint=fp, sign_key=model.private_key)
    return str(tmp / f"fp-{files}-{size}.json") + "|" + str(pushed.asset.digest)


def test_a_layer_that_expands_past_its_record_is_refused_before_it_is_written(
    model: Model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bomb = _tar_gz([("big", 64 * 1024 * 1024)])  # 64 MiB of zeros in ~64 KiB of gzip
    assert len(bomb) < 512 * 1024
    fp_file, _ = _push_lying_asset(model, tmp_path, bomb, 1, 10, monkeypatch).split("|")
    monkeypatch.undo()
    dest = tmp_path / "dest"
    res = pull_asset(model.ref, dest, "inductor", fingerprint=fp_file, policy=_pub(model))
    assert res.state == "refused" and res.signature == "verified", res.reason
    # charged at the member's declared size, before it was opened: nothing was written
    assert "declares 67108864 bytes but only 10 bytes are left" in res.reason, res.reason
    assert not dest.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(TEMP_PREFIX)]


def test_more_files_than_the_record_says_are_refused_at_the_first_extra_one(
    model: Model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    many = _tar_gz([(f"f/{i:05d}", 0) for i in range(2000)])
    fp_file, _ = _push_lying_asset(model, tmp_path, many, 1, 0, monkeypatch).split("|")
    monkeypatch.undo()
    res = pull_asset(model.ref, tmp_path / "dest", "inductor", fingerprint=fp_file, policy=_pub(model))
    assert res.state == "refused" and "more than the 1 files its record declares" in res.reason, res.reason
    assert not (tmp_path / "dest").exists()


def test_max_bytes_refuses_an_asset_larger_than_it_before_the_download(model: Model, tmp_path: Path) -> None:
    proc = _cli(
        "pull", model.ref, str(tmp_path / "d"), "--kind", "inductor", "--key", model.public_key,
        "--max-bytes", "8", "--json",
    )  # fmt: skip
    doc = json.loads(proc.stdout)
    assert doc["state"] == "refused" and "more than --max-bytes 8" in doc["reason"], doc
    assert not (tmp_path / "d").exists()
    # through the node cache too, and before the cache downloads anything
    proc = _cli(
        "pull", model.ref, str(tmp_path / "d"), "--kind", "inductor", "--key", model.public_key,
        "--max-bytes", "8", "--cache", str(tmp_path / "cache"), "--json",
    )  # fmt: skip
    doc = json.loads(proc.stdout)
    assert doc["state"] == "refused" and "more than --max-bytes 8" in doc["reason"], doc
    assert not (tmp_path / "d").exists() and not list((tmp_path / "cache" / "snapshots").glob("*"))


# --------------------------------------------------------------------------- 4. node-cache views


def test_a_writable_view_is_a_copy_and_edits_never_reach_the_shared_snapshot(
    model: Model, tmp_path: Path
) -> None:
    from modelpack.mount import NodeCache

    cache = NodeCache(str(tmp_path / "cache"))
    view = tmp_path / "view-1"
    first = pull_asset(model.ref, view, "inductor", cache=cache, policy=_pub(model))
    assert first.state == "hit" and first.signature == "verified"
    snapshot = Path(cache.snapshot_path(model.signed_asset))
    shared, mine = snapshot / "sub" / "k.py", view / "sub" / "k.py"
    assert not os.path.samefile(shared, mine) and os.stat(mine).st_nlink == 1
    assert oct(os.stat(mine).st_mode & 0o777) == oct(0o644)
    # root edits the view (the mode would not stop root): the shared copy stays as signed
    mine.write_text("KERNEL = 'edited in a replica'\n")
    assert shared.read_text() == "KERNEL = 'built by CI'\n"
    second = pull_asset(model.ref, tmp_path / "view-2", "inductor", cache=cache, policy=_pub(model))
    assert second.state == "hit"
    assert (tmp_path / "view-2" / "sub" / "k.py").read_text() == "KERNEL = 'built by CI'\n"
