"""``hf://ORG/NAME[@REVISION]`` sources, offline against a cache laid out as huggingface_hub lays it out.

The cache is built here exactly as huggingface_hub writes it (``models--ORG--NAME/`` with
``blobs/`` named by sha256 for LFS files and by git blob sha1 for the others, ``refs/main`` holding
the commit, ``snapshots/<commit>/…`` relative symlinks into ``blobs/``), and
``huggingface_hub.scan_cache_dir`` must read it without a warning before anything is packed.
Every pack runs with ``HF_HUB_OFFLINE=1`` (CLI) or ``local_files_only=True`` (library).
"""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import subprocess
import sys
import threading
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import huggingface_hub
import pytest
import torch
from safetensors.torch import save_file

from modelpack import api
from modelpack.errors import HFRevisionNotFoundError, HFSourceError
from modelpack.files import try_reflink
from modelpack.packing.hf_source import build_hf_artifact, parse_hf_url
from modelpack.packing.packed_artifact import PackOptions
from tests.fixtures.registry import RegistryServer

REPO = "acme-ai/tiny-llama"
TOKEN = "hf_" + "TestTokenDoNotPrint" + "7Qx2"  # distinctive, so output can be grepped for it
ENDPOINT = "https://hub.example.internal"
# in-process packs read huggingface_hub's endpoint as imported; the CLI runs name ENDPOINT, which is
# part of what is recorded (sourceURL), so the in-process ones record the same URL
SAME_ENDPOINT = PackOptions(source_url=f"{ENDPOINT}/{REPO}")


@dataclass
class HubCache:
    root: Path  # HF_HUB_CACHE
    repo: Path  # models--ORG--NAME
    commit: str
    files: dict[str, bytes]  # snapshot relpath → bytes

    @property
    def snapshot(self) -> Path:
        return self.repo / "snapshots" / self.commit

    def blob(self, rel: str) -> Path:
        return (self.snapshot / rel).resolve()


def _git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\x00" % len(data) + data).hexdigest()


def _model_files(tmp: Path) -> dict[str, bytes]:
    torch.manual_seed(0)
    tensors = {
        "model.embed_tokens.weight": torch.randn(64, 16, dtype=torch.bfloat16),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(16, 16, dtype=torch.bfloat16),
        "lm_head.weight": torch.randn(64, 16, dtype=torch.bfloat16),
    }
    save_file(tensors, str(tmp / "w.safetensors"), metadata={"format": "pt"})
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "torch_dtype": "bfloat16",
        "num_attention_heads": 4,
        "num_hidden_layers": 1,
        "hidden_size": 16,
    }
    return {
        ".gitattributes": b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n",
        "README.md": b"# tiny llama\n",
        "config.json": json.dumps(config, indent=2).encode(),
        "generation_config.json": b'{"bos_token_id": 1}\n',
        "model.safetensors": (tmp / "w.safetensors").read_bytes(),
        "tokenizer.json": json.dumps(
            {"version": "1.0", "model": {"type": "BPE", "vocab": {"a": 0}}}
        ).encode(),
        "tokenizer_config.json": b'{"model_max_length": 128}\n',
        "original/params.json": b'{"dim": 16}\n',
    }


def make_hub_cache(root: Path, repo_id: str = REPO, commit: str = "a" * 8 + "1" * 32) -> HubCache:
    """A cache as ``hf_hub_download`` leaves it: blobs, refs/main, relative snapshot symlinks."""
    org, name = repo_id.split("/")
    repo = root / f"models--{org}--{name}"
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)  # huggingface_hub writes the sha, no newline
    gen = root.parent / f"gen-{name}"
    gen.mkdir(exist_ok=True)
    files = _model_files(gen)
    tree: dict[str, dict[str, Any]] = {}
    for rel, data in files.items():
        lfs = rel.endswith(".safetensors")
        blob = hashlib.sha256(data).hexdigest() if lfs else _git_blob_sha1(data)
        (repo / "blobs" / blob).write_bytes(data)
        link = repo / "snapshots" / commit / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(repo / "blobs" / blob, link.parent))
        tree[rel] = {"size": len(data), "blob_id": _git_blob_sha1(data)}
        if lfs:
            tree[rel].update({"lfs_sha256": blob, "lfs_size": len(data)})
    # the listing snapshot_download caches per commit, by which it tells a complete snapshot offline
    (repo / "trees").mkdir()
    (repo / "trees" / f"{commit}.json").write_text(json.dumps({"format_version": 1, "files": tree}, indent=1))
    return HubCache(root, repo, commit, files)


