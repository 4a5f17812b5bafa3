"""Concurrent pulls of different artifacts into one directory never exit 0 over a mix.

Twenty real ``modelpack pull`` processes, started together, pull one of two artifacts (same
paths, different bytes) into one DEST_DIR, with and without ``--force``. Before the fix 7 of 20
exited 0, printing their digest, while DEST held the other model or a mix of both. Now the
destination is locked for the whole pull (a bounded wait): pulls run one after the other, and
exit 0 means DEST holds exactly that artifact's files when the pull releases the lock.

Which pull wrote last is read from DEST itself, not from the order the processes exited: a pull
releases the lock, then prints and tears its interpreter down, and on a loaded machine the next
pull can finish whole before the previous process has exited. The files' change time is the last
rename; every pull that exited 0 after it is a candidate for the last writer (the last writer
is among them), and DEST must hold one candidate's artifact exactly.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.pull_dir_helpers import raw_layer, temp_entries, write_artifact

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MODELPACK = str(Path(sys.executable).with_name("modelpack"))
FILES = [f"model-0000{i}.bin" for i in range(4)]


def _artifact(layout: Path, tag: str, seed: int) -> dict[str, str]:
    files = {name: hashlib.sha256(f"{seed}:{name}".encode()).digest() * (8 * 1024) for name in FILES}
    write_artifact(layout, tag, [raw_layer(name, data) for name, data in files.items()])
    return {name: "sha256:" + hashlib.sha256(data).hexdigest() for name, data in files.items()}


def _contents(dest: Path) -> dict[str, str]:
    return {
        p.name: "sha256:" + hashlib.sha256(p.read_bytes()).hexdigest()
        for p in dest.iterdir()
        if p.is_file() and not p.name.startswith(".")
    }


@pytest.mark.parametrize("force", [True, False], ids=["force", "no-force"])
def test_twenty_racing_pulls_of_two_artifacts_into_one_directory(tmp_path: Path, force: bool) -> None:
    layout = tmp_path / "layout"
    truth = {"v1": _artifact(layout, "v1", 1), "v2": _artifact(layout, "v2", 2)}
    dest = tmp_path / "dest"
    env = {**os.environ, "CI": "1"}
    finished: list[tuple[float, str, int, str]] = []  # (when, tag, rc, stdout)
    lock = threading.Lock()

    def run(tag: str) -> None:
        cmd = [MODELPACK, "pull", f"oci:{layout}:{tag}", str(dest), "--json", *(["--force"] if force else [])]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
        with lock:
            finished.append((time.time(), tag, proc.returncode, proc.stdout))

    threads = [threading.Thread(target=run, args=("v1" if i % 2 else "v2",)) for i in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=280)
    assert not any(t.is_alive() for t in threads)
    assert len(finished) == 20
    ok = [f for f in finished if f[2] == 0]
    assert ok, finished
    # the last rename into DEST (the kernel's coarse clock is never ahead of time.time())
    last_rename = max(p.stat().st_ctime for p in dest.iterdir() if p.is_file())
    candidates = {tag for when, tag, _, _ in ok if when >= last_rename}
    assert candidates, (last_rename, sorted(f[:3] for f in finished))
    # no mix: DEST holds exactly the artifact of a pull that exited 0 after the last rename
    held = [tag for tag, files in truth.items() if _contents(dest) == files]
    assert held and held[0] in candidates, (held, candidates)
    assert all(f[2] in (0, 1) for f in finished), [f[2] for f in finished]
    if force:
        assert len(ok) == 20
    else:  # the first artifact to land wins; the other one's pulls are conflicts
        assert {f[1] for f in ok} == {held[0]}
    for _, _tag, _rc, out in ok:
        assert json.loads(out)["digest"]
    assert temp_entries(dest) == []
