"""Credentials go only to the registry host they belong to, and S3 endpoint
secrets never appear in a message.

The attacks: ``modelpack cp SRC DST -u ci --password-stdin`` where SRC answers with a Basic
challenge (it used to receive the CI password meant for DST); the same with the environment's
credentials; a registry whose Bearer realm sits on another host (it used to receive Basic
credentials given for the registry); an upload ``Location`` on another host; and an S3 endpoint
URL with ``KEY:SECRET@`` that botocore echoed into errors. The registries are real
(distribution 2.8 with htpasswd); what each one received is recorded by a FaultProxy spy that
sees every request's headers, or by a small recording server for the realm and location hosts.
"""

from __future__ import annotations

import base64
import http.server
import json
import logging
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from modelpack.api import transfer
from modelpack.cli import main
from modelpack.errors import AuthenticationError, ModelpackError
from modelpack.targets.opener import TargetOptions, open_readable
from modelpack.targets.registry.auth import Credentials
from modelpack.targets.registry.client import RegistryClient
from modelpack.targets.registry.hosts import canonical_host, token_host_allowed
from tests.fixtures.faultproxy import Fault, FaultProxy
from tests.fixtures.registry import TEST_PASSWORD, TEST_USER, RegistryFactory, RegistryServer

CI_USER, CI_PASSWORD = "ci", "ci-only-Secret-7781"
pytestmark = pytest.mark.timeout(180)


@pytest.fixture(autouse=True)
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "docker"))
    for var in ("MODELPACK_REGISTRY_USERNAME", "MODELPACK_REGISTRY_PASSWORD", "MODELPACK_REGISTRY_HOST"):
        monkeypatch.delenv(var, raising=False)


def _basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


class Spy:
    """A FaultProxy in front of a registry that records every Authorization header it relays."""

    def __init__(self, upstream: str) -> None:
        self.proxy = FaultProxy(upstream)
        self.seen: list[str] = []

        def record(method: str, path: str, headers: dict[str, str]) -> bool:
            value = next((v for k, v in headers.items() if k.lower() == "authorization"), None)
            if value:
                self.seen.append(value)
            return False  # never a fault: relay everything

        self.proxy.add(Fault(match=record, times=None))

    @property
    def host(self) -> str:
        return self.proxy.host

    def close(self) -> None:
        self.proxy.close()


@pytest.fixture
def src(basic_registry: RegistryServer, checkpoint: Path) -> Iterator[Spy]:
    """A Basic-auth registry holding a model, behind a spy; its own credentials in docker config."""
    spy = Spy(basic_registry.host)
    opts = TargetOptions(username=TEST_USER, password=TEST_PASSWORD)
    transfer.push(str(checkpoint), f"{spy.host}/src/model:v1", target_options=opts, progress="off")
    spy.seen.clear()
    yield spy
    spy.close()


def _docker_login(tmp_path: Path, host: str, user: str, password: str) -> None:
    config = tmp_path / "docker" / "config.json"
    config.parent.mkdir(parents=True, exist_ok=True)
    doc = json.loads(config.read_text()) if config.exists() else {"auths": {}}
    doc["auths"][host] = {"auth": base64.b64encode(f"{user}:{password}".encode()).decode()}
    config.write_text(json.dumps(doc))


def test_cp_sends_the_ci_password_to_the_destination_only(
    src: Spy, registry: RegistryServer, tmp_path: Path
) -> None:
    _docker_login(tmp_path, src.host, TEST_USER, TEST_PASSWORD)  # SRC's own entry, keyed by host
    dst = Spy(registry.host)
    try:
        r = CliRunner().invoke(
            main,
            ["cp", f"{src.host}/src/model:v1", f"{dst.host}/dst/model:v1", "-u", CI_USER, "--password-stdin"],
            input=f"{CI_PASSWORD}\n",
        )
        assert r.exit_code == 0, r.output
        assert _basic(TEST_USER, TEST_PASSWORD) in src.seen  # SRC got its docker config entry
        assert _basic(CI_USER, CI_PASSWORD) not in src.seen
        assert all(CI_PASSWORD not in v for v in src.seen)
        assert CI_PASSWORD not in r.output
    finally:
        dst.close()


