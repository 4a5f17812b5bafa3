"""Every ``MODELPACK_*`` setting is read in one module, and every entry point builds its
connection options from it: the vLLM load format, the KServe initializer and the CLI obey the
same environment, an empty protective setting fails closed, and no entry point mutates the
process environment."""

from __future__ import annotations

import base64
import json
import os
import re
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from modelpack.errors import ModelpackError
from tests.fixtures.registry import RegistryServer
from tests.paths import REPO_ROOT

ROOT = REPO_ROOT


class SilentServer:
    """A loopback TCP server that accepts every connection and never answers a byte."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.accepted: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted.append(conn)

    def close(self) -> None:
        self.sock.close()
        for conn in self.accepted:
            conn.close()


@pytest.fixture
def silent() -> Iterator[SilentServer]:
    server = SilentServer()
    yield server
    server.close()


def test_the_vllm_load_format_obeys_modelpack_timeout(silent: SilentServer, tmp_path: Path) -> None:
    """A registry that accepts and never answers: with MODELPACK_TIMEOUT=2 and MODELPACK_RETRY_FOR=0
    in the environment the load format's start is refused within seconds, as the CLI's would be."""
    from modelpack.serving.weights import open_rank_load

    source = f"127.0.0.1:{silent.port}/models/m@sha256:{'a' * 64}"
    env = {
        "MODELPACK_TIMEOUT": "2",
        "MODELPACK_RETRY_FOR": "0",
        "MODELPACK_HOSTS_DIR": str(tmp_path / "none"),
    }
    outcome: dict[str, object] = {}

    def start() -> None:
        t0 = time.monotonic()
        try:
            open_rank_load({"source": source, "plain_http": True}, str(tmp_path), {}, 1, 0, environ=env)
        except BaseException as exc:
            outcome["error"] = exc
        outcome["seconds"] = time.monotonic() - t0

    thread = threading.Thread(target=start, daemon=True)
    thread.start()
    thread.join(timeout=30)
    assert "seconds" in outcome, "the start still waits on a silent registry after 30 s (MODELPACK_TIMEOUT=2)"
    assert isinstance(outcome.get("error"), ModelpackError), outcome
    assert float(outcome["seconds"]) < 15, outcome  # type: ignore[arg-type]


def _docker_config(directory: Path, host: str, user: str, password: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    auth = base64.b64encode(f"{user}:{password}".encode()).decode()
    (directory / "config.json").write_text(json.dumps({"auths": {host: {"auth": auth}}}))


def test_the_initializer_finds_its_pull_secret_without_touching_the_process_environment(
    basic_registry: RegistryServer, checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """KServe's pull secret reaches the credential lookup for that registry, and os.environ (the
    DOCKER_CONFIG another thread or library reads) is left exactly as it was."""
    from modelpack.api import transfer
    from modelpack.serving.kserve.initializer import StorageInitializer, parse_pairs
    from modelpack.serving.kserve.settings import InitializerSettings
    from modelpack.targets.options import TargetOptions

    ref = basic_registry.ref("kserve/model", "v1")
    pushed = transfer.push(
        str(checkpoint),
        ref,
        target_options=TargetOptions(
            username=basic_registry.username,
            password=basic_registry.password,
            credentials_host=basic_registry.host,
        ),
        progress="off",
    )
    secret = tmp_path / "pull-secret"
    _docker_config(secret, basic_registry.host, basic_registry.username or "", basic_registry.password or "")
    elsewhere = tmp_path / "the-process-docker-config"
    elsewhere.mkdir()
    monkeypatch.setenv("DOCKER_CONFIG", str(elsewhere))
    before = dict(os.environ)

    settings = InitializerSettings.from_environ({"KSERVE_OCI_DOCKER_CONFIG": str(secret / "config.json")})
    lines: list[str] = []
    dest = tmp_path / "dest"
    results = StorageInitializer(settings, say=lines.append).run(
        parse_pairs([f"modelpack://{ref}", str(dest)])
    )

    assert dict(os.environ) == before
    assert results[0].digest == pushed.digest
    assert any(p.is_file() for p in dest.rglob("*.safetensors"))


@pytest.mark.parametrize("name", ["MODELPACK_POLICY", "MODELPACK_POLICY_YAML"])
def test_an_empty_policy_setting_in_the_initializer_fails_closed(name: str) -> None:
    """``MODELPACK_POLICY=`` (a ConfigMap key that rendered empty) is refused, naming the variable,
    instead of meaning "no policy"."""
    from modelpack.serving.kserve.settings import InitializerSettings

    with pytest.raises(ModelpackError, match=name):
        InitializerSettings.from_environ({name: ""})


# --------------------------------------------------------------------------- one place
SOURCE_DIRS = ("modelpack", "mediatypes", "signing", "mount", "loader")
_READ = re.compile(r"environ|getenv|\benv\.get\(|\benv\[|envvar=")
_NAME = re.compile(r"""["']MODELPACK_[A-Z0-9_]+["']""")


def _sources() -> Iterator[Path]:
    for top in SOURCE_DIRS:
        yield from sorted((ROOT / top).rglob("*.py"))


def _constants_holding_a_name(text: str) -> set[str]:
    """Module constants assigned a ``"MODELPACK_…"`` literal (``LOCK_TIMEOUT_ENV = "MODELPACK_…"``)."""
    return set(re.findall(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*(?::[^=]+)?=\s*[\"']MODELPACK_", text, re.M))


def test_no_module_but_the_settings_module_reads_a_modelpack_variable_from_the_environment() -> None:
    """A ``MODELPACK_*`` name is read from the environment only in modelpack/settings.py: every
    other module asks a ``Setting`` (a literal name or a constant holding one next to an
    environ/getenv/env.get/env[ read, or a click ``envvar=``, is a second place deciding that
    setting; a click option names its variable as ``settings.X.name``)."""
    offenders = []
    for path in _sources():
        rel = path.relative_to(ROOT).as_posix()
        if rel == "modelpack/settings.py":
            continue
        text = path.read_text(encoding="utf-8")
        constants = _constants_holding_a_name(text)
        held = re.compile(r"\b(" + "|".join(map(re.escape, constants)) + r")\b") if constants else None
        lines = text.splitlines()
        for number, line in enumerate(lines, 1):
            # a call split over lines: the read on this line or the one before, the name on this one
            if not (_READ.search(line) or (number > 1 and _READ.search(lines[number - 2]))):
                continue
            if _NAME.search(line) or (held is not None and held.search(line)):
                offenders.append(f"{rel}:{number}: {line.strip()}")
    assert offenders == []


_FACTORIES = {"modelpack/targets/options.py"}


def test_target_options_are_built_only_by_their_factory() -> None:
    """No entry point builds a ``TargetOptions(...)`` from scratch: each starts from
    ``TargetOptions.from_environ`` (then ``dataclasses.replace``), so an environment setting one
    entry point obeys is obeyed by all of them."""
    call = re.compile(r"\bTargetOptions\(")
    offenders = []
    for path in _sources():
        rel = path.relative_to(ROOT).as_posix()
        if rel in _FACTORIES:
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            code = line.split("#", 1)[0]
            if call.search(code) and "class TargetOptions" not in code:
                offenders.append(f"{rel}:{number}: {line.strip()}")
    assert offenders == []


#: the one write outside the settings module: ``fetch_before_compile(apply_environment=True)``
#: points torch's own compile-cache variables (``TORCHINDUCTOR_CACHE_DIR``) at a fetched asset,
#: for a caller that asks for it (the vLLM load format passes ``apply_environment=False``)
_TORCH_CACHE_OPT_IN = "modelpack/assets/startup.py"


def test_no_entry_point_writes_the_process_environment() -> None:
    """Settings and credentials travel in options, never through ``os.environ[...] = …``; the one
    write of a setting (the vLLM plugin's t0 and start id for the worker processes vLLM spawns)
    lives in the settings module."""
    write = re.compile(r"os\.environ\[[^\]]+\]\s*=|os\.environ\.(setdefault|update|pop)\(|os\.putenv\(")
    offenders = []
    for path in _sources():
        rel = path.relative_to(ROOT).as_posix()
        if rel in ("modelpack/settings.py", _TORCH_CACHE_OPT_IN):
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if write.search(line):
                offenders.append(f"{rel}:{number}: {line.strip()}")
    assert offenders == []


# --------------------------------------------------------------------------- the record
def test_the_checked_in_configuration_doc_is_the_generated_one() -> None:
    """docs/configuration.md is what ``python -m modelpack.settings --markdown`` prints, and it
    names every setting the module declares."""
    import subprocess
    import sys

    from modelpack import settings

    proc = subprocess.run(
        [sys.executable, "-m", "modelpack.settings", "--markdown"], capture_output=True, text=True, check=True
    )
    assert proc.stdout == (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert all(f"`{name}`" in proc.stdout for name in settings.SETTINGS)


MALFORMED = {
    "MODELPACK_TIMEOUT": ["soon", "0", "-3"],
    "MODELPACK_RETRY_FOR": ["forever", "2 weeks"],
    "MODELPACK_PLAIN_HTTP": ["maybe"],
    "MODELPACK_MIRROR_STALL": ["fast", "-1", "nan"],
    "MODELPACK_MIRROR_MIN_RATE": ["lots"],
    "MODELPACK_MIRROR_RATE_WINDOW": ["-2"],
    "MODELPACK_PEER_ORDER": ["random"],
    "MODELPACK_S3_PART_SIZE": ["16M", "0"],
    "MODELPACK_S3_MULTIPART_THRESHOLD": ["-1"],
    "MODELPACK_S3_CONCURRENCY": ["0", "many"],
    "MODELPACK_S3_CONDITIONAL_WRITES": ["sometimes"],
    "MODELPACK_LOCK_TIMEOUT": ["a while", "-5"],
    "MODELPACK_JOBS": ["0", "four"],
    "MODELPACK_PROGRESS_INTERVAL": ["-1", "often"],
    "MODELPACK_LINK": ["symlink"],
    "MODELPACK_TP_SIZE": ["0", "two"],
    "MODELPACK_GROUP_PROGRESS_TIMEOUT": ["0", "never"],
    "MODELPACK_T0": ["yesterday"],
}


@pytest.mark.parametrize(("name", "value"), [(n, v) for n, vs in MALFORMED.items() for v in vs])
def test_a_malformed_value_is_refused_naming_the_variable(name: str, value: str) -> None:
    """Each parser refuses what it cannot read with a SettingsError naming the variable, never
    a silent default."""
    from modelpack.errors import SettingsError
    from modelpack.settings import SETTINGS

    with pytest.raises(SettingsError, match=name) as info:
        SETTINGS[name].get({name: value})
    assert info.value.name == name


def test_every_setting_with_a_parser_that_can_refuse_is_covered_above() -> None:
    """A new setting whose parser can refuse a value gets a malformed case in MALFORMED."""
    from modelpack import settings

    lenient = {settings.text, settings.word, settings.url_list, settings.pairs_list, settings.debug_flag}
    refusing = {name for name, s in settings.SETTINGS.items() if s.parse not in lenient}
    assert refusing == set(MALFORMED)


def test_a_secret_value_is_never_part_of_the_error() -> None:
    """A malformed secret is refused without echoing it."""
    from modelpack.errors import SettingsError
    from modelpack.settings import Setting, text

    def strict(value: str) -> str:
        raise ValueError(f"{value!r} is not a token")

    secret = Setting("MODELPACK_X_TEST", strict, None, "test", "secret", "test", secret=True)
    with pytest.raises(SettingsError) as info:
        secret.get({"MODELPACK_X_TEST": "hunter2"})
    assert "hunter2" not in str(info.value) and "MODELPACK_X_TEST" in str(info.value)
    assert (
        Setting("MODELPACK_Y_TEST", text, None, "t", "t", "t").get({"MODELPACK_Y_TEST": " a b "}) == " a b "
    )


def test_empty_means_default_but_an_empty_protective_setting_is_refused() -> None:
    """``MODELPACK_TIMEOUT=`` is the default; ``MODELPACK_POLICY=`` is an error, as is any blank
    protective value, because it would otherwise switch the protection off."""
    from modelpack import settings
    from modelpack.errors import SettingsError

    assert settings.TIMEOUT.get({"MODELPACK_TIMEOUT": ""}) is None
    assert settings.JOBS.get({"MODELPACK_JOBS": " "}) == 4
    protective = [s for s in settings.SETTINGS.values() if s.protective]
    assert {s.name for s in protective} == {
        "MODELPACK_POLICY",
        "MODELPACK_POLICY_YAML",
        "MODELPACK_PEER_TOKEN",
        "MODELPACK_SERVE_TOKEN",
    }
    for s in protective:
        assert s.get({}) is None
        with pytest.raises(SettingsError, match=s.name):
            s.get({s.name: "  "})


def test_target_options_from_environ_reads_the_given_mapping_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """``TargetOptions.from_environ(environ)`` takes every connection setting from the mapping it
    is given, whatever the process environment says."""
    from modelpack.targets.options import MirrorThresholds, S3Tuning, TargetOptions

    monkeypatch.setenv("MODELPACK_TIMEOUT", "99")
    opts = TargetOptions.from_environ(
        {
            "MODELPACK_TIMEOUT": "7",
            "MODELPACK_RETRY_FOR": "2m",
            "MODELPACK_MIRRORS": "http://a:1, http://b:2",
            "MODELPACK_HOSTS_DIR": "/etc/hosts.d",
            "MODELPACK_S3_PART_SIZE": "6291456",
            "MODELPACK_S3_CONDITIONAL_WRITES": "OFF",
            "MODELPACK_MIRROR_MIN_RATE": "0",
        }
    )
    assert (opts.timeout, opts.retry_for, opts.mirrors, opts.hosts_dir) == (
        7.0,
        120.0,
        ["http://a:1", "http://b:2"],
        "/etc/hosts.d",
    )
    assert opts.s3 == S3Tuning(part_size=6291456, conditional_writes="off")
    assert opts.mirror_thresholds == MirrorThresholds(min_rate=0.0)
    assert TargetOptions.from_environ().timeout == 99.0


def test_the_cli_starts_from_the_environment_and_its_flags_win() -> None:
    """``build_target_options``: what the flags do not say comes from ``TargetOptions.from_environ``
    (timeout, retry budget, mirrors, S3 tuning); a flag given replaces its variable."""
    import click
    from click.testing import CliRunner

    from modelpack.cli.options import build_target_options, target_options
    from modelpack.targets.options import TargetOptions

    built: list[TargetOptions] = []

    @click.command()
    @target_options
    def probe(**kwargs: object) -> None:
        built.append(build_target_options(dict(kwargs)))

    env = {
        "MODELPACK_TIMEOUT": "7",
        "MODELPACK_RETRY_FOR": "5s",
        "MODELPACK_MIRRORS": "http://env-mirror:1",
        "MODELPACK_S3_CONCURRENCY": "3",
    }
    result = CliRunner().invoke(probe, [], env=env)
    assert result.exit_code == 0, result.output
    assert (built[0].timeout, built[0].retry_for, built[0].mirrors) == (7.0, 5.0, ["http://env-mirror:1"])
    assert built[0].s3.concurrency == 3
    result = CliRunner().invoke(probe, ["--retry-for", "0", "--mirror", "http://flag-mirror:2"], env=env)
    assert result.exit_code == 0, result.output
    assert (built[1].retry_for, built[1].mirrors) == (0.0, ["http://flag-mirror:2"])
