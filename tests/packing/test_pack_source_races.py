"""Every pack source reads the file it checked: a name re-pointed between the check and the read
(a symlink renamed over a checked file by another user who can write the checkpoint directory,
the Modelfile's context or the Hugging Face cache) never gets another file packed.

The race is made deterministic by wrapping the step that checks (discovery, the Modelfile's glob
expansion, the snapshot listing): the wrapper lets the real check run, then re-points the name,
then the pack goes on to header, hash and copy.
"""

from __future__ import annotations

import hashlib
import os
import stat
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from modelpack.errors import ModelpackError, PackError
from modelpack.packing import hf_source, modelfile, packer
from modelpack.packing.hf_source import build_hf_artifact
from modelpack.packing.modelfile import build_modelfile_artifact
from modelpack.packing.opened_input import open_beneath
from modelpack.packing.packer import build_artifact
from modelpack.targets.layout import OCILayoutTarget
from modelpack.transfer.copy import copy
from tests.packing.test_hf_source import REPO, make_hub_cache

SECRET = b"root:$6$only-root-may-read-this:19000:0:99999:7:::\n"


def _secret(tmp_path: Path) -> Path:
    """A file outside every pack root, standing for /etc/shadow or a private key."""
    path = tmp_path / "outside" / "shadow"
    path.parent.mkdir()
    path.write_bytes(SECRET)
    path.chmod(0o600)
    return path


def _repoint(name: Path, target: Path | str) -> None:
    """What the other user does: a symlink renamed over the checked name (atomic)."""
    tmp = name.with_name(name.name + ".swap")
    os.symlink(target, tmp)
    os.replace(tmp, name)


def _checkpoint(root: Path) -> Path:
    root.mkdir()
    save_file({"w": torch.ones(4, 4)}, str(root / "model.safetensors"))
    (root / "config.json").write_text('{"model_type": "llama"}')
    (root / "README.md").write_text("# tiny\n")
    return root


def _stored(artifact: object, tmp_path: Path) -> list[bytes]:
    """Every blob the artifact stores once copied into a layout."""
    layout = OCILayoutTarget(tmp_path / "layout", create=True)
    copy(artifact, layout, "latest", "v1")  # type: ignore[arg-type]
    blobs = tmp_path / "layout" / "blobs" / "sha256"
    return [p.read_bytes() for p in blobs.iterdir()]


def _never_packed_secret(build: object, tmp_path: Path) -> None:
    """The pack is refused, or it stores the checked bytes: never the secret's."""
    try:
        artifact = build()  # type: ignore[operator]
    except ModelpackError:
        return
    try:
        stored = _stored(artifact, tmp_path)
    except ModelpackError:
        return
    finally:
        artifact.cleanup()
    assert all(SECRET not in blob for blob in stored), "a file outside the pack root was packed"
    assert not any(f.digest.hex == hashlib.sha256(SECRET).hexdigest() for f in artifact.files)


def test_directory_pack_reads_the_file_it_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Directory source: README.md re-pointed at a file outside the checkpoint after discovery."""
    root = _checkpoint(tmp_path / "ckpt")
    secret = _secret(tmp_path)
    real = packer.discover_files

    def discover_then_swap(*args: object, **kw: object) -> list[tuple[str, str]]:
        found = real(*args, **kw)  # type: ignore[arg-type]
        _repoint(root / "README.md", secret)
        return found

    monkeypatch.setattr(packer, "discover_files", discover_then_swap)
    _never_packed_secret(lambda: build_artifact(str(root)), tmp_path)


def test_modelfile_pack_reads_the_file_it_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--modelfile source: a selected file re-pointed outside the context after the globs ran."""
    root = _checkpoint(tmp_path / "ctx")
    secret = _secret(tmp_path)
    mf = tmp_path / "Modelfile"
    mf.write_text("NAME tiny\nMODEL model.safetensors\nCONFIG config.json\nDOC README.md\n")
    real = modelfile.select_files

    def select_then_swap(*args: object, **kw: object) -> list[object]:
        chosen = real(*args, **kw)  # type: ignore[arg-type]
        _repoint(root / "README.md", secret)
        return chosen  # type: ignore[return-value]

    monkeypatch.setattr(modelfile, "select_files", select_then_swap)
    _never_packed_secret(lambda: build_modelfile_artifact(str(root), str(mf)), tmp_path)


