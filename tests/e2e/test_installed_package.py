"""What a user installs: the wheel and the sdist built from this tree, used from a fresh venv.

Every other test runs the editable tree, which maps the source folders straight into the
``modelpack`` namespace and so cannot notice a package the wheel leaves out (``modelpack.assets``
once was) or a dependency pyproject.toml forgets to declare. Here the wheel is installed as the
README says (``pip install torch==2.13.0`` and ``pip install 'modelpack-oci[loader,s3,image,k8s]'``)
into a venv that sees nothing of the checkout, and used from a directory outside it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from safetensors import safe_open

from modelpack._version import __version__
from modelpack.testdata.synthetic import SyntheticSpec, write_checkpoint
from tests.e2e.conftest import ReleaseDist
from tests.fixtures.registry import RegistryServer
from tests.paths import REPO_ROOT

ROOT = REPO_ROOT
DEV_PYTHON = Path(sys.executable)
# folder in the repository → the import name setup.py installs it as
SOURCE_FOLDERS = {
    "modelpack": "modelpack",
    "mediatypes": "modelpack/mediatypes",
    "signing": "modelpack/signing",
    "mount": "modelpack/mount",
    "loader": "modelpack/loader",
}
# modules that import an engine the `vllm` extra brings (not installed here); nothing else may fail
NEEDS_VLLM = {"modelpack.serving.vllm_loader", "modelpack.serving.vllm_plugin"}
EXTRAS = "loader,s3,image,k8s"
# pip as the README runs it, less the byte-compiling of every installed module (torch, botocore,
# kubernetes, transformers: most of the install's CPU time); the modules a test imports are
# compiled on first import instead, which runs the same code
PIP = ("-m", "pip", "install", "-q", "--no-compile")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _run(argv: list[str | Path], **kwargs: object) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([str(a) for a in argv], capture_output=True, text=True, **kwargs)  # type: ignore[call-overload]
    assert proc.returncode == 0, f"{argv}: rc {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def _clean_env(**extra: str) -> dict[str, str]:
    """The environment minus anything that would put the checkout or the dev venv on sys.path,
    and minus ``PYTHONDONTWRITEBYTECODE``: as on a user's machine, the first import of a module
    of the fresh venv writes its bytecode (pip installs there with ``--no-compile``, ``PIP``)."""
    dropped = ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME", "PYTHONDONTWRITEBYTECODE")
    env = {k: v for k, v in os.environ.items() if k not in dropped}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if str(ROOT) not in p)
    env.update(extra)
    return env


def _build(source: Path, out: Path, *kinds: str) -> None:
    # no isolation: the dev venv has setuptools and build (test extra); an isolated build would
    # fetch setuptools each time
    _run([DEV_PYTHON, "-m", "build", "--no-isolation", *kinds, "--outdir", out, source], cwd=out.parent)


def _wheel_files(wheel: Path) -> dict[str, str]:
    """name → sha256 of every file in a wheel except its RECORD (which lists the others)."""
    with zipfile.ZipFile(wheel) as zf:
        return {
            n: hashlib.sha256(zf.read(n)).hexdigest()
            for n in zf.namelist()
            if not n.endswith("/") and not n.endswith(".dist-info/RECORD")
        }


class Built:
    def __init__(self, wheel: Path, sdist: Path, wheel_from_sdist: Path) -> None:
        self.wheel, self.sdist, self.wheel_from_sdist = wheel, sdist, wheel_from_sdist


@pytest.fixture(scope="module")
def built(release_dist: ReleaseDist, tmp_path_factory: pytest.TempPathFactory) -> Built:
    """The wheel and sdist of `make dist` (built once per session, tests/e2e/conftest.py), and a
    wheel built again from that sdist."""
    work = tmp_path_factory.mktemp("build")
    _build(
        release_dist.sdist, work / "from-sdist", "--wheel"
    )  # an sdist path is unpacked and built by `build`
    (wheel2,) = (work / "from-sdist").glob("*.whl")
    return Built(release_dist.wheel, release_dist.sdist, wheel2)


class Venv:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.python = path / "bin" / "python"
        self.modelpack = path / "bin" / "modelpack"


@pytest.fixture(scope="module")
def venv(built: Built, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Venv]:
    home = tmp_path_factory.mktemp("fresh-venv")
    v = Venv(home / "venv")
    env = _clean_env()
    _run([sys.base_prefix + "/bin/python3", "-m", "venv", v.path], env=env, cwd=home)
    _run([v.python, *PIP, "torch==2.13.0"], env=env, cwd=home)
    _run([v.python, *PIP, f"{built.wheel}[{EXTRAS}]"], env=env, cwd=home)
    yield v
    shutil.rmtree(home, ignore_errors=True)


def test_the_wheel_holds_every_module_of_the_source_folders_and_nothing_else(built: Built) -> None:
    names = set(_wheel_files(built.wheel))
    expected = set()
    for folder, installed in SOURCE_FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            if "__pycache__" in path.parts:
                continue
            expected.add(f"{installed}/{path.relative_to(ROOT / folder).as_posix()}")
    missing = sorted(expected - names)
    assert not missing, f"the wheel lacks {missing}"
    assert "modelpack/py.typed" in names and "modelpack/mediatypes/config-schema.json" in names
    assert {
        "modelpack/cli/schemas/pull.json",
        "modelpack/cli/schemas/cache-gc.json",
    } <= names  # --json contracts
    top = {n.split("/", 1)[0] for n in names}
    assert top == {"modelpack", f"modelpack_oci-{__version__}.dist-info"}, (
        top
    )  # no tests/, benchmarks/, mount/


def test_the_sdist_builds_a_wheel_with_the_same_files(built: Built) -> None:
    assert _wheel_files(built.wheel_from_sdist) == _wheel_files(built.wheel)


def test_every_module_imports_from_the_installed_wheel(venv: Venv, tmp_path: Path) -> None:
    script = """