def test_environment_credentials_go_to_one_registry(
    src: Spy, registry: RegistryServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MODELPACK_REGISTRY_USERNAME", CI_USER)
    monkeypatch.setenv("MODELPACK_REGISTRY_PASSWORD", CI_PASSWORD)
    runner = CliRunner()
    # no host named: they belong to the destination, so SRC (no docker entry) is refused
    r = runner.invoke(main, ["cp", f"{src.host}/src/model:v1", registry.ref("env/model", "v1")])
    assert r.exit_code == 1 and "needs credentials" in r.output, r.output
    assert _basic(CI_USER, CI_PASSWORD) not in src.seen
    # named: MODELPACK_REGISTRY_HOST says which registry they belong to
    monkeypatch.setenv("MODELPACK_REGISTRY_USERNAME", TEST_USER)
    monkeypatch.setenv("MODELPACK_REGISTRY_PASSWORD", TEST_PASSWORD)
    monkeypatch.setenv("MODELPACK_REGISTRY_HOST", src.host)
    r = runner.invoke(main, ["cp", f"{src.host}/src/model:v1", registry.ref("env/model", "v1")])
    assert r.exit_code == 0, r.output
    assert src.seen and set(src.seen) == {_basic(TEST_USER, TEST_PASSWORD)}


def test_src_and_dest_creds_each_reach_their_own_registry_only(
    src: Spy, registry_factory: RegistryFactory, tmp_path: Path
) -> None:
    dst_server = registry_factory.start(basic_auth=True)
    # the destination gets its own user, so the two sides' credentials can be told apart
    htpasswd = dst_server.config_path.parent / "htpasswd"
    htpasswd.write_text(
        subprocess.run(
            ["htpasswd", "-Bbn", CI_USER, CI_PASSWORD], check=True, capture_output=True, text=True
        ).stdout
    )
    registry_factory.restart(dst_server)
    dst = Spy(dst_server.host)
    try:
        r = CliRunner().invoke(
            main,
            [
                "cp",
                f"{src.host}/src/model:v1",
                f"{dst.host}/dst/model:v1",
                "--src-creds",
                TEST_USER,  # password from stdin
                "--dest-creds",
                f"{CI_USER}:{CI_PASSWORD}",
            ],
            input=f"{TEST_PASSWORD}\n",
        )
        assert r.exit_code == 0, r.output
        assert src.seen and set(src.seen) == {_basic(TEST_USER, TEST_PASSWORD)}
        assert dst.seen and set(dst.seen) == {_basic(CI_USER, CI_PASSWORD)}
        # -u on cp means the destination: the same copy works with it
        r = CliRunner().invoke(
            main,
            [
                "cp",
                f"{src.host}/src/model:v1",
                f"{dst.host}/dst/model:v2",
                "--src-creds",
                f"{TEST_USER}:{TEST_PASSWORD}",
                "-u",
                CI_USER,
                "--password-stdin",
            ],
            input=f"{CI_PASSWORD}\n",
        )
        assert r.exit_code == 0, r.output
        assert set(src.seen) == {_basic(TEST_USER, TEST_PASSWORD)}
        assert set(dst.seen) == {_basic(CI_USER, CI_PASSWORD)}
    finally:
        dst.close()


def test_credentials_without_their_registry_are_refused(basic_registry: RegistryServer) -> None:
    unbound = TargetOptions(username=TEST_USER, password=TEST_PASSWORD)
    with pytest.raises(AuthenticationError, match="without the registry"):
        open_readable(basic_registry.ref("x/y", "v1"), unbound)
    # bound to another registry: this one is opened anonymously, and refuses
    other = TargetOptions(username=TEST_USER, password=TEST_PASSWORD, credentials_host="elsewhere.example")
    with pytest.raises(AuthenticationError):
        open_readable(basic_registry.ref("x/y", "v1"), other).resolve("v1")
    # one registry on both sides with two different sets of credentials is a usage error
    r = CliRunner().invoke(
        main,
        [
            "cp",
            basic_registry.ref("a/b", "v1"),
            basic_registry.ref("c/d", "v1"),
            "--src-creds",
            "u:p",
            "--dest-creds",
            "u:q",
        ],
    )
    assert r.exit_code == 2 and "both on" in r.output, r.output


# --------------------------------------------------------------------------- realm and locations
class Recorder:
    """A loopback HTTP server that records (path, Authorization) and answers from ``routes``:
    path prefix → (status, headers, body)."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.seen: list[tuple[str, str | None]] = []
        self.routes: dict[str, tuple[int, dict[str, str], bytes]] = {}
        recorder = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    self.rfile.read(length)
                recorder.seen.append((self.path, self.headers.get("Authorization")))
                route = next((v for k, v in recorder.routes.items() if self.path.startswith(k)), None)
                status, headers, body = route or (404, {}, b"")
                if callable(headers):
                    headers = headers(self)
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_PUT = do_POST = do_PATCH = do_HEAD = _answer

        self.server = http.server.ThreadingHTTPServer((host, 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def host(self) -> str:
        addr, port = self.server.server_address[:2]
        return f"{addr}:{port}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def realm() -> Iterator[Recorder]:
    r = Recorder("127.0.0.2")  # another host (loopback): the token service
    r.routes["/token"] = (200, {"Content-Type": "application/json"}, b'{"token": "tok-abc"}')
    yield r
    r.close()


@pytest.fixture
def bearer_registry(realm: Recorder) -> Iterator[Recorder]:
    """A registry stub whose Bearer challenge names a realm on another host."""
    reg = Recorder()

    def challenge(h: http.server.BaseHTTPRequestHandler) -> dict[str, str]:
        if h.headers.get("Authorization") == "Bearer tok-abc":
            return {}
        return {"WWW-Authenticate": f'Bearer realm="http://{realm.host}/token",service="stub"'}

    reg.routes["/v2/"] = (401, challenge, b"")  # type: ignore[assignment]
    yield reg
    reg.close()


def test_bearer_realm_on_another_host_never_receives_command_line_credentials(
    bearer_registry: Recorder, realm: Recorder
) -> None:
    r = CliRunner().invoke(
        main,
        [
            "tag",
            f"{bearer_registry.host}/m/x:v1",
            "v2",
            "-u",
            CI_USER,
            "--password-stdin",
            "--retry-for",
            "0",
        ],
        input=f"{CI_PASSWORD}\n",
    )
    assert r.exit_code == 1
    assert "another host" in r.output and "127.0.0.2" in r.output, r.output
    assert all(auth is None for _, auth in realm.seen), realm.seen
    assert all(auth is None or CI_PASSWORD not in auth for _, auth in bearer_registry.seen)


def test_docker_config_credentials_stay_on_their_registry_at_the_client(
    bearer_registry: Recorder, realm: Recorder, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _docker_login(tmp_path, bearer_registry.host, CI_USER, CI_PASSWORD)
    client = RegistryClient(
        bearer_registry.host, credentials=None, retry_for=0
    )  # anonymous: the realm gets no Authorization
    with pytest.raises(ModelpackError):
        client.request("GET", "/v2/", scopes=(), ok=(200,))
    assert realm.seen and all(auth is None for _, auth in realm.seen)
    from modelpack.targets.registry.auth import resolve_credentials

    creds = resolve_credentials(bearer_registry.host)
    assert creds is not None and creds.source.startswith("docker config")
    client = RegistryClient(bearer_registry.host, credentials=creds, retry_for=0)
    realm.seen.clear()
    with pytest.raises(AuthenticationError, match="another host"):
        client.request("GET", "/v2/", scopes=(), ok=(200,))
    assert realm.seen == []  # not a single request, let alone the password
    # the operator says that token service is the registry's own: then it gets them
    monkeypatch.setenv("MODELPACK_TOKEN_HOSTS", f"{bearer_registry.host}={realm.host}")
    client = RegistryClient(bearer_registry.host, credentials=creds, retry_for=0)
    with pytest.raises(ModelpackError):  # the stub's /v2/ never says 200
        client.request("GET", "/v2/", scopes=(), ok=(200,))
    assert (realm.seen[0][1] or "") == _basic(CI_USER, CI_PASSWORD)


def test_authorization_never_goes_to_an_upload_location_on_another_host() -> None:
    reg = Recorder()
    elsewhere = Recorder("127.0.0.2")
    reg.routes["/v2/"] = (200, {}, b"")
    elsewhere.routes["/upload"] = (201, {}, b"")
    try:
        client = RegistryClient(
            reg.host, credentials=Credentials(CI_USER, CI_PASSWORD, source="command line")
        )
        # the registry asked for Basic: the client now sends it proactively to its own host
        client.auth._scheme = "basic"
        client.request("GET", "/v2/", scopes=())
        assert reg.seen[-1][1] == _basic(CI_USER, CI_PASSWORD)
        client.request("PUT", f"http://{elsewhere.host}/upload?digest=x", scopes=(), body=b"", ok=(201,))
        assert elsewhere.seen == [("/upload?digest=x", None)]
    finally:
        reg.close()
        elsewhere.close()


def test_host_names_are_compared_canonically() -> None:
    assert canonical_host("Registry.Example.COM:443") == "registry.example.com"
    assert canonical_host("index.docker.io") == canonical_host("registry-1.docker.io") == "docker.io"
    assert canonical_host("127.0.0.1:5000") == "127.0.0.1:5000"
    assert token_host_allowed("docker.io", "https://auth.docker.io/token")
    assert token_host_allowed("127.0.0.1:5000", "http://127.0.0.1:5001/token")  # same host, other port
    assert not token_host_allowed("127.0.0.1:5000", "http://127.0.0.2:5001/token")
    assert not token_host_allowed("reg.example", "https://reg.example.evil.test/token")
    assert token_host_allowed("registry.gitlab.com", "https://gitlab.com/jwt/auth")
    trusted = "reg.example=auth.reg.example, other.example=x.test"
    assert token_host_allowed("REG.example:443", "https://auth.reg.example/token", trusted)
    assert not token_host_allowed("reg.example", "https://x.test/token", trusted)


# --------------------------------------------------------------------------- S3 endpoint secrets
S3_SECRET = "S3-endpoint-Secret-4411"


def test_s3_endpoint_secrets_are_redacted_everywhere(
    s3: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.DEBUG)
    monkeypatch.delenv("MODELPACK_S3_ENDPOINT", raising=False)
    runner = CliRunner()
    outputs = []
    # unreachable endpoint: botocore's connection error names the URL it was given
    bad = f"http://AKIAEXAMPLE:{S3_SECRET}@127.0.0.1:9"
    r = runner.invoke(main, ["--debug", "inspect", "s3://some-bucket/models:v1", "--s3-endpoint", bad])
    assert r.exit_code == 1, r.output
    assert "***@127.0.0.1:9" in r.output or "s3://some-bucket" in r.output
    outputs.append(r.output)
    # a malformed one: a typed error, not a ValueError traceback carrying it
    r = runner.invoke(
        main, ["inspect", "s3://some-bucket/models:v1", "--s3-endpoint", f"AKIA:{S3_SECRET}@nohost"]
    )
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit), r.output
    outputs.append(r.output)
    from modelpack.targets.s3.client import make_client, wrap_client_error

    client = make_client(bad)
    try:
        client.head_object(Bucket="b", Key="k")
    except Exception as exc:
        err = wrap_client_error(exc, "HeadObject", "s3://b/k")
        chain = [err, exc, exc.__cause__, exc.__context__]
        outputs += [str(e) for e in chain if e is not None]
    else:
        pytest.fail("the endpoint should be unreachable")
    # a reachable endpoint with keys in its URL works: they are that endpoint's credentials
    bucket = s3.make_bucket()
    host = s3.endpoint.split("://", 1)[1]
    good = f"http://AKIAEXAMPLE:{S3_SECRET}@{host}"
    ckpt = tmp_path / "ckpt"
    from modelpack.testdata.synthetic import SyntheticSpec, write_checkpoint

    write_checkpoint(str(ckpt), SyntheticSpec(shards=1))
    r = runner.invoke(main, ["pack", str(ckpt), f"s3://{bucket}/m:v1", "--s3-endpoint", good])
    assert r.exit_code == 0, r.output
    outputs.append(r.output)
    logs = "\n".join(f"{rec.name} {rec.getMessage()}" for rec in caplog.records)
    for text in [*outputs, logs]:
        assert S3_SECRET not in text


def test_a_command_naming_two_registries_refuses_a_single_user_name() -> None:
    r = CliRunner().invoke(
        main,
        ["diff", "127.0.0.1:1/a/m:v1", "127.0.0.2:1/a/m:v2", "-u", CI_USER, "--password-stdin"],
        input=f"{CI_PASSWORD}\n",
    )
    assert r.exit_code == 2 and "one registry" in r.output, r.output
    assert CI_PASSWORD not in r.output


# --------------------------------------------------------------------------- redirect targets
class BlobHost:
    """The host a registry redirects blob GETs to (distribution's ``redirect`` storage
    middleware, as a CDN is wired): on 127.0.0.2, another host. ``mode`` "challenge" answers
    every GET 401 with a Bearer realm on itself (and its /token hands out tokens); "serve" serves
    the registry's stored blob files without asking for anything. Every Authorization it
    receives is recorded."""

    def __init__(self, storage: Path, mode: str) -> None:
        self.seen: list[tuple[str, str | None]] = []
        host = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                host.seen.append((self.path, self.headers.get("Authorization")))
                path = self.path.split("?", 1)[0]
                body, status, headers = b"", 404, {}
                if path == "/token":
                    status, body = 200, b'{"token": "cdn-token"}'
                elif mode == "challenge" and self.headers.get("Authorization") != "Bearer cdn-token":
                    status = 401
                    headers["WWW-Authenticate"] = f'Bearer realm="http://{host.host}/token",service="cdn"'
                else:
                    file = storage / path.lstrip("/")
                    if file.is_file():
                        status, body = 200, file.read_bytes()
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.2", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def host(self) -> str:
        return f"127.0.0.2:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _redirecting_registry(
    registry_factory: RegistryFactory, checkpoint: Path, mode: str
) -> tuple[RegistryServer, BlobHost]:
    """A real Basic-auth registry holding a model whose blob GETs 307 to a ``BlobHost``."""
    server = registry_factory.start(basic_auth=True)
    opts = TargetOptions(username=TEST_USER, password=TEST_PASSWORD)
    transfer.push(str(checkpoint), server.ref("cdn/model", "v1"), target_options=opts, progress="off")
    blob_host = BlobHost(server.storage, mode)
    with server.config_path.open("a") as f:
        f.write(
            "middleware:\n  storage:\n    - name: redirect\n      options:\n"
            f"        baseurl: http://{blob_host.host}/\n"
        )
    registry_factory.restart(server)
    return server, blob_host


@pytest.mark.parametrize(
    ("mode", "source"), [("challenge", "docker config"), ("serve", "docker config"), ("challenge", "-u")]
)
def test_a_redirect_target_never_collects_the_registry_password(
    registry_factory: RegistryFactory, checkpoint: Path, tmp_path: Path, mode: str, source: str
) -> None:
    """The registry's password sits in docker's config.json; blob GETs 307 to
    another host. That host's 401 and Bearer realm on itself must not get the password: the
    challenge belongs to the host that sent it, and the pull either gets the blob without
    credentials or stops with a typed error naming that host."""
    server, blob_host = _redirecting_registry(registry_factory, checkpoint, mode)
    try:
        args = ["pull", server.ref("cdn/model", "v1"), str(tmp_path / "out"), "--retry-for", "0"]
        if source == "-u":
            args += ["-u", TEST_USER, "--password-stdin"]
        else:
            _docker_login(tmp_path, server.host, TEST_USER, TEST_PASSWORD)
        secret = base64.b64encode(f"{TEST_USER}:{TEST_PASSWORD}".encode()).decode()
        r = CliRunner().invoke(main, args, input=f"{TEST_PASSWORD}\n")
        assert any("/docker/registry/v2/blobs/" in p for p, _ in blob_host.seen), blob_host.seen
        leaked = [(p, a) for p, a in blob_host.seen if a and (secret in a or a.startswith("Basic"))]
        assert not leaked, leaked
        if mode == "serve":
            assert r.exit_code == 0, r.output
            assert (tmp_path / "out" / "config.json").is_file()
        else:
            assert r.exit_code == 1, r.output
            assert isinstance(r.exception, SystemExit)
            assert blob_host.host in r.output and "redirect" in r.output, r.output
            assert not any(p.startswith("/token") for p, _ in blob_host.seen), blob_host.seen
    finally:
        blob_host.close()


def test_docker_config_credentials_never_go_to_a_realm_on_another_host(
    bearer_registry: Recorder, realm: Recorder, tmp_path: Path
) -> None:
    """Docker's config.json entries are bound to their registry host like
    command-line and environment credentials (Docker Hub's documented token host aside)."""
    _docker_login(tmp_path, bearer_registry.host, CI_USER, CI_PASSWORD)
    r = CliRunner().invoke(main, ["inspect", f"{bearer_registry.host}/m/x:v1", "--retry-for", "0"])
    assert r.exit_code == 1, r.output
    assert "another host" in r.output and "127.0.0.2" in r.output, r.output
    assert all(auth is None or CI_PASSWORD not in auth for _, auth in realm.seen), realm.seen
    assert all(auth is None or not auth.startswith("Basic") for _, auth in realm.seen), realm.seen