def test_hf_pack_reads_the_blob_it_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """hf:// source: a checked blob of the cache (README.md's, named by its git sha1, so no
    name-is-the-hash check catches it) re-pointed at a file outside the cache after the listing."""
    hub = make_hub_cache(tmp_path / "hf" / "hub")
    secret = _secret(tmp_path)
    real = hf_source.list_snapshot

    def list_then_swap(*args: object, **kw: object) -> list[object]:
        listed = real(*args, **kw)  # type: ignore[arg-type]
        _repoint(hub.blob("README.md"), secret)
        return listed  # type: ignore[return-value]

    monkeypatch.setattr(hf_source, "list_snapshot", list_then_swap)
    _never_packed_secret(
        lambda: build_hf_artifact(f"hf://{REPO}", cache_dir=str(hub.root), local_files_only=True), tmp_path
    )


def test_a_fifo_swapped_in_after_the_check_is_refused_without_hanging(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A FIFO renamed over a checked file is refused as not a regular file; the pack never waits
    on it for a writer (a watchdog writer would end a hang)."""
    root = _checkpoint(tmp_path / "ckpt")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    real = packer.discover_files

    def discover_then_swap(*args: object, **kw: object) -> list[tuple[str, str]]:
        found = real(*args, **kw)  # type: ignore[arg-type]
        os.replace(fifo, root / "README.md")
        return found

    def watchdog() -> None:  # ends a blocking open after 10 s, so a regression fails, not hangs
        if not done.wait(10):
            with open(root / "README.md", "wb") as w:
                w.write(SECRET)

    done = threading.Event()
    threading.Thread(target=watchdog, daemon=True).start()
    monkeypatch.setattr(packer, "discover_files", discover_then_swap)
    try:
        with pytest.raises(PackError, match=r"README\.md: not a regular file"):
            build_artifact(str(root))
    finally:
        done.set()


def test_a_hard_linked_file_and_links_inside_the_root_still_pack(tmp_path: Path) -> None:
    """Hard links (same inode, two names) and symlinks that stay inside the checkpoint pack with
    the bytes and digest of their file, as before."""
    elsewhere = tmp_path / "shared-weights.safetensors"
    save_file({"w": torch.ones(4, 4)}, str(elsewhere))
    root = tmp_path / "ckpt"
    root.mkdir()
    os.link(elsewhere, root / "model.safetensors")
    (root / "sub").mkdir()
    (root / "sub" / "notes.md").write_text("notes\n")
    os.symlink("sub/notes.md", root / "README.md")
    art = build_artifact(str(root))
    try:
        by = {f.relpath: f for f in art.files}
        assert by["model.safetensors"].digest.hex == hashlib.sha256(elsewhere.read_bytes()).hexdigest()
        assert by["README.md"].digest.hex == hashlib.sha256(b"notes\n").hexdigest()
    finally:
        art.cleanup()


def test_open_beneath_follows_only_links_that_stay_inside(tmp_path: Path) -> None:
    """Links inside the allowed roots resolve (files and directories, relative and absolute); a
    link leaving them, a loop, '..' and non-regular files are refused."""
    root = tmp_path / "root"
    (root / "d").mkdir(parents=True)
    (root / "d" / "f").write_bytes(b"inside")
    secret = _secret(tmp_path)
    os.symlink("d", root / "dir-link")
    os.symlink(str(root / "d" / "f"), root / "abs-link")
    os.symlink("../outside/shadow", root / "out-link")
    os.symlink("loop2", root / "loop1")
    os.symlink("loop1", root / "loop2")
    os.mkfifo(root / "fifo")
    for rel in ("d/f", "dir-link/f", "abs-link"):
        f = open_beneath(str(root), rel, link_roots=[str(root)])
        assert f.read_all(100) == b"inside" and stat.S_ISREG(f.stat.st_mode)
        f.close()
    for rel, why in (
        ("out-link", "outside the directories a pack may read"),
        ("loop1", "symlinks to follow"),
        ("../outside/shadow", "not a file path inside"),
        ("fifo", "not a regular file"),
        ("d", "not a regular file"),
    ):
        with pytest.raises(PackError, match=why):
            open_beneath(str(root), rel, link_roots=[str(root)])
    with pytest.raises(PackError, match="outside the directories"):
        open_beneath(str(root), "dir-link/f")  # no link roots: no link is followed
    assert secret.read_bytes() == SECRET


def test_more_inputs_than_the_soft_descriptor_limit_still_pack(tmp_path: Path) -> None:
    """Every input stays open until the pack is stored: a checkpoint with more files than the soft
    descriptor limit raises that limit to the hard one rather than failing with EMFILE."""
    import resource

    root = _checkpoint(tmp_path / "ckpt")
    for i in range(80):
        (root / f"extra-{i:03d}.md").write_text(f"{i}\n")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
    try:
        art = build_artifact(str(root))
        assert len(art.files) == 83
        art.cleanup()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