import importlib, json, pkgutil, sys
import modelpack
assert "site-packages" in modelpack.__file__, modelpack.__file__
failed = {}
names = []
for info in pkgutil.walk_packages(modelpack.__path__, "modelpack."):
    names.append(info.name)
    if info.name.endswith(".__main__"):  # runs the CLI when imported; the help test runs it
        continue
    try:
        importlib.import_module(info.name)
    except Exception as e:  # noqa: BLE001 - reported to the test
        failed[info.name] = f"{type(e).__name__}: {e}"
print(json.dumps({"file": modelpack.__file__, "path": list(modelpack.__path__), "names": names, "failed": failed}))
"""
    out = json.loads(_run([venv.python, "-c", script], env=_clean_env(), cwd=tmp_path).stdout)
    assert all(str(ROOT) not in p for p in out["path"]), out["path"]
    assert {"modelpack.assets.pull", "modelpack.mount.store", "modelpack.loader.plan"} <= set(out["names"])
    assert not [n for n in out["names"] if n.startswith(("modelpack.tests", "modelpack.benchmarks"))]
    unexpected = {n: e for n, e in out["failed"].items() if not (n in NEEDS_VLLM and "vllm" in e)}
    assert not unexpected, unexpected


def test_every_command_shows_its_help_from_the_installed_wheel(venv: Venv, tmp_path: Path) -> None:
    walker = """
import json, click
from click.testing import CliRunner
from modelpack.cli import main
paths, failures = [], {}
def walk(cmd, path):
    paths.append(path)
    result = CliRunner().invoke(main, [*path, "--help"])
    if result.exit_code != 0 or "Usage:" not in result.output:
        failures[" ".join(path)] = (result.output + repr(result.exception))[-500:]
    if isinstance(cmd, click.Group):
        ctx = click.Context(cmd)
        for name in cmd.list_commands(ctx):
            walk(cmd.get_command(ctx, name), [*path, name])
