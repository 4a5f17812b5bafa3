"""``make test`` hands its workers the longest test files first (``tests/fixtures/schedule.py``).

The order only balances the workers; what can go wrong is a table that stops describing the
suite (a renamed module, a new slow one missing, so it starts last) or a recorder that writes
something the sort cannot read.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.core.test_slow_marker import SLOW_MODULES
from tests.fixtures.schedule import TABLE, load_table, module_of
from tests.paths import REPO_ROOT

TESTS = REPO_ROOT / "tests"


def test_the_table_names_only_modules_that_exist_and_every_slow_one() -> None:
    table = load_table()
    modules = {p.relative_to(TESTS).as_posix() for p in TESTS.rglob("test_*.py")}
    assert set(table) <= modules, f"stale entries: {sorted(set(table) - modules)}"
    assert set(table) >= SLOW_MODULES, f"slow but unscheduled: {sorted(SLOW_MODULES - set(table))}"
    assert all(v >= 0 for v in table.values())


def test_module_of_maps_a_node_id_to_the_tables_key() -> None:
    assert module_of("tests/serving/test_vllm.py::test_x[a::b]") == "serving/test_vllm.py"
    assert module_of("tests/core/test_schedule.py") == "core/test_schedule.py"


def _suite(tmp_path: Path) -> Path:
    """Three test files under ``tests/`` of a scratch project: one slow, two quick."""
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_a_quick.py").write_text("def test_a():\n    assert True\n")
    (tests / "test_b_slow.py").write_text(
        "import time\n\ndef test_b():\n    time.sleep(0.3)\n    assert True\n"
    )
    (tests / "test_c_quick.py").write_text("def test_c():\n    assert True\n")
    return tests


def _pytest(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-o", "addopts=", "-p", "tests.fixtures.schedule",
         "-p", "no:cacheprovider", "--rootdir", str(tmp_path), *args],
        capture_output=True, text=True, timeout=120, cwd=REPO_ROOT,
    )  # fmt: skip


def test_the_recorder_writes_each_files_seconds_and_the_sort_starts_the_longest(tmp_path: Path) -> None:
    tests = _suite(tmp_path)
    out = tmp_path / "seconds.json"
    proc = _pytest(tmp_path, "-q", "--record-module-seconds", str(out), str(tests))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    recorded = json.loads(out.read_text())
    assert set(recorded) == {"test_a_quick.py", "test_b_slow.py", "test_c_quick.py"}, recorded
    assert recorded["test_b_slow.py"] >= 0.3 > recorded["test_a_quick.py"]
    assert next(iter(recorded)) == "test_b_slow.py"  # written longest first

    # the repository's table orders the collected items: a scratch suite is unknown to it, so
    # its order stays as collected; the repository's own suite starts with its longest module
    proc = _pytest(tmp_path, "--collect-only", "-q", str(tests))
    assert [line.split("::")[0].rsplit("/", 1)[-1] for line in proc.stdout.splitlines() if "::" in line] == [
        "test_a_quick.py",
        "test_b_slow.py",
        "test_c_quick.py",
    ], proc.stdout
    table = load_table(TABLE)
    longest = max(table, key=table.__getitem__)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-o", "addopts=", "--collect-only", "-q",
         str(TESTS / "core" / "test_schedule.py"), str(TESTS / longest)],
        capture_output=True, text=True, timeout=120, cwd=REPO_ROOT,
    )  # fmt: skip
    first = next(line for line in proc.stdout.splitlines() if "::" in line)
    assert module_of(first) == longest, proc.stdout[-2000:]
