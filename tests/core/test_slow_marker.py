"""The quick loop (``pytest -m "not slow"``) leaves out the long end-to-end modules, and only them.

``make test`` runs everything; the marker only lets a developer skip what takes minutes (vLLM
engines, torch.compile, the storm harness, containerd, the installed wheel, real-process outages,
kill-at-every-syscall loops, a 2 GiB load) or was measured at tens of seconds a test. Modules are
marked with a module-level ``pytestmark`` so a new test in one of them is slow too. This list is the one place that says
which modules are slow: marking or unmarking a module without changing it fails here, so the
marker cannot silently drop to zero.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.paths import REPO_ROOT

TESTS = REPO_ROOT / "tests"

SLOW_MODULES = {
    # vLLM engines (tests/vllm_helpers.py)
    "serving/test_vllm.py",
    "serving/test_vllm_assets.py",
    "serving/test_variants_vllm.py",
    "serving/test_vllm_tp2.py",
    "serving/test_adapters_vllm.py",
    "serving/test_origin_down_vllm.py",
    # a benchmark end to end at its smoke size (8 gloo rank processes per row)
    "loader/test_seed_shape_script.py",
    # a cold torch.compile per process
    "assets/test_assets.py",
    # whole systems: network namespaces, containerd, a built wheel in a fresh venv, real outages,
    # independent clients from their own venvs and node
    "e2e/test_storm.py",
    "e2e/test_interop_containerd.py",
    "e2e/test_installed_package.py",
    "e2e/test_release.py",
    "e2e/test_podman_kube.py",
    "e2e/test_e2e_llama.py",
    "e2e/test_origin_down.py",
    "e2e/test_interop_clients.py",
    "e2e/test_interop_sigstore_js.py",
    # a 2 GiB model per subprocess; a process killed at every filesystem mutation
    "loader/test_loader_memory.py",
    "mount/test_cache_repair_kill.py",
    "mount/test_cache_create_kill.py",
    # measured at 15-50 s a test on 2 cores: CI jobs run as written, endless catalogs and tag
    # lists cut at their bounds, twenty racing pulls into one directory, a second uid's attacks
    # on a shared cache (about 3 minutes for the module)
    "e2e/test_examples.py",
    "inspection/test_audit_bounds.py",
    "transfer/test_pull_dest_lock.py",
    "mount/test_cache_shared_host.py",
}


def _module_marks_slow(path: Path) -> bool:
    """Whether the module's ``pytestmark`` holds ``pytest.mark.slow``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets
        ):
            return any(
                isinstance(n, ast.Attribute)
                and n.attr == "slow"
                and isinstance(n.value, ast.Attribute)
                and n.value.attr == "mark"
                for n in ast.walk(node.value)
            )
    return False


def _imports(path: Path, module: str) -> bool:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return any(
        (isinstance(n, ast.ImportFrom) and n.module == module)
        or (isinstance(n, ast.Import) and any(a.name == module for a in n.names))
        for n in ast.walk(tree)
    )


def _test_modules() -> list[Path]:
    return sorted(TESTS.rglob("test_*.py"))


def test_exactly_the_listed_modules_are_marked_slow() -> None:
    """The modules marked slow are the list above: none lost its mark, none gained one unlisted."""
    marked = {p.relative_to(TESTS).as_posix() for p in _test_modules() if _module_marks_slow(p)}
    assert marked == SLOW_MODULES, (
        f"marked but not listed: {sorted(marked - SLOW_MODULES)}; "
        f"listed but not marked: {sorted(SLOW_MODULES - marked)}"
    )


def test_every_module_that_starts_vllm_is_marked_slow() -> None:
    """A test module using the vLLM helpers starts engines (minutes each): it must be slow."""
    users = [p for p in _test_modules() if _imports(p, "tests.vllm_helpers")]
    assert len(users) >= 6  # the TP=2 starts of three modules live in test_vllm_tp2.py
    unmarked = [p.relative_to(TESTS).as_posix() for p in users if not _module_marks_slow(p)]
    assert unmarked == []


def test_the_slow_marker_is_registered(pytestconfig: pytest.Config) -> None:
    """``slow`` is a declared marker, so ``-m "not slow"`` and ``--strict-markers`` know it."""
    assert any(m.split(":")[0].strip() == "slow" for m in pytestconfig.getini("markers"))
