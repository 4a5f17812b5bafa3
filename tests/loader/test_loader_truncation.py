"""A weight file that shrinks under a running load is refused with TruncatedSourceError, never SIGBUS.

The loader opens every file (and records its size) before it reads data. A second process then
truncates the file while column-split (dim-1) tensors are being gathered from it. Before the fix
the gather mapped each covering range by the size read at open: a truncation between the mapping
and the copy killed the process with SIGBUS (rc -7, no message, no event), one before the mapping
raised an untyped ``ValueError``. The load runs in a child process so that a SIGBUS shows as its
exit status instead of killing the test run.

``when=plan``: the file is cut after the readers opened it and before any data read. ``when=load``:
the consumer cuts it after the first tensor arrived, while the worker threads keep gathering the
next ones (the window is a few small tasks, so most tensors are read after the cut).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

CHILD = r"""
import json, subprocess, sys
from modelpack.loader import LoaderOptions, iter_tensors
from modelpack.errors import TruncatedSourceError

directory, path, cut, staged, when = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1", sys.argv[5]
if sys.argv[6] == "preadv":
    import modelpack.loader.gather as gather
    gather._vm_readv = False  # as where seccomp refuses process_vm_readv: one preadv per row

def truncate_now(*_):
    subprocess.run(["truncate", "-s", str(cut), path], check=True)  # a second process shrinks it

opts = LoaderOptions(direct_io=staged, workers=2, piece_bytes=64 << 10, batch_bytes=64 << 10,
                     slot_bytes=64 << 10, slots=3)
got = []
try:
    it = iter_tensors(directory, tp_size=2, tp_rank=1, allow_unverified=True, options=opts,
                      on_plan=truncate_now if when == "plan" else None)
    for name, t in it:
        got.append(name)
        if when == "load" and len(got) == 1:
            truncate_now()
except TruncatedSourceError as exc:
    print(json.dumps({"error": "TruncatedSourceError", "message": str(exc), "got": got}))
    sys.exit(0)
print(json.dumps({"error": None, "got": got}))
"""

LAYERS = 8


def _checkpoint(tmp_path: Path) -> tuple[Path, Path, int]:
    d = tmp_path / "model"
    d.mkdir()
    g = torch.Generator().manual_seed(7)
    tensors = {
        f"model.layers.{i}.self_attn.o_proj.weight": torch.randn(512, 1024, generator=g)  # dim1, 2 MiB
        for i in range(LAYERS)
    }
    path = d / "model.safetensors"
    save_file(tensors, str(path))
    return d, path, path.stat().st_size // 4  # the cut falls inside layer 2 of 8


@pytest.mark.host_copier  # the load runs in a child process
@pytest.mark.parametrize("copy", ["kernel", "preadv"])
@pytest.mark.parametrize("when", ["plan", "load"])
@pytest.mark.parametrize("staged", [False, True], ids=["direct", "staged"])
def test_file_truncated_during_a_column_gather_is_refused_not_sigbus(
    tmp_path: Path, staged: bool, when: str, copy: str
) -> None:
    directory, path, cut = _checkpoint(tmp_path)
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            CHILD,
            str(directory),
            str(path),
            str(cut),
            "1" if staged else "0",
            when,
            copy,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, f"loader died (rc {proc.returncode}): {proc.stderr[-2000:]}"
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["error"] == "TruncatedSourceError", result
    assert str(path) in result["message"]
    assert len(result["got"]) < LAYERS  # the tensors past the cut were never handed out
    assert path.stat().st_size == cut  # the second process really shrank it under the load


@pytest.mark.parametrize("copy", ["kernel", "preadv"])
def test_column_gather_equals_safetensors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, copy: str) -> None:
    import modelpack.loader.gather as gather
    from modelpack.loader import load_state_dict
    from safetensors.torch import load_file

    directory, path, _ = _checkpoint(tmp_path)
    if copy == "preadv":
        monkeypatch.setattr(gather, "_vm_readv", False)
    ref = load_file(str(path))
    for rank in range(2):
        sd = load_state_dict(directory, tp_size=2, tp_rank=rank, allow_unverified=True)
        assert set(sd) == set(ref)
        for name, t in sd.items():
            assert torch.equal(t, torch.chunk(ref[name], 2, 1)[rank]), name
