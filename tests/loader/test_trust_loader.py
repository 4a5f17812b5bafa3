"""The loader serves only bytes it verified, whatever the source claims.

Each test starts from the attack: a registry hop that forges the safetensors header on the first
ranged reads and serves honest bytes afterwards; a signed model whose chunk table was withheld;
a directory that looks like a node-cache snapshot (fake, copied, edited in place, re-marked).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from modelpack.loader import LoaderOptions, LoadStats, iter_tensors, load_state_dict
from modelpack.signing.chunks import compute_chunk_table, push_chunk_table
from modelpack.signing.keys import generate_key

from modelpack import api
from modelpack.errors import (
    DigestMismatchError,
    HeaderMismatchError,
    LoaderError,
    StoreError,
    UnsignedSourceError,
    UnverifiedSourceError,
)
from modelpack.events import EventLog
from modelpack.packing.safetensors_format import read_header
from modelpack.targets.opener import open_readable
from modelpack.testdata.synthetic import SyntheticSpec, write_checkpoint
from tests.fixtures.faultproxy import Fault, FaultProxy, blob_get
from tests.loader_helpers import reference_tensors

CHUNK = 64 * 1024
# the system interpreter: the test venv's may sit under a directory `nobody` cannot enter
PYTHON = shutil.which("python3", path="/usr/bin:/bin") or "python3"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("trust-ckpt")
    write_checkpoint(str(d), SyntheticSpec(shards=2, seed=111))
    return d


@pytest.fixture(scope="module")
def ref(ckpt: Path) -> dict[str, torch.Tensor]:
    return reference_tensors(ckpt)


def _push(registry: Any, ckpt: Path, repo: str) -> tuple[str, str]:
    res = api.pack(str(ckpt), registry.ref(repo, "v1"))
    return f"{registry.host}/{repo}", str(res.artifact.digest)


def _events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# --------------------------------------------------------------------------- 11.1 header forgery
def _same_shape_pair(ckpt: Path) -> tuple[str, str, str]:
    """(file name, tensor a, tensor b): two tensors of one shard with the same shape and dtype."""
    for f in sorted(ckpt.glob("*.safetensors")):
        hdr = read_header(str(f))
        seen: dict[tuple[Any, ...], str] = {}
        for t in hdr.tensors:
            key = (t.dtype, tuple(t.shape))
            if key in seen and len(t.shape) == 2:
                return f.name, seen[key], t.name
            seen.setdefault(key, t.name)
    raise AssertionError("no same-shape pair")


def _swap_offsets(header_json: bytes, a: str, b: str) -> bytes:
    """The header with ``a`` and ``b``'s data_offsets exchanged: same length, still valid."""
    pattern = r'"{}":\{{[^}}]*?"data_offsets":(\[[0-9]+,[0-9]+\])'
    ma = re.search(pattern.format(re.escape(a)).encode(), header_json)
    mb = re.search(pattern.format(re.escape(b)).encode(), header_json)
    assert ma and mb
    spans = sorted([(ma.span(1), mb.group(1)), (mb.span(1), ma.group(1))])
    out = bytearray(header_json)
    for (s, e), repl in reversed(spans):
        out[s:e] = repl
    assert len(out) == len(header_json) and bytes(out) != header_json
    return bytes(out)


