"""Basic auth, token auth, TLS, docker config.json and login/logout, against real registries.

Credentials must never appear in output: the CLI tests run with ``--debug`` and capture every
log record (urllib3 included) at DEBUG level, then search for the password, its base64 form and
every token the token server issued.
"""

from __future__ import annotations

import base64
import json
import logging
from pathlib import Path

import pytest
from click.testing import CliRunner

from modelpack.api import transfer
from modelpack.cli import main
from modelpack.errors import AuthenticationError, NotFoundError, RegistryTLSError
from modelpack.targets.opener import TargetOptions, open_target
from modelpack.targets.registry.auth import parse_challenges
from modelpack.targets.registry.target import RegistryTarget
from tests.fixtures.registry import RegistryServer


@pytest.fixture(autouse=True)
def _isolated_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MODELPACK_UPLOAD_STATE_DIR", str(tmp_path / "upload-state"))
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "docker"))
    monkeypatch.delenv("MODELPACK_REGISTRY_USERNAME", raising=False)
    monkeypatch.delenv("MODELPACK_REGISTRY_PASSWORD", raising=False)


def _secrets(server: RegistryServer) -> list[str]:
    assert server.username and server.password
    out = [server.password, base64.b64encode(f"{server.username}:{server.password}".encode()).decode()]
    if server.token_server is not None:
        out += server.token_server.tokens_issued
    return out


def test_parse_challenges() -> None:
    [c] = parse_challenges(
        'Bearer realm="https://auth.example/token",service="reg",scope="repository:a/b:pull"'
    )
    assert c.scheme == "bearer" and c.params["realm"] == "https://auth.example/token"
    assert c.params["scope"] == "repository:a/b:pull"
    [b] = parse_challenges('Basic realm="Registry Realm"')
    assert b.scheme == "basic" and b.params == {"realm": "Registry Realm"}


def test_basic_auth_push_and_pull(basic_registry: RegistryServer, checkpoint: Path, tmp_path: Path) -> None:
    ref = basic_registry.ref("basic/model", "v1")
    with pytest.raises(AuthenticationError) as exc:
        transfer.push(str(checkpoint), ref, progress="off")
    assert exc.value.status == 401
    opts = TargetOptions(username=basic_registry.username, password=basic_registry.password)
    pushed = transfer.push(str(checkpoint), ref, target_options=opts, progress="off")
    wrong = TargetOptions(username=basic_registry.username, password="wrong-password")
    with pytest.raises(AuthenticationError):
        transfer.pull(ref, str(tmp_path / "x"), target_options=wrong, progress="off")
    res = transfer.pull(ref, str(tmp_path / "ok"), target_options=opts, progress="off")
    assert res.digest == pushed.digest


