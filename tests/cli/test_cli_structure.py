"""The CLI's shape: a lazily loading group, no cycle through ``modelpack.cli``, a light cache hit.

A node runs ``modelpack pull REF@sha256:… --cache DIR`` on every pod start; on a hit the work
takes milliseconds, so what the process imports decides how long the pod waits. These tests
run the real command in a fresh interpreter and look at what it loaded.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import click
import pytest

from modelpack.cli import COMMANDS, main
from modelpack.cli.lazy_group import LazyGroup
from modelpack.testdata.synthetic import SyntheticSpec, write_checkpoint
from tests.paths import REPO_ROOT

CLI_DIR = REPO_ROOT / "modelpack" / "cli"
# what the cache-hit path must not import (each costs tens to hundreds of milliseconds)
HEAVY = (
    "torch",
    "numpy",
    "boto3",
    "botocore",
    "kubernetes",
    "requests",
    "urllib3",
    "docker",
    "cryptography",
    "tqdm",
    "yaml",
    "safetensors",
    "zstandard",
)

pytestmark = pytest.mark.timeout(180)


def _modules_after(argv: list[str], columns: int | None = None) -> tuple[int, str, list[str]]:
    """Run ``modelpack ARGV`` in a fresh interpreter (``columns``: the terminal width it sees);
    its exit code, stdout and loaded modules."""
    code = (
        "import json, sys\n"
        "from modelpack.cli import main\n"
        "try:\n"
        "    main(sys.argv[1:], prog_name='modelpack')\n"
        "except SystemExit as exc:\n"
        "    rc = exc.code or 0\n"
        "print('\\n' + json.dumps({'rc': rc, 'modules': sorted(sys.modules)}))\n"
    )
    env = {**os.environ, "COLUMNS": str(columns)} if columns else None
    proc = subprocess.run(
        [sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 0, proc.stderr
    out, _, last = proc.stdout.rstrip("\n").rpartition("\n")
    doc = json.loads(last)
    return doc["rc"], out, doc["modules"]


def test_every_lazy_command_resolves_and_its_table_help_is_its_own() -> None:
    ctx = click.Context(main)
    for name, entry in COMMANDS.items():
        command = main.get_command(ctx, name)
        assert isinstance(command, click.Command), name
        assert command.name == name, f"{entry.target} is named {command.name!r}, listed as {name!r}"
        assert entry.short_help == command.get_short_help_str(limit=10_000), (
            f"COMMANDS[{name!r}] help drifted from {entry.target}'s docstring"
        )
    assert main.get_command(ctx, "no-such-command") is None


def test_every_lazy_subcommand_resolves_and_its_table_help_is_its_own() -> None:
    """A group's lazily imported subcommands (``cache serve``, ``cache lora-args``) resolve to
    commands of that name whose help is the table's."""
    ctx = click.Context(main)
    groups = [main.get_command(ctx, name) for name in COMMANDS]
    lazy = [g for g in groups if isinstance(g, LazyGroup) and g.lazy_commands]
    assert lazy, "no group has lazy subcommands"
    for group in lazy:
        for name, entry in group.lazy_commands.items():
            command = group.load(name)
            assert command.name == name, f"{entry.target} is named {command.name!r}, listed as {name!r}"
            assert entry.short_help == command.get_short_help_str(limit=10_000), entry.target


def test_group_help_lists_every_command_and_imports_none() -> None:
    # 110 columns (the group's max_content_width): 80 truncates every table help once a command
    # name is as long as storage-initializer
    rc, out, modules = _modules_after(["--help"], columns=110)
    assert rc == 0
    listed = out.split("Commands:", 1)[1]
    for name in COMMANDS:
        assert f"\n  {name} " in listed, name
    assert "Pack CHECKPOINT_DIR into a ModelPack artifact at DESTINATION." in listed
    loaded = sorted(m for m in modules if m.startswith("modelpack.cli."))
    assert loaded == ["modelpack.cli.failures", "modelpack.cli.lazy_group", "modelpack.cli.options"]
    assert not [m for m in modules if m.split(".")[0] in HEAVY]


def test_unknown_command_is_a_usage_error() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "modelpack.cli", "pul"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2 and "No such command 'pul'" in proc.stderr


def test_command_modules_do_not_import_the_group() -> None:
    """Command modules register nowhere: ``COMMANDS`` names them, so ``modelpack.cli`` (the
    package holding ``main``) is never imported by them, and no cycle runs through it."""
    for path in sorted(CLI_DIR.glob("*.py")):
        if path.name in ("__init__.py", "__main__.py"):
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                assert node.module != "modelpack.cli", f"{path.name}:{node.lineno} imports modelpack.cli"
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
                assert "modelpack.cli" not in names, f"{path.name}:{node.lineno} imports modelpack.cli"


def test_every_cli_module_states_its_job() -> None:
    for path in sorted(CLI_DIR.glob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text()))
        assert doc and doc.splitlines()[0].strip(), f"{path.name} has no docstring stating its job"


def test_pull_cache_hit_by_registry_digest_imports_nothing_heavy(registry, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from modelpack import api

    ckpt = tmp_path / "ckpt"
    write_checkpoint(str(ckpt), SyntheticSpec(shards=3))
    ref = registry.ref("cli/light", "v1")
    digest = str(api.push(str(ckpt), ref).digest)
    pinned = f"{ref.rsplit(':', 1)[0]}@{digest}"
    cache = str(tmp_path / "cache")
    cold = subprocess.run(
        [sys.executable, "-m", "modelpack.cli", "pull", pinned, "--cache", cache, "--plain-http"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert cold.returncode == 0 and cold.stderr.startswith("cold:"), cold.stderr

    rc, out, modules = _modules_after(["pull", pinned, "--cache", cache, "--plain-http"])
    assert rc == 0 and out.strip().endswith(digest.removeprefix("sha256:"))
    heavy = sorted(m for m in modules if m.split(".")[0] in HEAVY)
    assert not heavy, f"a cache hit imported {heavy}"
    commands = sorted(m for m in modules if m.startswith("modelpack.cli."))
    assert commands == [
        "modelpack.cli.cache",
        "modelpack.cli.failures",
        "modelpack.cli.lazy_group",
        "modelpack.cli.options",
        "modelpack.cli.pull",
        # --key/--policy are read on the hit too (no key, no policy: nothing of signing imported)
        "modelpack.cli.trust_options",
    ]
