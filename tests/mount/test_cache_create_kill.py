"""A process killed while it first creates a node cache leaves nothing a reader rejects.

Real parts: a real child process creates the cache (``NodeCache``) and is killed (``os._exit``)
at its Nth filesystem change — every directory, file creation and rename in turn — then the
CLI (in this process) inspects what it left. What is checked: at every kill point ``cache verify``,
``cache ls`` and ``cache gc --dry-run`` either find no cache yet (nothing marked it as one) or
accept it, and the next run completes it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from modelpack.cli import main

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

_CHILD = r"""
import os, sys
n, count = int(sys.argv[2]), [0]

def step():
    count[0] += 1
    if count[0] == n:
        os._exit(9)

def wrapped(real):
    def call(*args, **kwargs):
        step()
        return real(*args, **kwargs)
    return call

for name in ("mkdir", "rename", "replace", "link", "symlink"):
    setattr(os, name, wrapped(getattr(os, name)))
real_open = os.open

def creating_open(path, flags, *args, **kwargs):
    if flags & os.O_CREAT:
        step()
    return real_open(path, flags, *args, **kwargs)

os.open = creating_open
from modelpack.mount.cache import NodeCache
NodeCache(sys.argv[1])
print(count[0])
"""


def _reader_ok(root: Path, *argv: str) -> tuple[bool, str]:
    """Run a reading ``cache`` command in this process: accepted, or no cache there yet."""
    res = CliRunner().invoke(main, ["cache", *argv, "--cache", str(root)])
    return res.exit_code == 0 or "no node cache here" in res.output, res.output


def test_a_kill_at_any_step_of_cache_creation_leaves_a_cache_readers_accept(tmp_path: Path) -> None:
    """Kill the creating process at each filesystem change in turn: every reader either sees
    no cache yet or accepts the one it finds, never a half-made one it rejects."""
    steps = int(
        subprocess.run(
            [sys.executable, "-c", _CHILD, str(tmp_path / "whole"), "0"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    assert steps > 5
    for n in range(1, steps + 1):
        root = tmp_path / f"c{n}"
        killed = subprocess.run(
            [sys.executable, "-c", _CHILD, str(root), str(n)], capture_output=True, text=True
        )
        assert killed.returncode == 9, killed.stderr
        for argv in (("verify",), ("ls",), ("gc", "--dry-run")):
            ok, err = _reader_ok(root, *argv)
            assert ok, (n, argv, err)
