"""``modelpack pull REF DIR`` holds a bounded amount of memory, whatever the
size of the model's files.

The bound: the pull's peak RSS (``VmHWM`` of the ``modelpack pull`` process) is at most the
interpreter baseline plus 64 MiB, where the baseline is the ``VmHWM`` of a ``python -c "import
modelpack.cli"`` child measured in the same test, on the same interpreter and environment. The
model has two safetensors files of more than 64 MiB each (about 160 MiB), so a pull that held a
whole file in memory, or buffered more than 64 MiB of one, fails. Each child records its own
``VmHWM`` from ``/proc/self/status`` at exit (atexit), so the number is exact and is the
child's alone (not the test process's high-water mark, which a fork would inherit).

An image-shaped pull (a modelcar: tar layers, files under
``models/``) of a ≥ 256 MiB model at the default 4 concurrent layers peaks at no more than
64 MiB in all — the interpreter included, as ``kserve-storage`` is measured (47 MiB here). Its
child is started through a small launcher, as ``test_audit_bounds`` does, so that nothing of
this large pytest process's memory can be counted.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from modelpack.api import transfer
from modelpack.testdata.synthetic import SyntheticSpec, write_checkpoint
from tests.fixtures.registry import RegistryServer

MiB = 1024 * 1024
RSS_BUDGET = 64 * MiB  # what a pull may hold above the interpreter with the CLI imported
IMAGE_PULL_RSS = 64 * MiB  # an image-shaped pull's whole peak, interpreter included

# Runs the command (or only the import) and writes the process's VmHWM, in bytes, to $HWM_OUT at exit.
_WRAPPER = """
import atexit, os, sys

def _hwm():
    with open("/proc/self/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    with open(os.environ["HWM_OUT"], "w") as out:
        out.write(str(kb * 1024))

atexit.register(_hwm)
import modelpack.cli
if len(sys.argv) > 1:
    sys.argv[0] = "modelpack"
    modelpack.cli.main()
"""


@pytest.fixture(autouse=True)
def _upload_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MODELPACK_UPLOAD_STATE_DIR", str(tmp_path / "upload-state"))


# a small process that starts the measured one: a child forked straight from pytest would start
# from pytest's own memory
_LAUNCH = "import subprocess, sys; sys.exit(subprocess.run(sys.argv[1:]).returncode)"


def _peak_rss(tmp_path: Path, name: str, *args: str) -> int:
    out = tmp_path / f"{name}.hwm"
    env = {**os.environ, "HWM_OUT": str(out)}
    r = subprocess.run(
        [sys.executable, "-c", _LAUNCH, sys.executable, "-c", _WRAPPER, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    return int(out.read_text())


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(4 * MiB):
            h.update(chunk)
    return h.hexdigest()


def test_pull_peak_rss_is_bounded_above_the_interpreter(registry: RegistryServer, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    write_checkpoint(str(ckpt), SyntheticSpec.for_size(320 * MiB, shards=2))
    shards = sorted(ckpt.glob("*.safetensors"))
    assert len(shards) == 2 and all(p.stat().st_size > RSS_BUDGET for p in shards)
    ref = registry.ref(f"pullrss/model-{tmp_path.name[-12:].lower()}", "v1")
    transfer.push(str(ckpt), ref, progress="off")

    baseline = _peak_rss(tmp_path, "baseline")
    dest = tmp_path / "pulled"
    peak = _peak_rss(tmp_path, "pull", "pull", ref, str(dest), "--progress", "off")

    for shard in shards:  # the pull did pull them: the bound is about a real transfer
        assert _sha256(dest / shard.name) == _sha256(shard)
    assert peak <= baseline + RSS_BUDGET, (
        f"pull peak RSS {peak / MiB:.1f} MiB > baseline {baseline / MiB:.1f} MiB + {RSS_BUDGET // MiB} MiB"
    )


def test_image_shaped_pull_peak_rss_is_at_most_64_mib(registry: RegistryServer, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text('{"model_type": "rss"}')
    expected = {}
    for i in range(4):  # incompressible: nothing in the path may shrink it
        data = os.urandom(64 * MiB)
        (ckpt / f"model-{i:05d}.bin").write_bytes(data)
        expected[f"model-{i:05d}.bin"] = hashlib.sha256(data).hexdigest()
        del data
    ref = registry.ref(f"pullrss/image-{tmp_path.name[-12:].lower()}", "v1")
    transfer.push(str(ckpt), ref, format="image", progress="off")

    dest = tmp_path / "pulled"
    peak = _peak_rss(tmp_path, "image-pull", "pull", ref, str(dest), "--progress", "off")

    for name, digest in expected.items():  # four layers at once (the default -j 4), every file whole
        assert _sha256(dest / name) == digest
    assert peak <= IMAGE_PULL_RSS, (
        f"image-shaped pull peak RSS {peak / MiB:.1f} MiB > {IMAGE_PULL_RSS // MiB} MiB"
    )