def test_environment_credentials(
    basic_registry: RegistryServer, checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MODELPACK_REGISTRY_USERNAME", basic_registry.username or "")
    monkeypatch.setenv("MODELPACK_REGISTRY_PASSWORD", basic_registry.password or "")
    pushed = transfer.push(str(checkpoint), basic_registry.ref("env/model", "v1"), progress="off")
    assert pushed.copy.blobs_copied > 0


def test_login_writes_docker_config_and_logout_removes_it(
    basic_registry: RegistryServer, checkpoint: Path, tmp_path: Path
) -> None:
    runner = CliRunner()
    bad = runner.invoke(
        main, ["login", basic_registry.host, "-u", "ci-bot", "--password-stdin"], input="nope\n"
    )
    assert bad.exit_code == 1 and not (tmp_path / "docker" / "config.json").exists()
    ok = runner.invoke(
        main,
        ["login", basic_registry.host, "-u", basic_registry.username or "", "--password-stdin"],
        input=f"{basic_registry.password}\n",
    )
    assert ok.exit_code == 0, ok.output
    config = json.loads((tmp_path / "docker" / "config.json").read_text())
    assert basic_registry.host in config["auths"]
    assert (tmp_path / "docker" / "config.json").stat().st_mode & 0o077 == 0
    # the docker package's helpers read it back: push without any explicit credentials
    pushed = transfer.push(str(checkpoint), basic_registry.ref("cfg/model", "v1"), progress="off")
    assert pushed.copy.blobs_copied > 0
    out = runner.invoke(main, ["logout", basic_registry.host])
    assert out.exit_code == 0
    assert basic_registry.host not in json.loads((tmp_path / "docker" / "config.json").read_text())["auths"]
    with pytest.raises(AuthenticationError):
        transfer.pull(basic_registry.ref("cfg/model", "v1"), str(tmp_path / "d"), progress="off")
    for secret in _secrets(basic_registry):
        assert secret not in ok.output + bad.output + out.output


def test_token_auth_anonymous_pull_and_scope_upgrade(
    token_registry: RegistryServer, checkpoint: Path, tmp_path: Path
) -> None:
    ts = token_registry.token_server
    assert ts is not None
    ref = token_registry.ref("token/model", "v1")
    # anonymous: the token server grants pull only, so a push is refused
    with pytest.raises(AuthenticationError):
        transfer.push(str(checkpoint), ref, progress="off")

    opts = TargetOptions(
        username=token_registry.username,
        password=token_registry.password,
        credentials_host=token_registry.host,  # credentials belong to one registry
    )
    target = open_target(token_registry.ref("token/model", None), opts)  # opened for reading
    assert isinstance(target, RegistryTarget)
    ts.requests_seen.clear()
    with pytest.raises(NotFoundError):  # nothing pushed yet: a pull-scoped token, then not found
        target.resolve("v1")
    assert ts.requests_seen[-1][1] == ["repository:token/model:pull"]

    pushed = transfer.cp(f"oci:{_layout(checkpoint, tmp_path)}:v1", ref, target_options=opts, progress="off")
    scopes_asked = [s for _, asked, _ in ts.requests_seen for s in asked]
    assert "repository:token/model:pull,push" in scopes_asked
    # the same target upgrades its pull token when it starts writing
    before = len(ts.requests_seen)
    target.tag(target.resolve("v1"), "v2")
    asked_after = [s for _, asked, _ in ts.requests_seen[before:] for s in asked]
    assert asked_after == ["repository:token/model:pull,push"]
    # one token per (realm, service, scope): more writes fetch no new token
    target.tag(target.resolve("v1"), "v3")
    assert len(ts.requests_seen) == before + 1

    # anonymous pull works
    res = transfer.pull(ref, str(tmp_path / "anon"), progress="off")
    assert res.digest == str(pushed.descriptor.digest)


def _layout(checkpoint: Path, tmp_path: Path) -> Path:
    from modelpack import api

    layout = tmp_path / "layout"
    api.pack(str(checkpoint), f"oci:{layout}:v1")
    return layout


def test_tls_with_ca_works_and_without_ca_fails_clearly(
    tls_registry: RegistryServer, checkpoint: Path, tmp_path: Path
) -> None:
    ref = tls_registry.ref("tls/model", "v1")
    with pytest.raises(RegistryTLSError) as exc:
        transfer.push(str(checkpoint), ref, progress="off")
    assert "--ca-file" in str(exc.value)
    opts = TargetOptions(ca_file=str(tls_registry.ca_file))
    pushed = transfer.push(str(checkpoint), ref, target_options=opts, progress="off")
    target = open_target(tls_registry.ref("tls/model", None), opts)
    assert isinstance(target, RegistryTarget) and target.client.scheme == "https"
    res = transfer.pull(ref, str(tmp_path / "d"), target_options=opts, progress="off")
    assert res.digest == pushed.digest
    cli = CliRunner().invoke(main, ["pull", ref, str(tmp_path / "e")])
    assert cli.exit_code == 1 and "--ca-file" in cli.output


def test_credentials_never_in_output_or_debug_logs(
    token_registry: RegistryServer,
    basic_registry: RegistryServer,
    checkpoint: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    runner = CliRunner()
    outputs = []
    for server in (token_registry, basic_registry):
        ref = server.ref("secret/model", "v1")
        common = ["-u", server.username or "", "--password-stdin", "--progress", "off"]
        for args in (
            ["--debug", "push", str(checkpoint), ref, *common],
            ["--debug", "push", str(checkpoint), ref, *common, "--json"],
            ["--debug", "pull", ref, str(tmp_path / f"p-{server.port}"), *common],
            ["--debug", "tag", ref, "v2", "-u", server.username or "", "--password-stdin"],
        ):
            r = runner.invoke(main, args, input=f"{server.password}\n")
            assert r.exit_code == 0, r.output
            outputs.append(r.output)
        # a failing command must not echo them either
        r = runner.invoke(
            main,
            ["--debug", "pull", server.ref("secret/none", "v9"), str(tmp_path / "n"), *common],
            input=f"{server.password}\n",
        )
        assert r.exit_code == 1
        outputs.append(r.output)
    logs = "\n".join(f"{rec.name} {rec.getMessage()}" for rec in caplog.records)
    assert "token request" in logs and "PUT" in logs  # the debug log really was captured
    text = "\n".join(outputs) + logs
    for server in (token_registry, basic_registry):
        secrets = _secrets(server)
        assert len(secrets) >= 2
        for secret in secrets:
            assert secret not in text


def test_plain_http_only_for_loopback_or_when_asked() -> None:
    from modelpack.targets.registry.client import RegistryClient, is_loopback_host

    for host in ("127.0.0.1:5000", "127.9.9.9", "localhost:5000", "[::1]:5000", "LOCALHOST"):
        assert is_loopback_host(host), host
    for host in ("registry.example.com", "10.0.0.1:5000", "localhost.example.com", "[2001:db8::1]:443"):
        assert not is_loopback_host(host), host
    assert RegistryClient("registry.example.com").scheme == "https"  # decided without a connection
    assert RegistryClient("registry.example.com", plain_http=True).scheme == "http"
    assert RegistryClient("docker.io").base_url == "https://registry-1.docker.io"


_HELPER = """#!{python}
import json, os, sys
store = os.environ["FAKE_CRED_STORE"]
db = json.load(open(store)) if os.path.exists(store) else {{}}
action = sys.argv[1]
data = sys.stdin.read().strip()
if action == "store":
    doc = json.loads(data)
    db[doc["ServerURL"]] = {{"Username": doc["Username"], "Secret": doc["Secret"]}}
    json.dump(db, open(store, "w"))
elif action == "get":
    if data not in db:
        print("credentials not found in native keychain")
        sys.exit(1)
    print(json.dumps({{"ServerURL": data, **db[data]}}))
elif action == "erase":
    db.pop(data, None)
    json.dump(db, open(store, "w"))
"""


def test_credential_helper_from_docker_config(
    basic_registry: RegistryServer, checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real docker-credential-* program (the helper protocol over stdin/stdout)."""
    import os
    import sys

    bindir = tmp_path / "bin"
    bindir.mkdir()
    helper = bindir / "docker-credential-modelpacktest"
    helper.write_text(_HELPER.format(python=sys.executable))
    helper.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_CRED_STORE", str(tmp_path / "store.json"))
    (tmp_path / "docker").mkdir()
    (tmp_path / "docker" / "config.json").write_text(json.dumps({"credsStore": "modelpacktest"}))

    r = CliRunner().invoke(
        main,
        ["login", basic_registry.host, "-u", basic_registry.username or "", "--password-stdin"],
        input=f"{basic_registry.password}\n",
    )
    assert r.exit_code == 0, r.output
    assert "docker-credential-modelpacktest" in r.output
    stored = json.loads((tmp_path / "store.json").read_text())
    assert stored[basic_registry.host]["Secret"] == basic_registry.password
    # config.json itself holds no secret
    assert (basic_registry.password or "?") not in (tmp_path / "docker" / "config.json").read_text()
    pushed = transfer.push(str(checkpoint), basic_registry.ref("helper/model", "v1"), progress="off")
    assert pushed.copy.blobs_copied > 0
    assert transfer.logout(basic_registry.host)
    assert basic_registry.host not in json.loads((tmp_path / "store.json").read_text())
