"""SIGTERM cleans up like Ctrl-C in every command; SIGKILL leftovers are swept.

A CI timeout and a pod stop send SIGTERM first. Before the fix, ``push --max-file-size``,
``push --format image`` and ``assets push`` killed so left their model-sized staging (22–30 MiB)
in ``$TMPDIR``, and nothing ever removed it (SIGINT did clean up). Each case here is a real
``modelpack`` process pushing through a slow FaultProxy to a real registry, signalled once its
staging exists and its upload has started.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from modelpack.testdata.synthetic import SyntheticSpec, write_checkpoint
from tests.fixtures.faultproxy import FaultProxy
from tests.fixtures.registry import RegistryServer
from tests.mount.test_cache_support import push_model

pytestmark = pytest.mark.timeout(240)

MODELPACK = str(Path(sys.executable).with_name("modelpack"))


def _leftovers(tmpdir: Path) -> list[str]:
    """What packing or an asset push may leave in $TMPDIR (staging dirs, temp files)."""
    return sorted(
        str(p.relative_to(tmpdir))
        for p in tmpdir.rglob("*")
        if p.name.startswith((".modelpack-", ".tmp-modelpack-"))
    )


def _checkpoint(tmp_path: Path) -> Path:
    ckpt = tmp_path / "ckpt"  # ~8 MiB in one shard: re-sharded at 1 MiB
    write_checkpoint(str(ckpt), SyntheticSpec(hidden=512, intermediate=1376, layers=4, vocab=4096, shards=1))
    return ckpt


def _start(args: list[str], tmpdir: Path) -> subprocess.Popen[str]:
    tmpdir.mkdir(exist_ok=True)
    env = {**os.environ, "TMPDIR": str(tmpdir), "CI": "1"}
    env.pop("MODELPACK_STAGING_DIR", None)
    return subprocess.Popen(
        [MODELPACK, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _wait_uploading(proc: subprocess.Popen[str], proxy: FaultProxy, tmpdir: Path) -> None:
    """Until staging exists under ``tmpdir`` and a blob upload has reached the proxy."""
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        # an upload session opened (POST): the proxy logs a monolithic PUT only once it is through
        uploading = any(
            m in ("POST", "PATCH", "PUT") and "/blobs/uploads/" in p for _, m, p, _ in list(proxy.log)
        )
        if uploading and _leftovers(tmpdir):
            return
        time.sleep(0.02)
    raise AssertionError("the push never started uploading")


CASES = {
    "push --max-file-size": ["push", "{ckpt}", "{proxy}/sig/reshard:v1", "--max-file-size", "1MiB"],
    "push --format image": ["push", "{ckpt}", "{proxy}/sig/image:v1", "--format", "image"],
    "assets push": ["assets", "push", "{proxy}/sig/model:v1", "{cache}", "--kind", "inductor"],
}


PARAMS = [(case, signal.SIGTERM) for case in CASES] + [(case, signal.SIGKILL) for case in CASES]


@pytest.mark.parametrize(("case", "sig"), PARAMS, ids=[f"{c}-{s.name}" for c, s in PARAMS])
def test_a_signalled_push_leaves_no_staging_behind(
    registry: RegistryServer, tmp_path: Path, case: str, sig: signal.Signals
) -> None:
    ckpt = _checkpoint(tmp_path)
    cache = tmp_path / "inductor-cache"
    if case == "assets push":
        push_model(ckpt, registry.host, "sig/model")
        cache.mkdir()
        for i in range(3):
            (cache / f"kernel-{i}.so").write_bytes(os.urandom(8 << 20))
    proxy = FaultProxy(registry.host, rate=2 * 1024 * 1024)  # seconds per blob
    tmpdir = tmp_path / "tmp"
    try:
        args = [a.format(ckpt=ckpt, proxy=proxy.host, cache=cache) for a in CASES[case]]
        proc = _start(args, tmpdir)
        _wait_uploading(proc, proxy, tmpdir)
        proc.send_signal(sig)
        _out, err = proc.communicate(timeout=60)
    finally:
        proxy.close()
    if sig == signal.SIGTERM:
        assert proc.returncode == 128 + signal.SIGTERM, (proc.returncode, err)
        assert "interrupted by SIGTERM" in err and "Traceback" not in err, err
        assert _leftovers(tmpdir) == []
        return
    # SIGKILL: nothing can clean up in the process; the next run sweeps what it left
    assert proc.returncode == -signal.SIGKILL
    assert _leftovers(tmpdir), "a killed push had staging to leave"
    time.sleep(2.5)  # staging younger than 2 s is never swept (its owner may not hold it yet)
    # the rerun pushes elsewhere (an asset push: for the same model, straight to the registry)
    again_ref = registry.ref("sig/model" if case == "assets push" else "sig/again", "v1")
    again = _start([*args[:2], again_ref, *args[3:]], tmpdir)
    _, err = again.communicate(timeout=120)
    assert again.returncode == 0, err
    assert _leftovers(tmpdir) == []