walk(main, [])
print(json.dumps({"paths": [" ".join(p) for p in paths], "failures": failures}))
"""
    out = json.loads(_run([venv.python, "-c", walker], env=_clean_env(), cwd=tmp_path).stdout)
    assert not out["failures"], out["failures"]
    assert {"pack", "push", "pull", "assets", "assets pull", "cache gc", "load"} <= set(out["paths"])
    # and through the console script pip wrote, as a user types it
    for group in ([], ["assets"], ["cache"]):
        proc = _run([venv.modelpack, *group, "--help"], env=_clean_env(), cwd=tmp_path)
        assert "Usage: modelpack" in proc.stdout


def test_pack_push_pull_load_verify_from_the_installed_wheel(
    venv: Venv, registry: RegistryServer, tmp_path: Path
) -> None:
    env = _clean_env(
        MODELPACK_UPLOAD_STATE_DIR=str(tmp_path / "upload-state"), HOME=str(tmp_path / "home"), CI="1"
    )
    mp = [venv.modelpack]
    ckpt = tmp_path / "ckpt"
    write_checkpoint(str(ckpt), SyntheticSpec(shards=2))
    layout = tmp_path / "layout"
    ref = registry.ref("installed/wheel", "v1")
    _run([*mp, "keygen", "--out", tmp_path / "ci"], env=env, cwd=tmp_path)
    _run([*mp, "pack", ckpt, f"oci:{layout}:v1"], env=env, cwd=tmp_path)
    pushed = _run(
        [*mp, "push", f"oci:{layout}:v1", ref, "--sign-key", tmp_path / "ci.key"], env=env, cwd=tmp_path
    )
    digest = pushed.stdout.strip().splitlines()[-1]
    assert digest.startswith("sha256:") and len(digest) == 71, pushed.stdout
    pinned = f"{ref.rsplit(':', 1)[0]}@{digest}"
    cache = tmp_path / "cache"
    pulled = _run(
        [*mp, "pull", pinned, "--cache", cache, "--key", tmp_path / "ci.pub", "--json"], env=env, cwd=tmp_path
    )
    pull = json.loads(pulled.stdout)
    snapshot = Path(pull["path"])
    assert pull["digest"] == digest and pull["signature"] == "verified", pull
    assert snapshot.is_dir() and snapshot.is_relative_to(cache), pull
    loaded = json.loads(
        _run([*mp, "load", snapshot, "--expected-digest", digest, "--json"], env=env, cwd=tmp_path).stdout
    )
    shards = sorted(ckpt.glob("*.safetensors"))
    tensors = 0
    for shard in shards:
        with safe_open(str(shard), framework="numpy") as f:
            tensors += len(list(f.keys()))
    assert loaded["state"] == "hit" and loaded["digest"] == digest, loaded
    assert loaded["tensors"] == tensors, loaded
    assert 0 < loaded["bytesRead"] <= sum(p.stat().st_size for p in shards), loaded
    verified = _run([*mp, "verify", ref, "--key", tmp_path / "ci.pub", "--json"], env=env, cwd=tmp_path)
    assert digest in verified.stdout, verified.stdout


def test_no_module_of_the_installed_package_is_in_an_import_cycle(built: Built, tmp_path: Path) -> None:
    """import-linter's sibling contract misses a package and its own child importing each other
    (``modelpack.api`` ↔ ``modelpack.api.transfer`` once did): any cycle at all, found with grimp
    (import-linter's graph) over the unpacked wheel, lazy imports included."""
    with zipfile.ZipFile(built.wheel) as zf:
        zf.extractall(tmp_path / "installed")
    script = """
import json, sys
import grimp
graph = grimp.build_graph("modelpack", cache_dir=None)
index, low, stack, on_stack, cycles = {}, {}, [], set(), []
sys.setrecursionlimit(20000)
def visit(v):
    index[v] = low[v] = len(index); stack.append(v); on_stack.add(v)
    for w in graph.find_modules_directly_imported_by(v):
        if w not in index:
            visit(w); low[v] = min(low[v], low[w])
        elif w in on_stack:
            low[v] = min(low[v], index[w])
    if low[v] == index[v]:
        component = []
        while True:
            w = stack.pop(); on_stack.discard(w); component.append(w)
            if w == v:
                break
        if len(component) > 1:
            cycles.append(sorted(component))
for module in sorted(graph.modules):
    if module not in index:
        visit(module)
assert graph.find_modules_directly_imported_by("modelpack.api"), "graph is empty: wrong package found"
print(json.dumps(cycles))
"""
    env = _clean_env(PYTHONPATH=str(tmp_path / "installed"))
    cycles = json.loads(_run([DEV_PYTHON, "-c", script], env=env, cwd=tmp_path).stdout)
    assert cycles == [], cycles


def test_the_installed_command_and_package_print_the_release_version(venv: Venv, tmp_path: Path) -> None:
    proc = _run([venv.modelpack, "--version"], env=_clean_env(), cwd=tmp_path)
    assert proc.stdout == f"modelpack, version {__version__}\n", proc.stdout
    script = (
        "import modelpack, importlib.metadata as m; print(modelpack.__version__, m.version('modelpack-oci'))"
    )
    proc = _run([venv.python, "-c", script], env=_clean_env(), cwd=tmp_path)
    assert proc.stdout.split() == [__version__, __version__]


def test_the_demo_runs_from_the_installed_wheel_as_the_readme_says(
    venv: Venv, built: Built, tmp_path: Path
) -> None:
    """A pip user's demo: the `demo` extra on top of the install above, then `python -m
    modelpack.demo`, from a folder outside the checkout (no tests/ or examples/ on the path)."""
    readme = (ROOT / "README.md").read_text()
    install = "pip install 'modelpack-oci[demo]'"
    command = "python -m modelpack.demo --out /tmp/modelpack-demo"
    assert install in readme and command in readme
    env = _clean_env(HOME=str(tmp_path / "home"), CI="1")
    _run([venv.python, *PIP, f"{built.wheel}[demo]"], env=env, cwd=tmp_path)
    out = tmp_path / "modelpack-demo"
    proc = _run([venv.python, "-m", "modelpack.demo", "--out", out], env=env, cwd=tmp_path)
    assert proc.stdout.count("logits identical: True") == 3, proc.stdout[-3000:]  # cache miss, hit, stream
    assert re.search(r"demo finished in [0-9.]+ s; artifact sha256:[0-9a-f]{64}", proc.stdout), proc.stdout[
        -500:
    ]
    assert (out / "events.jsonl").is_file() and (out / "cache").is_dir()
