"""Registry credentials and the Basic/Bearer challenge dance.

Where credentials come from, first match wins: explicit (``--username`` + ``--password-stdin``),
the environment (``MODELPACK_REGISTRY_USERNAME`` / ``MODELPACK_REGISTRY_PASSWORD``, for CI), then
Docker's ``config.json`` (``DOCKER_CONFIG``, ``auths``, ``credsStore``, ``credHelpers``) read through
the ``docker`` package's own helpers, so whatever ``docker login`` wrote works here too.

Bearer tokens are cached per (realm, service, scope): a pull-scoped token is never reused for a
push (the bug that keeps the PyPI ``oras`` client from pushing to token registries). Nothing in
this module logs or formats a password or a token; ``Credentials.__repr__`` hides them.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import requests

from modelpack.errors import AuthenticationError, RegistryConnectionError, RegistryError
from modelpack.files import atomic_write_bytes
from modelpack.targets.registry.hosts import is_loopback_url

log = logging.getLogger("modelpack.targets.registry.auth")

ENV_USERNAME = "MODELPACK_REGISTRY_USERNAME"
ENV_PASSWORD = "MODELPACK_REGISTRY_PASSWORD"
MAX_TOKEN_RESPONSE = 1024 * 1024
_TOKEN_RE = re.compile(r"^[A-Za-z0-9._~+/=-]+$")
DOCKER_HUB_AUTH_KEYS = ("https://index.docker.io/v1/", "index.docker.io", "docker.io")


@dataclass(frozen=True)
class Credentials:
    """A user name and secret. ``identity_token`` is an OAuth2 refresh token (docker's
    ``IdentityToken``), used instead of the password for token requests when present."""

    username: str
    password: str = field(repr=False)
    identity_token: str | None = field(default=None, repr=False)
    source: str = ""

    def basic_header(self) -> str:
        raw = f"{self.username}:{self.password}".encode()
        return "Basic " + base64.b64encode(raw).decode()


def docker_config_dir() -> str:
    return os.environ.get("DOCKER_CONFIG") or os.path.join(os.path.expanduser("~"), ".docker")


def docker_config_path() -> str:
    return os.path.join(docker_config_dir(), "config.json")


def _docker_config_key(host: str) -> str:
    return "https://index.docker.io/v1/" if host in ("docker.io", "index.docker.io") else host


def _from_docker_config(host: str) -> Credentials | None:
    path = docker_config_path()
    if not os.path.exists(path):
        return None
    try:
        from docker import auth as docker_auth

        config = docker_auth.load_config(config_path=path)
        entry = config.resolve_authconfig(_docker_config_key(host))
    except Exception as exc:  # docker raises its own types; never echo the config content
        raise AuthenticationError(
            f"cannot read credentials for {host} from {path}: {type(exc).__name__}", target=host
        ) from None
    if not entry:
        return None
    user = entry.get("Username") or entry.get("username") or ""
    password = entry.get("Password") or entry.get("password") or ""
    identity = entry.get("IdentityToken") or entry.get("identitytoken")
    if not (user and password) and not identity:
        return None
    return Credentials(user, password, identity, source=f"docker config {path}")


def resolve_credentials(
    host: str, username: str | None = None, password: str | None = None
) -> Credentials | None:
    """Explicit → environment → docker config.json; None means anonymous."""
    if username:
        if password is None:
            raise AuthenticationError(
                "a username was given without a password (use --password-stdin)", target=host
            )
        return Credentials(username, password, source="command line")
    env_user, env_password = os.environ.get(ENV_USERNAME), os.environ.get(ENV_PASSWORD)
    if env_user and env_password is not None:
        return Credentials(env_user, env_password, source="environment")
    return _from_docker_config(host)


# ----------------------------------------------------------------------------- challenges
@dataclass(frozen=True)
class Challenge:
    scheme: str  # lower case: "basic" or "bearer"
    params: dict[str, str]


_PARAM_RE = re.compile(r'\s*([A-Za-z0-9_-]+)\s*=\s*(?:"((?:[^"\\]|\\.)*)"|([^\s,]*))\s*,?')


def parse_challenges(header: str) -> list[Challenge]:
    """Parse ``WWW-Authenticate`` (``Bearer realm="…",service="…",scope="…"`` / ``Basic realm=…``)."""
    out: list[Challenge] = []
    rest = header.strip()
    while rest:
        m = re.match(r"([A-Za-z]+)\s*", rest)
        if not m:
            break
        scheme = m.group(1).lower()
        rest = rest[m.end() :]
        params: dict[str, str] = {}
        while rest:
            pm = _PARAM_RE.match(rest)
            if not pm or (pm.group(2) is None and pm.group(3) is None):
                break
            value = pm.group(2) if pm.group(2) is not None else pm.group(3)
            params[pm.group(1).lower()] = re.sub(r"\\(.)", r"\1", value)
            rest = rest[pm.end() :]
        out.append(Challenge(scheme, params))
        rest = rest.lstrip(", ")
    return out


@dataclass
class _Token:
    value: str
    expires_at: float


class Authenticator:
    """Per-registry auth state: the challenge seen, cached tokens, and the credentials.

    ``header(scopes)`` gives the Authorization value to send proactively once the registry's
    scheme is known (so a streamed upload is not answered 401 halfway); ``handle_401`` reacts to a
    challenge and says whether a retry can succeed.
    """

    def __init__(
        self,
        host: str,
        session: requests.Session,
        credentials: Credentials | None,
        *,
        verify: bool | str = True,
        timeout: float = 60.0,
    ) -> None:
        self.host = host
        self._session = session
        self._credentials = credentials
        self._verify = verify
        self._timeout = timeout
        self._scheme: str | None = None
        self._bearer_params: dict[str, str] = {}
        self._tokens: dict[tuple[str, str, str], _Token] = {}
        self._lock = threading.Lock()
        self.token_requests = 0  # how many tokens were fetched (tests and --debug read it)

    @property
    def anonymous(self) -> bool:
        return self._credentials is None

    @property
    def scheme(self) -> str | None:
        return self._scheme

    def header(self, scopes: tuple[str, ...]) -> str | None:
        if self._scheme == "basic" and self._credentials is not None:
            return self._credentials.basic_header()
        if self._scheme == "bearer":
            return "Bearer " + self._token(scopes)
        return None

    def handle_401(self, response: requests.Response, scopes: tuple[str, ...]) -> bool:
        """Learn from a 401. True: retrying with ``header(scopes)`` may now succeed."""
        challenges = parse_challenges(response.headers.get("WWW-Authenticate", ""))
        bearer = next((c for c in challenges if c.scheme == "bearer"), None)
        basic = next((c for c in challenges if c.scheme == "basic"), None)
        if bearer is not None and bearer.params.get("realm"):
            params = {k: v for k, v in bearer.params.items() if k not in ("scope", "error")}
            with self._lock:
                self._scheme = "bearer"
                self._bearer_params = params
                # drop the refused token; the caller retries once with a fresh one, so a token
                # that lacks the rights fails on the second 401 instead of looping
                self._tokens.pop(self._key(scopes), None)
            return True
        if basic is not None:
            if self._credentials is None:
                return False
            with self._lock:
                retry = self._scheme != "basic"
                self._scheme = "basic"
            return retry
        return False

    def _key(self, scopes: tuple[str, ...]) -> tuple[str, str, str]:
        return (
            self._bearer_params.get("realm", ""),
            self._bearer_params.get("service", ""),
            " ".join(sorted(scopes)),
        )

    def _token(self, scopes: tuple[str, ...]) -> str:
        with self._lock:
            key = self._key(scopes)
            tok = self._tokens.get(key)
            if tok is not None and tok.expires_at - 10 > time.monotonic():
                return tok.value
            tok = self._fetch_token(scopes)
            self._tokens[key] = tok
            return tok.value

    def _fetch_token(self, scopes: tuple[str, ...]) -> _Token:
        realm = self._bearer_params.get("realm", "")
        service = self._bearer_params.get("service")
        if not realm.startswith(("https://", "http://")):
            raise AuthenticationError(f"token realm {realm!r} is not an http(s) URL", target=self.host)
        if realm.startswith("http://") and self._verify is not False and not is_loopback_url(realm):
            raise AuthenticationError(
                f"refusing to send credentials to a plain-HTTP token realm {realm}", target=self.host
            )
        creds = self._credentials
        log.debug(
            "token request: realm=%s service=%s scopes=%s as %s",
            realm,
            service,
            " ".join(scopes),
            "anonymous" if creds is None else "an authenticated user",
        )
        self.token_requests += 1
        try:
            if creds is not None and creds.identity_token:
                form = {
                    "grant_type": "refresh_token",
                    "refresh_token": creds.identity_token,
                    "client_id": "modelpack",
                    "scope": " ".join(scopes),
                }
                if service:
                    form["service"] = service
                resp = self._session.post(
                    realm, data=form, timeout=self._timeout, verify=self._verify, stream=True
                )
            else:
                params: list[tuple[str, str]] = []
                if service:
                    params.append(("service", service))
                params += [("scope", s) for s in scopes]
                headers = {"Authorization": creds.basic_header()} if creds is not None else {}
                resp = self._session.get(
                    realm,
                    params=params,
                    headers=headers,
                    timeout=self._timeout,
                    verify=self._verify,
                    stream=True,
                )
        except requests.RequestException as exc:
            raise RegistryConnectionError(
                f"token service {realm} unreachable: {type(exc).__name__}", target=self.host
            ) from None
        with resp:
            body = resp.raw.read(MAX_TOKEN_RESPONSE + 1, decode_content=True)
            if resp.status_code in (401, 403):
                raise AuthenticationError(
                    "the token service refused the credentials"
                    if creds is not None
                    else "the token service requires credentials (docker login, "
                    f"{ENV_USERNAME}/{ENV_PASSWORD} or --username)",
                    status=resp.status_code,
                    target=self.host,
                )
            if resp.status_code != 200:
                raise RegistryError("token request failed", status=resp.status_code, target=self.host)
        if len(body) > MAX_TOKEN_RESPONSE:
            raise AuthenticationError("token response larger than 1 MiB", target=self.host)
        try:
            doc: Any = json.loads(body)
        except ValueError:
            raise AuthenticationError("token response is not JSON", target=self.host) from None
        value = doc.get("token") or doc.get("access_token") if isinstance(doc, dict) else None
        if not isinstance(value, str) or not _TOKEN_RE.match(value):
            raise AuthenticationError("token response has no usable token", target=self.host)
        expires_in = doc.get("expires_in", 60)
        if not isinstance(expires_in, int) or expires_in < 60:
            expires_in = 60  # the spec's minimum
        return _Token(value, time.monotonic() + expires_in)


# ----------------------------------------------------------------------------- login / logout
def _read_config(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            raw = f.read(16 * 1024 * 1024 + 1)
    except FileNotFoundError:
        return {}
    if len(raw) > 16 * 1024 * 1024:
        raise RegistryError(f"{path} is larger than 16 MiB")
    try:
        doc = json.loads(raw) if raw.strip() else {}
    except ValueError:
        raise RegistryError(f"{path} is not valid JSON; not touching it") from None
    if not isinstance(doc, dict):
        raise RegistryError(f"{path} is not a JSON object; not touching it")
    return doc


def _credential_store_for(doc: dict[str, Any], host: str) -> str | None:
    helpers = doc.get("credHelpers") or {}
    if isinstance(helpers, dict) and isinstance(helpers.get(host), str):
        return str(helpers[host])
    store = doc.get("credsStore")
    return store if isinstance(store, str) and store else None


def store_credentials(host: str, creds: Credentials) -> str:
    """Save credentials as ``docker login`` would; returns where (config path or helper name)."""
    path = docker_config_path()
    doc = _read_config(path)
    key = _docker_config_key(host)
    helper = _credential_store_for(doc, host)
    if helper:
        from docker import credentials as docker_credentials

        try:
            docker_credentials.Store(helper).store(server=key, username=creds.username, secret=creds.password)
        except docker_credentials.StoreError as exc:
            raise RegistryError(
                f"credential helper docker-credential-{helper} failed: {type(exc).__name__}", target=host
            ) from None
        auths = doc.setdefault("auths", {})
        auths.setdefault(key, {})
        where = f"docker-credential-{helper}"
    else:
        auths = doc.setdefault("auths", {})
        entry = dict(auths.get(key) or {})
        entry["auth"] = base64.b64encode(f"{creds.username}:{creds.password}".encode()).decode()
        auths[key] = entry
        where = path
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    atomic_write_bytes(path, (json.dumps(doc, indent="\t") + "\n").encode(), mode=0o600)
    return where


def erase_credentials(host: str) -> bool:
    """Remove stored credentials for ``host``; True if there were any."""
    path = docker_config_path()
    doc = _read_config(path)
    key = _docker_config_key(host)
    found = False
    helper = _credential_store_for(doc, host)
    if helper:
        from docker import credentials as docker_credentials

        try:
            docker_credentials.Store(helper).erase(key)
            found = True
        except docker_credentials.CredentialsNotFound:
            pass
        except docker_credentials.StoreError as exc:
            raise RegistryError(
                f"credential helper docker-credential-{helper} failed: {type(exc).__name__}", target=host
            ) from None
    auths = doc.get("auths")
    if isinstance(auths, dict) and key in auths:
        del auths[key]
        found = True
        atomic_write_bytes(path, (json.dumps(doc, indent="\t") + "\n").encode(), mode=0o600)
    return found