@pytest.fixture
def hub(tmp_path: Path) -> HubCache:
    return make_hub_cache(tmp_path / "hf" / "hub")


def run_cli(
    *argv: str, hub: HubCache, extra_env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.update(
        {
            "HF_HUB_OFFLINE": "1",
            "HF_HUB_CACHE": str(hub.root),
            "HF_HOME": str(hub.root.parent),
            "HF_TOKEN": TOKEN,
            "HF_ENDPOINT": ENDPOINT,
        }
    )
    env.update(extra_env or {})
    return subprocess.run(
        [sys.executable, "-m", "modelpack.cli", *argv], capture_output=True, text=True, env=env, timeout=120
    )


def _json(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc: dict[str, Any] = json.loads(proc.stdout)
    return doc


def _no_token_anywhere(*roots: Path, texts: tuple[str, ...] = ()) -> None:
    for text in texts:
        assert TOKEN not in text
    for root in roots:
        for dirpath, _, names in os.walk(root):
            for n in names:
                p = Path(dirpath) / n
                if p.is_file() and not p.is_symlink():
                    assert TOKEN.encode() not in p.read_bytes(), p


def test_the_cache_is_laid_out_as_huggingface_hub_lays_it_out(hub: HubCache) -> None:
    info = huggingface_hub.scan_cache_dir(hub.root)
    assert info.warnings == []
    (repo,) = info.repos
    assert (repo.repo_id, repo.repo_type) == (REPO, "model")
    (rev,) = repo.revisions
    assert rev.commit_hash == hub.commit
    assert rev.refs == frozenset({"main"})
    assert {str(f.file_path.relative_to(rev.snapshot_path)) for f in rev.files} == set(hub.files)
    # huggingface_hub itself finds the revision offline, by branch and by commit
    for revision in ("main", hub.commit):
        got = huggingface_hub.snapshot_download(
            REPO, revision=revision, cache_dir=str(hub.root), local_files_only=True
        )
        assert Path(got) == hub.snapshot


def test_pack_from_hf_by_default_branch_commit_and_ref_is_one_reproducible_artifact(
    hub: HubCache, tmp_path: Path
) -> None:
    layout = tmp_path / "layout"
    staging = tmp_path / "staging"
    staging.mkdir()
    digests = []
    procs = []
    for tag, source in (
        ("a", f"hf://{REPO}"),
        ("b", f"hf://{REPO}@{hub.commit}"),
    ):
        proc = run_cli(
            "pack",
            source,
            f"oci:{layout}:{tag}",
            "--json",
            hub=hub,
            extra_env={"MODELPACK_STAGING_DIR": str(staging)},
        )
        procs.append(proc)
        doc = _json(proc)
        digests.append(doc["digest"])
        assert doc["config"]["descriptor"]["revision"] == hub.commit
        assert doc["config"]["descriptor"]["sourceURL"] == f"{ENDPOINT}/{REPO}"
        assert doc["config"]["descriptor"]["name"] == "tiny-llama"
        assert doc["config"]["config"]["precision"] == "bfloat16"
    by_ref = build_hf_artifact(
        f"hf://{REPO}@main", SAME_ENDPOINT, cache_dir=str(hub.root), local_files_only=True
    )
    digests.append(str(by_ref.digest))
    assert len(set(digests)) == 1  # the same revision packs to the same manifest digest
    # no second copy: nothing was staged, and each layout blob is the cache blob itself (linked)
    assert list(staging.iterdir()) == []
    summary = api.inspect(f"oci:{layout}:a")
    assert {layer.path for layer in summary.layers} == set(hub.files) - {".gitattributes"}
    for layer in summary.layers:
        assert layer.path is not None
        stored = layout / "blobs" / "sha256" / layer.digest[7:]
        assert stored.read_bytes() == hub.files[layer.path]
    # pulled back, byte for byte
    out = tmp_path / "pulled"
    api.pull(f"oci:{layout}:b", str(out))
    for rel, data in hub.files.items():
        if rel != ".gitattributes":
            assert (out / rel).read_bytes() == data
    _no_token_anywhere(layout, out, texts=tuple(p.stdout + p.stderr for p in procs))


def test_pack_into_a_layout_on_the_same_filesystem_links_the_blobs_not_copies(
    hub: HubCache, tmp_path: Path
) -> None:
    layout = tmp_path / "layout"
    nlink = hub.blob("model.safetensors").stat().st_nlink
    _json(run_cli("pack", f"hf://{REPO}", f"oci:{layout}:v1", "--json", "--link", "auto", hub=hub))
    weights = hub.blob("model.safetensors")
    stored = layout / "blobs" / "sha256" / hashlib.sha256(hub.files["model.safetensors"]).hexdigest()
    probe = tmp_path / "probe"
    # --link auto reflinks where the filesystem clones (a new inode sharing the extents), else hard-links
    if try_reflink(str(weights), str(probe)):
        assert stored.stat().st_ino != weights.stat().st_ino and stored.read_bytes() == weights.read_bytes()
    else:
        assert os.path.samefile(stored, weights)
        assert weights.stat().st_nlink == nlink + 1


def test_push_from_hf_to_a_registry_and_pull_back(
    hub: HubCache, registry: RegistryServer, tmp_path: Path
) -> None:
    ref = registry.ref("hf/tiny-llama", "main")
    key = tmp_path / "ci"
    assert run_cli("keygen", "--out", str(key), hub=hub).returncode == 0
    proc = run_cli("push", f"hf://{REPO}@main", ref, "--json", "--sign-key", f"{key}.key", hub=hub)
    doc = _json(proc)
    verified = run_cli("verify", ref, "--key", f"{key}.pub", hub=hub)
    assert verified.returncode == 0, verified.stderr
    again = build_hf_artifact(
        f"hf://{REPO}@{hub.commit}", SAME_ENDPOINT, cache_dir=str(hub.root), local_files_only=True
    )
    assert again.digest == doc["digest"]
    summary = api.inspect(ref)
    assert summary.digest == doc["digest"]
    assert summary.config is not None
    assert summary.config["descriptor"]["revision"] == hub.commit
    out = tmp_path / "pulled"
    api.pull(ref, str(out))
    for rel, data in hub.files.items():
        if rel != ".gitattributes":
            assert (out / rel).read_bytes() == data
    _no_token_anywhere(out, texts=(proc.stdout, proc.stderr))


def test_a_revision_missing_offline_is_a_typed_error_naming_repo_and_revision(hub: HubCache) -> None:
    with pytest.raises(HFRevisionNotFoundError) as err:
        build_hf_artifact(f"hf://{REPO}@v9.9", cache_dir=str(hub.root), local_files_only=True)
    assert err.value.repo_id == REPO and err.value.revision == "v9.9"
    assert REPO in str(err.value) and "v9.9" in str(err.value)
    missing = "b" * 40
    with pytest.raises(HFRevisionNotFoundError, match=missing):
        build_hf_artifact(f"hf://{REPO}@{missing}", cache_dir=str(hub.root), local_files_only=True)
    proc = run_cli("pack", f"hf://{REPO}@release/2026", "oci:/nonexistent-x:v1", hub=hub)
    assert proc.returncode == 1
    assert "acme-ai/tiny-llama" in proc.stderr and "release/2026" in proc.stderr
    assert "Traceback" not in proc.stderr
    debug = run_cli("--debug", "pack", f"hf://{REPO}@release/2026", "oci:/nonexistent-x:v1", hub=hub)
    assert debug.returncode == 1 and "Traceback" in debug.stderr
    _no_token_anywhere(texts=(proc.stdout, proc.stderr, debug.stdout, debug.stderr))


def test_hf_home_locates_the_cache_and_a_tag_ref_resolves(hub: HubCache, tmp_path: Path) -> None:
    # HF_HOME alone (no HF_HUB_CACHE): huggingface_hub's cache is $HF_HOME/hub, as users expect
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_CACHE", "HF_ENDPOINT", "HF_TOKEN")}
    (hub.repo / "refs" / "v1.0").write_text(hub.commit)  # a tag, as huggingface_hub records it
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "modelpack.cli",
            "pack",
            f"hf://{REPO}@v1.0",
            f"oci:{tmp_path / 'l'}:v1",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**env, "HF_HOME": str(hub.root.parent), "HF_HUB_OFFLINE": "1"},
    )
    doc = _json(proc)
    assert doc["config"]["descriptor"]["revision"] == hub.commit
    assert doc["config"]["descriptor"]["sourceURL"] == f"https://huggingface.co/{REPO}"
    moved = subprocess.run(
        [sys.executable, "-m", "modelpack.cli", "pack", f"hf://{REPO}@v1.0", f"oci:{tmp_path / 'l'}:v2"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**env, "HF_HOME": str(tmp_path / "elsewhere"), "HF_HUB_OFFLINE": "1"},
    )
    assert moved.returncode == 1 and "not in the Hugging Face cache" in moved.stderr


