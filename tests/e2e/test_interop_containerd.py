"""containerd pulls and unpacks the image-shaped variant — what a Kubernetes image
volume on a containerd node mounts — and the unpacked snapshot holds the model files byte for byte.

The test starts Debian's ``containerd`` itself, on its own root, state directory and socket, with
the ``native`` snapshotter (plain directories: no overlay mount and no privileges beyond writing
files), pulls with ``ctr images pull --plain-http`` from the test registry, and reads the files
from the top snapshot of the image's layer chain. Skipped with the reason when containerd is not
installed; ``.ci/bootstrap.sh`` installs it.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from modelpack.api import transfer
from tests.fixtures.registry import RegistryServer

pytestmark = pytest.mark.slow

CONTAINERD = shutil.which("containerd")
CTR = shutil.which("ctr")
NAMESPACE = "modelpack-test"


@pytest.fixture(autouse=True)
def _upload_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MODELPACK_UPLOAD_STATE_DIR", str(tmp_path / "upload-state"))


class Containerd:
    def __init__(self, socket: Path) -> None:
        self.socket = socket

    def ctr(self, *args: str, timeout: float = 120) -> str:
        r = subprocess.run(
            [str(CTR), "--address", str(self.socket), "--namespace", NAMESPACE, *args],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        assert r.returncode == 0, f"ctr {' '.join(args)}: {r.stderr}"
        return r.stdout


@pytest.fixture
def containerd(tmp_path: Path) -> Iterator[Containerd]:
    if not CONTAINERD or not CTR:
        pytest.skip(
            "containerd/ctr not installed (Debian package 'containerd'; .ci/bootstrap.sh installs it)"
        )
    root, state = tmp_path / "root", tmp_path / "state"
    sock_dir = Path(tempfile.mkdtemp(prefix="ctrd-", dir="/tmp"))  # unix socket paths are short
    socket = sock_dir / "containerd.sock"
    config = tmp_path / "config.toml"
    disabled = [
        "io.containerd.grpc.v1.cri",
        "io.containerd.snapshotter.v1.btrfs",
        "io.containerd.snapshotter.v1.zfs",
        "io.containerd.snapshotter.v1.aufs",
        "io.containerd.snapshotter.v1.devmapper",
        "io.containerd.snapshotter.v1.overlayfs",
    ]
    config.write_text(
        "\n".join(
            [
                "version = 2",
                f'root = "{root}"',
                f'state = "{state}"',
                f"disabled_plugins = {json.dumps(disabled)}",
                "[grpc]",
                f'  address = "{socket}"',
                "[ttrpc]",
                f'  address = "{socket}.ttrpc"',
                "[debug]",
                '  address = ""',
                "[metrics]",
                '  address = ""',
                '[plugins."io.containerd.internal.v1.opt"]',
                f'  path = "{tmp_path / "opt"}"',
                "",
            ]
        )
    )
    log = open(tmp_path / "containerd.log", "wb")
    proc = subprocess.Popen([str(CONTAINERD), "--config", str(config)], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                pytest.fail(f"containerd exited: {(tmp_path / 'containerd.log').read_text()[-3000:]}")
            ok = socket.exists() and (
                subprocess.run(
                    [str(CTR), "--address", str(socket), "version"], capture_output=True, timeout=10
                ).returncode
                == 0
            )
            if ok:
                break
            if time.monotonic() > deadline:
                pytest.fail(f"containerd did not start: {(tmp_path / 'containerd.log').read_text()[-3000:]}")
            time.sleep(0.1)
        yield Containerd(socket)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        shutil.rmtree(sock_dir, ignore_errors=True)


def _chain_id(diff_ids: list[str]) -> str:
    """The snapshot key of a layer stack (OCI image spec, config.md "Layer ChainID")."""
    chain = diff_ids[0]
    for d in diff_ids[1:]:
        chain = "sha256:" + hashlib.sha256(f"{chain} {d}".encode()).hexdigest()
    return chain


def _files(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_containerd_unpacks_the_image_shaped_variant_byte_for_byte(
    containerd: Containerd, registry: RegistryServer, checkpoint: Path, compression: str | None
) -> None:
    (checkpoint / "run.py").write_text("print(1)\n")
    (checkpoint / "run.py").chmod(0o755)
    ref = registry.ref(f"interop/containerd-{compression or 'tar'}", "v1")
    pushed = transfer.push(str(checkpoint), ref, format="image", compression=compression, progress="off")
    out = containerd.ctr(
        "images",
        "pull",
        "--plain-http",
        "--snapshotter",
        "native",
        "--platform",
        "linux/amd64",
        ref,
        timeout=300,
    )
    assert "done" in out or "unpacking" in out
    listed = containerd.ctr("images", "ls")
    assert str(pushed.digest) in listed

    config_digest = json.loads(containerd.ctr("content", "get", str(pushed.digest)))["config"]["digest"]
    image_config = json.loads(containerd.ctr("content", "get", config_digest))
    assert image_config["config"]["Labels"]["dev.modelpack.model.architecture"] == "transformer"
    top = _chain_id(image_config["rootfs"]["diff_ids"])
    mounts = json.loads(
        containerd.ctr("snapshots", "--snapshotter", "native", "view", "--mounts", "check-view", top)
    )
    source = Path(mounts[0]["Source"])
    assert mounts[0]["Type"] == "bind"
    assert _files(source / "models") == _files(checkpoint)  # what an image volume mounts at its path
    assert (source / "models" / "run.py").stat().st_mode & 0o777 == 0o755
    assert sorted(p.name for p in source.iterdir()) == ["models"]
