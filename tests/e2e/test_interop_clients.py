"""Independent clients read what modelpack writes, and modelpack reads theirs.

- ``modelpack-client`` (PyPI; runs from ``.venv-peers`` because its console script is also called
  ``modelpack``): it pulls what ``modelpack push`` wrote (it validates the config against the
  spec's schema, so a config with members the spec does not define is refused), and modelpack
  pulls what it pushes — raw files and folders as ``tar``, ``tar+gzip`` and ``tar+zstd`` layers.
- ``oras`` (oras-py): pulls every file of a modelpack push by its ``org.opencontainers.image.title``.

Each compares the files byte for byte with the checkpoint. Tests needing a client the machine
lacks are skipped with the reason; ``.ci/bootstrap.sh`` installs them so CI runs them.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

import pytest

from modelpack.api import transfer
from tests.fixtures.registry import RegistryServer
from tests.paths import REPO_ROOT

pytestmark = pytest.mark.slow

ROOT = REPO_ROOT
PEERS_PYTHON = ROOT / ".venv-peers" / "bin" / "python"


@pytest.fixture(autouse=True)
def _upload_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MODELPACK_UPLOAD_STATE_DIR", str(tmp_path / "upload-state"))


def _peers() -> Path:
    if not PEERS_PYTHON.exists():
        pytest.skip("modelpack-client is not installed: run .ci/peers-venv.sh (make deps does)")
    return PEERS_PYTHON


def _files(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.name.startswith(".")
    }


def _client(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(_peers()), "-m", "modelpack_client", "--insecure", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "DOCKER_CONFIG": os.environ.get("DOCKER_CONFIG", "/nonexistent")},
    )


def test_modelpack_client_pulls_what_modelpack_pushes(
    registry: RegistryServer, checkpoint: Path, tmp_path: Path
) -> None:
    _peers()
    (checkpoint / "sub").mkdir()
    (checkpoint / "sub" / "tokenizer_config.json").write_text("{}")
    (checkpoint / "run.py").write_text("print(1)\n")
    os.chmod(checkpoint / "run.py", 0o755)
    ref = registry.ref("interop/client-pulls", "v1")
    transfer.push(str(checkpoint), ref, progress="off")
    out = tmp_path / "pulled"
    r = _client("pull", ref, str(out))
    assert r.returncode == 0, r.stderr  # modelpack 0.1: "'transformerConfig' was unexpected"
    assert _files(out) == _files(checkpoint)
    # modelpack-client restores the recorded mode: the script stays executable
    assert os.stat(out / "run.py").st_mode & 0o777 == 0o755


def test_modelpack_client_pulls_the_image_shaped_variant_is_not_its_job(
    registry: RegistryServer, checkpoint: Path
) -> None:
    """The image-shaped variant is an OCI image, not a ModelPack artifact: a ModelPack client
    refuses it by its artifact type (it is for containerd), and says so."""
    _peers()
    ref = registry.ref("interop/client-image", "v1")
    transfer.push(str(checkpoint), ref, format="image", progress="off")
    r = _client("pull", ref, "/nonexistent/never-written")
    assert r.returncode != 0 and "not a CNCF ModelPack" in r.stderr


def _client_push(ref: str, config: Path, layers: list[str]) -> None:
    args = ["push", ref, "--config", str(config)]
    for layer in layers:
        args += ["--layer", layer]
    r = _client(*args)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("fmt", ["tar", "tar+gzip", "tar+zstd"])
def test_modelpack_pulls_what_modelpack_client_pushes(
    registry: RegistryServer, checkpoint: Path, tmp_path: Path, fmt: str
) -> None:
    """Weights as raw files; the tokenizer folder as one directory layer in ``fmt``."""
    _peers()
    src = tmp_path / "src"
    tok = src / "tokenizer"
    tok.mkdir(parents=True)
    for name in ("tokenizer_config.json", "generation_config.json"):
        (tok / name).write_bytes((checkpoint / name).read_bytes())
    (tok / "nested").mkdir()
    (tok / "nested" / "special_tokens_map.json").write_text('{"bos": "<s>"}')
    config = tmp_path / "model-config.json"
    config.write_text(json.dumps({"descriptor": {"name": "peer"}, "config": {"format": "safetensors"}}))
    weights = sorted(checkpoint.glob("*.safetensors"))
    layers = [f"{w}:application/vnd.cncf.model.weight.v1.raw" for w in weights]
    layers.append(f"{tok}:application/vnd.cncf.model.weight.config.v1.{fmt}")
    ref = registry.ref(f"interop/client-pushes-{fmt.replace('+', '-')}", "v1")
    _client_push(ref, config, layers)

    out = tmp_path / "ours"
    result = transfer.pull(ref, str(out), progress="off")
    expected = {w.name: hashlib.sha256(w.read_bytes()).hexdigest() for w in weights}
    expected.update({f"tokenizer/{k}": v for k, v in _files(tok).items()})
    assert _files(out) == expected
    assert sorted(result.files) == sorted(expected)


def test_oras_pulls_every_file_by_its_title(
    registry: RegistryServer, checkpoint: Path, tmp_path: Path
) -> None:
    import oras.client as oras_client  # declared test dependency: missing is a failure, not a skip

    (checkpoint / "sub").mkdir()
    (checkpoint / "sub" / "notes.md").write_text("# notes\n")
    ref = registry.ref("interop/oras", "v1")
    transfer.push(str(checkpoint), ref, progress="off")
    out = tmp_path / "oras-out"
    client = oras_client.OrasClient(hostname=registry.host, insecure=True)
    pulled = client.pull(target=ref, outdir=str(out))
    assert sorted(Path(p).relative_to(out).as_posix() for p in pulled) == sorted(_files(checkpoint))
    assert _files(out) == _files(checkpoint)