def test_an_incomplete_snapshot_is_a_typed_error_not_a_partial_pack(hub: HubCache) -> None:
    (hub.snapshot / "tokenizer.json").unlink()  # an interrupted download
    with pytest.raises(HFRevisionNotFoundError, match="incomplete") as err:
        build_hf_artifact(f"hf://{REPO}", cache_dir=str(hub.root), local_files_only=True)
    assert err.value.repo_id == REPO and err.value.revision == "main"


def test_a_revision_is_data_escaped_when_printed_and_never_a_path(hub: HubCache) -> None:
    proc = run_cli("pack", f"hf://{REPO}@v1\x1b[2J", "oci:/nonexistent-x:v1", hub=hub)
    assert proc.returncode != 0
    assert "\x1b" not in proc.stderr and "\\x1b" in proc.stderr
    for bad in ("../../../../etc", "/etc/passwd", "a/../b", ""):
        with pytest.raises(HFSourceError, match="revision"):
            parse_hf_url(f"hf://{REPO}@{bad}")
    for bad_repo in ("hf://tiny", "hf://a/b/c", "hf://a--b/c", "hf://a/..b", "hf://../x"):
        with pytest.raises(HFSourceError, match="repository id"):
            parse_hf_url(bad_repo)


def test_a_snapshot_symlink_leaving_the_blobs_is_refused_naming_it(hub: HubCache, tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("not a model file")
    link = hub.snapshot / "README.md"
    link.unlink()
    link.symlink_to(os.path.relpath(secret, link.parent))
    with pytest.raises(HFSourceError, match=r"README\.md.*outside the repository's blobs"):
        build_hf_artifact(f"hf://{REPO}", cache_dir=str(hub.root), local_files_only=True)
    # a link into another repository's blobs is outside this one's, too
    other = make_hub_cache(hub.root, "acme-ai/other")
    link.unlink()
    link.symlink_to(other.blob("README.md"))
    with pytest.raises(HFSourceError, match=r"README\.md"):
        build_hf_artifact(f"hf://{REPO}", cache_dir=str(hub.root), local_files_only=True)


def test_a_ref_file_pointing_out_of_the_snapshots_is_refused(hub: HubCache, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "config.json").write_text("{}")
    (hub.repo / "refs" / "main").write_text(os.path.relpath(elsewhere, hub.repo / "snapshots"))
    with pytest.raises(HFSourceError, match="not a snapshot directory"):
        build_hf_artifact(f"hf://{REPO}", cache_dir=str(hub.root), local_files_only=True)


def test_hostile_names_and_links_in_the_snapshot_are_refused(hub: HubCache, tmp_path: Path) -> None:
    blob = os.path.relpath(hub.blob("README.md"), hub.snapshot)
    # a name with a control character (a terminal escape)
    evil = hub.snapshot / "read\x1bme.md"
    evil.symlink_to(blob)
    with pytest.raises(HFSourceError, match="control character"):
        build_hf_artifact(f"hf://{REPO}", cache_dir=str(hub.root), local_files_only=True)
    evil.unlink()
    # a backslash name that another system would read as ..\..\x
    evil = hub.snapshot / "a\\..\\..\\x.md"
    evil.symlink_to(blob)
    with pytest.raises(HFSourceError, match="backslash"):
        build_hf_artifact(f"hf://{REPO}", cache_dir=str(hub.root), local_files_only=True)
    evil.unlink()
    # a name that is not UTF-8 (it could not be written into an annotation as the same name)
    evil_bytes = os.path.join(os.fsencode(hub.snapshot), b"\xffx.md")
    os.symlink(os.fsencode(blob), evil_bytes)
    with pytest.raises(HFSourceError, match="not UTF-8"):
        build_hf_artifact(f"hf://{REPO}", cache_dir=str(hub.root), local_files_only=True)
    os.unlink(evil_bytes)
    # a symlinked directory (a traversal out of the snapshot)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "x.md").write_text("x")
    (hub.snapshot / "sub").symlink_to(outside)
    with pytest.raises(HFSourceError, match="symlinked directory"):
        build_hf_artifact(f"hf://{REPO}", cache_dir=str(hub.root), local_files_only=True)
    (hub.snapshot / "sub").unlink()
    # a link that walks through blobs/ and out again
    link = hub.snapshot / "config.json"
    link.unlink()
    link.symlink_to("../../blobs/" + os.path.relpath(outside / "x.md", hub.repo / "blobs"))  # blobs/../../..
    with pytest.raises(HFSourceError, match=r"config\.json.*outside"):
        build_hf_artifact(f"hf://{REPO}", cache_dir=str(hub.root), local_files_only=True)


def test_an_lfs_blob_whose_bytes_do_not_hash_to_its_name_is_refused(hub: HubCache) -> None:
    blob = hub.blob("model.safetensors")
    data = bytearray(blob.read_bytes())
    data[-1] ^= 0xFF  # still a valid safetensors file, other bytes
    blob.write_bytes(bytes(data))
    with pytest.raises(HFSourceError, match="corrupted or forged"):
        build_hf_artifact(f"hf://{REPO}", cache_dir=str(hub.root), local_files_only=True)


def test_without_huggingface_hub_the_error_names_the_extra(hub: HubCache) -> None:
    code = (
        "import sys; sys.modules['huggingface_hub'] = None\n"
        "from modelpack.errors import HFSourceError\n"
        "from modelpack.packing.hf_source import build_hf_artifact\n"
        "try:\n"
        f"    build_hf_artifact('hf://{REPO}', cache_dir={str(hub.root)!r}, local_files_only=True)\n"
        "except HFSourceError as exc:\n"
        "    print(exc)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "modelpack-oci[hf]" in proc.stdout


class FakeHub:
    """A loopback stand-in for the Hub's HTTP API, as much of it as ``snapshot_download`` asks for
    (revision info, the tree listing, HEAD/GET of ``resolve/``), recording each request's
    ``Authorization``. It serves whatever file names it is given: a hostile ``HF_ENDPOINT``."""

    def __init__(self, repo_id: str, commit: str, files: dict[str, bytes]) -> None:
        self.repo_id, self.commit, self.files = repo_id, commit, files
        self.auth: list[tuple[str, str, str | None]] = []  # (method, path, Authorization)
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_HEAD(self) -> None:
                self.do_GET(head=True)

            def do_GET(self, head: bool = False) -> None:
                path = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path)
                hub.auth.append((self.command, path, self.headers.get("Authorization")))
                api = f"/api/models/{hub.repo_id}/"
                resolve = f"/{hub.repo_id}/resolve/{hub.commit}/"
                headers = {"Content-Type": "application/json"}
                if path.startswith(api + "revision/"):
                    siblings = [{"rfilename": f} for f in hub.files]
                    body = json.dumps({"id": hub.repo_id, "sha": hub.commit, "siblings": siblings}).encode()
                elif path.startswith(api + "tree/"):
                    body = json.dumps([hub.entry(f) for f in hub.files]).encode()
                elif path.startswith(resolve) and path[len(resolve) :] in hub.files:
                    name = path[len(resolve) :]
                    body, etag = hub.files[name], hub.entry(name)["etag"]
                    headers = {"X-Repo-Commit": hub.commit, "ETag": f'"{etag}"'}
                    if name.endswith(".safetensors"):
                        headers.update({"X-Linked-Etag": f'"{etag}"', "X-Linked-Size": str(len(body))})
                else:
                    body, headers = b"{}", {"X-Error-Code": "EntryNotFound"}
                self.send_response(200 if "X-Error-Code" not in headers else 404)
                for k, v in {**headers, "Content-Length": str(len(body))}.items():
                    self.send_header(k, v)
                self.end_headers()
                if not head:
                    self.wfile.write(body)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def entry(self, name: str) -> dict[str, Any]:
        data = self.files[name]
        lfs = name.endswith(".safetensors")
        etag = hashlib.sha256(data).hexdigest() if lfs else _git_blob_sha1(data)
        e: dict[str, Any] = {
            "type": "file",
            "path": name,
            "size": len(data),
            "oid": _git_blob_sha1(data),
            "etag": etag,
        }
        if lfs:
            e["lfs"] = {"oid": etag, "size": len(data), "pointerSize": 130}
        return e

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_online_through_hf_endpoint_with_hf_token_then_offline_to_the_same_digest(tmp_path: Path) -> None:
    files = {k: v for k, v in _model_files(tmp_path).items() if k != ".gitattributes"}
    fake = FakeHub(REPO, "c" * 40, files)
    cache = HubCache(
        tmp_path / "hf" / "hub", tmp_path / "hf" / "hub" / "models--acme-ai--tiny-llama", "c" * 40, files
    )
    try:
        online = run_cli(
            "pack",
            f"hf://{REPO}@main",
            f"oci:{tmp_path / 'l'}:on",
            "--json",
            hub=cache,
            extra_env={"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": fake.url, "HF_HUB_DISABLE_PROGRESS_BARS": "1"},
        )
        doc = _json(online)
    finally:
        fake.close()
    # HF_TOKEN went to HF_ENDPOINT with every request for the repository (huggingface_hub decides that)
    repo_requests = [a for _, path, a in fake.auth if REPO in path]
    assert len(repo_requests) >= 2 * len(files) and set(repo_requests) == {f"Bearer {TOKEN}"}
    assert doc["config"]["descriptor"]["revision"] == "c" * 40
    assert doc["config"]["descriptor"]["sourceURL"] == f"{fake.url}/{REPO}"
    assert huggingface_hub.scan_cache_dir(cache.root).warnings == []
    # the endpoint is gone: offline, from the cache it filled, the same digest
    offline = run_cli(
        "pack",
        f"hf://{REPO}@main",
        f"oci:{tmp_path / 'l'}:off",
        "--json",
        hub=cache,
        extra_env={"HF_ENDPOINT": fake.url},
    )
    assert _json(offline)["digest"] == doc["digest"]
    out = tmp_path / "pulled"
    api.pull(f"oci:{tmp_path / 'l'}:off", str(out))
    for rel, data in files.items():
        assert (out / rel).read_bytes() == data
    _no_token_anywhere(
        tmp_path / "l", cache.root, out, texts=(online.stdout, online.stderr, offline.stdout, offline.stderr)
    )


@pytest.mark.parametrize(
    "hostile, message",
    [("../../../../evil.md", "'..' path segment"), ("read\x1b[2Jme.md", "control character")],
)
def test_a_hostile_endpoints_file_names_are_refused(tmp_path: Path, hostile: str, message: str) -> None:
    fake = FakeHub(REPO, "e" * 40, {"config.json": b"{}", hostile: b"planted"})
    cache = HubCache(tmp_path / "hf" / "hub", tmp_path / "hf" / "hub", "e" * 40, {})
    try:
        proc = run_cli(
            "pack",
            f"hf://{REPO}",
            f"oci:{tmp_path / 'l'}:v1",
            hub=cache,
            extra_env={"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": fake.url, "HF_HUB_DISABLE_PROGRESS_BARS": "1"},
        )
    finally:
        fake.close()
    assert proc.returncode == 1, proc.stderr
    assert message in proc.stderr and REPO in proc.stderr and "Traceback" not in proc.stderr
    assert "\x1b" not in proc.stderr
    planted = [p for p in tmp_path.rglob("*") if p.is_file() and p.read_bytes() == b"planted"]
    assert all(cache.root in p.parents for p in planted)  # nothing landed outside the cache
    index = tmp_path / "l" / "index.json"
    assert not index.exists() or json.loads(index.read_text())["manifests"] == []  # nothing stored


def test_offline_a_snapshot_whose_completeness_cannot_be_shown_is_refused(hub: HubCache) -> None:
    """Offline, a cache filled file by file (no trees/<commit>.json listing) holding part of the
    commit is refused, naming the commit and how to fix it, rather than packed as the whole commit;
    so is one whose listing names files the snapshot lacks."""
    import shutil

    from modelpack.errors import HFRevisionNotFoundError

    listing = hub.repo / "trees" / f"{hub.commit}.json"
    saved = listing.read_bytes()
    shutil.rmtree(hub.repo / "trees")
    for rel in ("tokenizer.json", "original/params.json"):
        (hub.snapshot / rel).unlink()
    with pytest.raises(HFRevisionNotFoundError, match=rf"no listing of commit {hub.commit}.*download"):
        build_hf_artifact(f"hf://{REPO}", cache_dir=str(hub.root), local_files_only=True)
    proc = run_cli("pack", f"hf://{REPO}", "oci:/nonexistent-never-written:v1", hub=hub)
    assert proc.returncode == 1 and "no listing of commit" in proc.stderr, proc.stderr
    # the listing back, the two files still missing: refused naming them
    from modelpack.packing.hf_source import check_snapshot_complete, parse_hf_url

    listing.parent.mkdir()
    listing.write_bytes(saved)
    with pytest.raises(
        HFRevisionNotFoundError, match=r"lacks 2 of its 8 files \(original/params.json, tokenizer.json\)"
    ):
        check_snapshot_complete(parse_hf_url(f"hf://{REPO}"), str(hub.snapshot), str(hub.repo), hub.commit)