def test_forged_header_on_the_first_ranged_reads_fails_the_whole_layer_load(
    registry: Any, ckpt: Path, ref: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    fname, a, b = _same_shape_pair(ckpt)
    repo, digest = _push(registry, ckpt, "trust/forged-header")
    manifest, _ = api.fetch_manifest(open_readable(f"{repo}@{digest}"), digest)
    layer = next(x for x in manifest.layers if (x.annotations or {}).get("org.cncf.model.filepath") == fname)
    n = read_header(str(ckpt / fname)).data_start - 8
    forged_ranges: list[str] = []

    def forge(body: bytes, rng: str | None) -> bytes:
        # only the header read (exactly the JSON after the 8-byte prefix) is forged: every later
        # read — the whole-layer pass that is hashed — gets the honest bytes
        if rng == f"bytes=8-{8 + n - 1}":
            forged_ranges.append(rng)
            return _swap_offsets(body, a, b)
        return body

    proxy = FaultProxy(registry.host)
    try:
        proxy.add(Fault(match=blob_get(str(layer.digest)), rewrite=forge, times=None))
        source = f"{proxy.host}/{repo.split('/', 1)[1]}@{digest}"
        log = tmp_path / "events.jsonl"
        served: list[str] = []
        with pytest.raises(HeaderMismatchError, match=re.escape(fname)) as info:
            for name, tensor in iter_tensors(source, events=str(log)):
                served.append(name)
                assert torch.equal(tensor, ref[name]), f"{name} served with another tensor's bytes"
        assert forged_ranges, "the forged header was never served"
        assert isinstance(info.value, LoaderError)
        file_tensors = {t.name for t in read_header(str(ckpt / fname)).tensors}
        assert not (set(served) & file_tensors), "a tensor placed by the forged header was handed out"
        failed = [e for e in _events(log) if e["event"] == "loader.failed"]
        assert failed and "HeaderMismatchError" in failed[0]["reason"]
        # the whole-dict API keeps nothing
        with pytest.raises(HeaderMismatchError):
            load_state_dict(source)
        # the honest path still loads, tensor for tensor
        proxy.clear()
        sd = load_state_dict(source)
        assert all(torch.equal(sd[k], ref[k]) for k in ref)
    finally:
        proxy.close()


def test_forged_header_in_a_layout_file_between_reads_is_caught_too(
    ckpt: Path, ref: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    """The same attack through a local backing: the blob holds a forged header while the headers
    are parsed, and the honest bytes by the time the layer is read and hashed (an OCI layout on a
    filesystem someone else can write)."""
    from tests.loader_helpers import pack_layout

    fname, a, b = _same_shape_pair(ckpt)
    lay = pack_layout(ckpt, tmp_path / "layout")
    _, blob = lay.weight_blob(fname.split(".")[0])
    honest = blob.read_bytes()
    n = read_header(str(blob)).data_start - 8
    forged = honest[:8] + _swap_offsets(honest[8 : 8 + n], a, b) + honest[8 + n :]
    os.chmod(blob, 0o644)

    def restore(_: Any) -> None:  # runs after the headers were parsed, before any data is read
        with open(blob, "r+b") as f:
            f.write(honest)

    for attempt in ("iter", "dict"):
        blob.write_bytes(forged)
        served: list[str] = []
        with pytest.raises(HeaderMismatchError, match=re.escape(fname)):
            if attempt == "iter":
                for name, tensor in iter_tensors(lay.ref, on_plan=restore):
                    served.append(name)
                    assert torch.equal(tensor, ref[name]), name
            else:
                load_state_dict(lay.ref, on_plan=restore)
        assert not set(served) & {t.name for t in read_header(str(blob)).tensors}
    sd = load_state_dict(lay.ref)
    assert all(torch.equal(sd[k], ref[k]) for k in ref)


# --------------------------------------------------------------------------- 11.2 silent downgrade
def test_trusted_keys_without_a_chunk_table_are_refused_not_downgraded(
    registry: Any, ckpt: Path, ref: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    repo, digest = _push(registry, ckpt, "trust/no-chunk-table")
    key = generate_key()
    log = tmp_path / "events.jsonl"
    with pytest.raises(UnsignedSourceError, match="--allow-missing-chunk-table") as info:
        load_state_dict(f"{repo}@{digest}", trusted_keys=[key.public], events=str(log))
    assert f"{repo}@{digest}" in str(info.value)
    refused = [e for e in _events(log) if e["event"] == "loader.refused"]
    assert refused and "UnsignedSourceError" in refused[0]["reason"]
    # the explicit opt-out: whole-layer digest checks, and an event that says so
    stats = LoadStats()
    sd = load_state_dict(
        f"{repo}@{digest}",
        trusted_keys=[key.public],
        options=LoaderOptions(allow_missing_chunk_table=True),
        events=str(log),
        stats=stats,
    )
    assert all(torch.equal(sd[k], ref[k]) for k in ref)
    assert set(stats.verification.values()) == {"whole"}
    downgraded = [e for e in _events(log) if e["event"] == "loader.downgraded"]
    assert downgraded and downgraded[0]["digest"] == digest and downgraded[0]["files"]


def test_a_chunk_table_that_skips_a_layer_is_refused_for_that_layer(
    registry: Any, ckpt: Path, ref: dict[str, torch.Tensor]
) -> None:
    from modelpack.targets.opener import open_target

    repo, digest = _push(registry, ckpt, "trust/partial-chunk-table")
    target = open_target(f"{repo}@{digest}", for_write=True)
    manifest, _ = api.fetch_manifest(target, digest)
    weights = [
        x
        for x in manifest.layers
        if (x.annotations or {}).get("org.cncf.model.filepath", "").endswith(".safetensors")
    ]
    assert len(weights) == 2
    key = generate_key()
    table = compute_chunk_table(target, manifest, chunk_size=CHUNK, layers=weights[:1])
    push_chunk_table(target, target.resolve(digest), table, key)
    skipped = weights[1].annotations["org.cncf.model.filepath"]
    with pytest.raises(UnsignedSourceError, match=re.escape(skipped)):
        load_state_dict(f"{repo}@{digest}", trusted_keys=[key.public])
    stats = LoadStats()
    sd = load_state_dict(
        f"{repo}@{digest}",
        trusted_keys=[key.public],
        options=LoaderOptions(allow_missing_chunk_table=True),
        stats=stats,
    )
    assert all(torch.equal(sd[k], ref[k]) for k in ref)
    assert stats.verification == {
        weights[0].annotations["org.cncf.model.filepath"]: "chunks",
        skipped: "whole",
    }


def test_load_command_refuses_the_downgrade_and_names_the_flag(
    registry: Any, ckpt: Path, tmp_path: Path
) -> None:
    from click.testing import CliRunner

    from modelpack.cli import main

    repo, digest = _push(registry, ckpt, "trust/cli-no-chunk-table")
    key = generate_key()
    pub = tmp_path / "k.pub"
    pub.write_bytes(key.public.pem)
    runner = CliRunner()
    res = runner.invoke(main, ["load", f"{repo}@{digest}", "--trusted-key", str(pub)])
    assert res.exit_code == 1, res.output
    assert "--allow-missing-chunk-table" in res.output and f"{repo}@{digest}" in res.output
    assert "allow_missing_chunk_table" not in res.output
    ok = runner.invoke(
        main,
        ["load", f"{repo}@{digest}", "--trusted-key", str(pub), "--allow-missing-chunk-table", "--json"],
    )
    assert ok.exit_code == 0, ok.output
    doc = json.loads(ok.output)
    assert set(doc["verification"].values()) == {"whole"}


# --------------------------------------------------------------------------- 11.3 a pin binds content
@pytest.fixture
def cache(ckpt: Path, tmp_path: Path) -> tuple[Any, str, str]:
    """(NodeCache, snapshot path, digest) of a real cache filled from an OCI layout."""
    from modelpack.mount.cache import NodeCache

    from tests.loader_helpers import pack_layout

    lay = pack_layout(ckpt, tmp_path / "layout")
    nc = NodeCache(str(tmp_path / "cache"))
    res = nc.pull(f"oci:{lay.path}@{lay.digest}")
    return nc, res.path, lay.digest


def _edit_tensor_bytes(path: Path) -> str:
    """Flip one byte in the middle of a tensor; returns the tensor's name."""
    hdr = read_header(str(path))
    victim = hdr.tensors[len(hdr.tensors) // 2]
    start, end = hdr.absolute(victim)
    data = bytearray(path.read_bytes())
    data[(start + end) // 2] ^= 0xFF
    mode = stat.S_IMODE(os.stat(path).st_mode)
    os.chmod(path, 0o644)
    path.write_bytes(bytes(data))
    os.chmod(path, mode)
    return victim.name


def test_untouched_snapshot_is_trusted_without_hashing(
    cache: tuple[Any, str, str], ref: dict[str, torch.Tensor]
) -> None:
    _, snap, digest = cache
    stats = LoadStats()
    sd = load_state_dict(snap, expected_digest=digest, stats=stats)
    assert all(torch.equal(sd[k], ref[k]) for k in ref)
    assert set(stats.verification.values()) == {"trusted"}
    assert stats.bytes_read == stats.bytes_to_read + sum(
        read_header(os.path.join(snap, f)).data_start for f in stats.verification
    )


def test_fake_snapshot_outside_a_cache_is_refused(cache: tuple[Any, str, str], tmp_path: Path) -> None:
    _, snap, digest = cache
    hexd = digest.split(":", 1)[1]
    fake = tmp_path / "fake" / "snapshots" / hexd
    shutil.copytree(snap, fake)
    shutil.copyfile(snap + ".ready", str(fake) + ".ready")
    _edit_tensor_bytes(next(fake.glob("*.safetensors")))
    with pytest.raises(UnverifiedSourceError, match="--allow-unverified"):
        load_state_dict(str(fake), expected_digest=digest)
    with pytest.raises(UnverifiedSourceError):
        load_state_dict(str(fake))
    assert not (tmp_path / "fake" / "blobs").exists(), "opening a fake snapshot created a store"


def test_copied_cache_with_an_edited_file_fails_the_digest_check(
    cache: tuple[Any, str, str], tmp_path: Path, ref: dict[str, torch.Tensor]
) -> None:
    nc, _snap, digest = cache
    copy = tmp_path / "copy"
    shutil.copytree(nc.root, copy, symlinks=True)  # files copied: no longer the store's blobs
    hexd = digest.split(":", 1)[1]
    csnap = copy / "snapshots" / hexd
    victim_file = sorted(csnap.glob("*.safetensors"))[0]
    victim = _edit_tensor_bytes(victim_file)
    served: list[str] = []
    with pytest.raises(DigestMismatchError, match=re.escape(victim_file.name)):
        for name, _ in iter_tensors(str(csnap), expected_digest=digest):
            served.append(name)
    assert victim not in served
    # an unedited copy is genuine content: it loads, every file hashed against the manifest
    copy2 = tmp_path / "copy2"
    shutil.copytree(nc.root, copy2, symlinks=True)
    stats = LoadStats()
    sd = load_state_dict(str(copy2 / "snapshots" / hexd), expected_digest=digest, stats=stats)
    assert all(torch.equal(sd[k], ref[k]) for k in ref)
    assert set(stats.verification.values()) == {"hashed"}


def test_snapshot_file_replaced_in_a_real_cache_is_caught(cache: tuple[Any, str, str]) -> None:
    _, snap, digest = cache
    victim_file = sorted(Path(snap).glob("*.safetensors"))[0]
    data = victim_file.read_bytes()
    os.chmod(snap, 0o755)
    victim_file.unlink()
    victim_file.write_bytes(data)  # same bytes, new inode: not the store's blob any more
    victim = _edit_tensor_bytes(victim_file)
    os.chmod(victim_file, 0o444)
    os.chmod(snap, 0o555)
    with pytest.raises(DigestMismatchError, match=re.escape(victim_file.name)):
        load_state_dict(snap, expected_digest=digest)
    del victim


def test_blob_edited_in_place_and_left_writable_is_caught(cache: tuple[Any, str, str]) -> None:
    _, snap, digest = cache
    victim_file = sorted(Path(snap).glob("*.safetensors"))[0]
    os.chmod(victim_file, 0o644)  # what an in-place edit needs (and leaves behind)
    _edit_tensor_bytes(victim_file)
    with pytest.raises(DigestMismatchError):
        load_state_dict(snap, expected_digest=digest)


def test_blob_planted_by_another_uid_is_not_trusted(cache: tuple[Any, str, str]) -> None:
    _nc, snap, digest = cache
    victim_file = sorted(Path(snap).glob("*.safetensors"))[0]
    os.chown(victim_file, 65534, 65534)  # what `nobody` owns is not the cache owner's
    stats = LoadStats()
    load_state_dict(snap, expected_digest=digest, stats=stats)
    assert stats.verification[victim_file.name] == "hashed"
    _edit_tensor_bytes(victim_file)
    with pytest.raises(DigestMismatchError):
        load_state_dict(snap, expected_digest=digest)


def test_a_second_uid_cannot_get_its_fake_snapshot_trusted(
    cache: tuple[Any, str, str], tmp_path: Path
) -> None:
    """``nobody`` copies a real cache into a directory it owns and edits a weight in it."""
    import tempfile

    nc, _snap, digest = cache
    hexd = digest.split(":", 1)[1]
    shared = Path(tempfile.mkdtemp(prefix="modelpack-uid-"))
    try:
        os.chmod(shared, 0o777)
        shutil.copytree(nc.root, shared / "src", symlinks=True)  # readable by all (0444 / 0555)
        os.chmod(shared / "src", 0o755)  # the copied root: a new cache root is 0750
        script = (
            "import shutil, sys, os; shutil.copytree(sys.argv[1], sys.argv[2], symlinks=True, "
            "ignore=shutil.ignore_patterns('locks', 'ingest', 'leases', '.index.lock')); "
            "p = sys.argv[2] + '/snapshots/' + sys.argv[3]; os.chmod(p, 0o755); "
            "f = sorted(x for x in os.listdir(p) if x.endswith('.safetensors'))[0]; "
            "fp = os.path.join(p, f); os.chmod(fp, 0o644); d = bytearray(open(fp, 'rb').read()); "
            "d[len(d) - 7] ^= 0xFF; open(fp, 'wb').write(bytes(d)); os.chmod(fp, 0o444); os.chmod(p, 0o555)"
        )
        cmd = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", PYTHON, "-c", script]
        proc = subprocess.run(
            [*cmd, str(shared / "src"), str(shared / "c"), hexd], capture_output=True, text=True
        )
        # the attacker's copy must exist, or the test proves nothing (root and setpriv are required)
        assert proc.returncode == 0, f"could not stage the copy as nobody: {proc.stderr[-300:]}"
        assert os.stat(shared / "c" / "snapshots" / hexd).st_uid != 0
        # refused: the cache root is nobody's (StoreError naming the chown), or, read as a cache
        # of its own, the edited weight fails its digest
        with pytest.raises((DigestMismatchError, StoreError)):
            load_state_dict(str(shared / "c" / "snapshots" / hexd), expected_digest=digest)
    finally:
        subprocess.run(["chmod", "-R", "u+w", str(shared)], check=False)
        shutil.rmtree(shared, ignore_errors=True)


def test_marker_that_disagrees_with_the_manifest_is_refused(cache: tuple[Any, str, str]) -> None:
    _nc, snap, digest = cache
    marker = Path(snap + ".ready")
    doc = json.loads(marker.read_text())
    weights = [f for f in doc["files"] if f["path"].endswith(".safetensors")]
    # a weight file dropped from the marker
    edited = {**doc, "files": [f for f in doc["files"] if f is not weights[0]]}
    _rewrite(marker, json.dumps(edited))
    with pytest.raises(UnverifiedSourceError, match=re.escape(weights[0]["path"])):
        load_state_dict(snap, expected_digest=digest)
    # a weight file's digest changed in the marker
    edited = json.loads(json.dumps(doc))
    for f in edited["files"]:
        if f["path"] == weights[1]["path"]:
            f["digest"] = "sha256:" + "0" * 64
    _rewrite(marker, json.dumps(edited))
    with pytest.raises(UnverifiedSourceError, match=re.escape(weights[1]["path"])):
        load_state_dict(snap, expected_digest=digest)
    _rewrite(marker, json.dumps(doc))
    assert load_state_dict(snap, expected_digest=digest)


def _rewrite(path: Path, text: str) -> None:
    """Edit a read-only file the way its owner (root here) can, leaving it read-only again."""
    os.chmod(path, 0o644)
    path.write_text(text)
    os.chmod(path, 0o444)


def test_cache_pair_goes_through_the_same_checks(cache: tuple[Any, str, str], tmp_path: Path) -> None:
    nc, snap, digest = cache
    victim_file = sorted(Path(snap).glob("*.safetensors"))[0]
    os.chmod(victim_file, 0o644)
    _edit_tensor_bytes(victim_file)
    log = EventLog(str(tmp_path / "ev.jsonl"))
    with pytest.raises(DigestMismatchError):
        load_state_dict((nc, digest), expected_digest=digest, events=log)
    ev = _events(tmp_path / "ev.jsonl")
    assert any(e["event"] == "loader.rehashing" for e in ev), ev


# --------------------------------------------------------------------------- JSON from outside
def test_deeply_nested_json_in_loader_inputs_is_a_typed_refusal(ckpt: Path, tmp_path: Path) -> None:
    """config.json, a recorded fingerprint and an event log are read from outside: 5000 levels of
    nesting must not crash the loader with RecursionError."""
    from modelpack.loader import Fingerprint
    from modelpack.loader.timeline import read_event_file

    from modelpack.errors import FingerprintFileError, TimelineError

    deep = "[" * 5000 + "]" * 5000
    plain = tmp_path / "plain"
    shutil.copytree(ckpt, plain)
    (plain / "config.json").write_text('{"quantization_config": ' + deep + "}")
    stats = LoadStats()
    assert load_state_dict(str(plain), allow_unverified=True, stats=stats)
    assert stats.fingerprint is not None and stats.fingerprint.quantization == "none"
    fp_file = tmp_path / "fp.json"
    fp_file.write_text('{"fingerprint": ' + deep + "}")
    with pytest.raises(FingerprintFileError, match="nested deeper"):
        Fingerprint.read(str(fp_file))
    log = tmp_path / "ev.jsonl"
    log.write_text('{"event": "loader.read_start", "x": ' + deep + "}\n")
    with pytest.raises(TimelineError, match="nested deeper"):
        read_event_file(str(log))


def test_trusted_keys_on_a_snapshot_need_the_cache_to_have_verified_them(
    ckpt: Path, tmp_path: Path, ref: dict[str, torch.Tensor]
) -> None:
    """A key passed with a snapshot is not ignored: the cache must have recorded that this key
    verified the digest's signature (a pull under a policy trusting it)."""
    from modelpack.mount.cache import NodeCache
    from modelpack.signing import sign_artifact

    from tests.loader_helpers import pack_layout

    lay = pack_layout(ckpt, tmp_path / "layout")
    key = generate_key()
    sign_artifact(lay.target, lay.desc, key, chunk_table=False, directory_signature=False)
    pinned = f"oci:{lay.path}@{lay.digest}"
    unsigned_cache = NodeCache(str(tmp_path / "c1"))
    snap = unsigned_cache.pull(pinned).path  # no policy: nothing verified the signature
    with pytest.raises(UnsignedSourceError, match="--trusted-key"):
        load_state_dict(snap, expected_digest=lay.digest, trusted_keys=[key.public])
    with pytest.raises(UnsignedSourceError):
        load_state_dict((unsigned_cache, pinned), trusted_keys=[key.public])
    assert load_state_dict(snap, expected_digest=lay.digest)  # without keys: a plain hit
    signed_cache = NodeCache(str(tmp_path / "c2"))
    snap2 = signed_cache.pull(pinned, policy=[key.public]).path
    sd = load_state_dict(snap2, expected_digest=lay.digest, trusted_keys=[key.public])
    assert all(torch.equal(sd[k], ref[k]) for k in ref)
    with pytest.raises(UnsignedSourceError):  # another key: not what the cache verified
        load_state_dict(snap2, expected_digest=lay.digest, trusted_keys=[generate_key().public])
