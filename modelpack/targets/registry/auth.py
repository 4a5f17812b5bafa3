"""Registry credentials, bound to the registry host they belong to, and the Basic/Bearer dance.

Where credentials for a host come from, first match wins: the command line (``--username`` +
``--password-stdin``, ``cp --src-creds/--dest-creds``), the environment
(``MODELPACK_REGISTRY_USERNAME`` / ``MODELPACK_REGISTRY_PASSWORD``, for CI), then Docker's
``config.json`` (``DOCKER_CONFIG``, ``auths``, ``credsStore``, ``credHelpers``) read through the
``docker`` package's own helpers, so whatever ``docker login`` wrote works here too.

Each of them belongs to one registry host. Command-line credentials apply to the registry the
command names (``TargetOptions.credentials_host``; for ``cp``, the destination unless
``--src-creds`` says otherwise), environment credentials to ``MODELPACK_REGISTRY_HOST`` or else
that same registry, and ``config.json`` entries are keyed by host as docker keys them. Without
that binding a ``cp`` from a hostile registry that answers with a Basic challenge would collect
the CI password meant for the destination. Wherever they came from, credentials also never go to
a token service on another host name (the token hosts a registry's operator documents, such as
Docker Hub's ``auth.docker.io``, aside: ``hosts.KNOWN_TOKEN_HOSTS``; and those the person running
the command names in ``MODELPACK_TOKEN_HOSTS``). Docker follows any realm;
modelpack does not, because a registry (or a host it redirects to) could otherwise name a realm
of its choosing and collect the password stored for the registry.

A challenge is learnt only from the registry's own host: a 401 from a host a request was
redirected to (a CDN, a hostile storage backend) is that host's business, never a reason to send
this registry's credentials anywhere (``RegistryClient.request``).

Bearer tokens are cached per (realm, service, scope): a pull-scoped token is never reused for a
push (the bug that keeps the PyPI ``oras`` client from pushing to token registries). Nothing in
this module logs or formats a password or a token; ``Credentials.__repr__`` hides them.
"""

from __future__ import annotations

import base64
import http.client
import json
import logging
import os
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import requests
import urllib3

from modelpack import boundedjson, settings
from modelpack.errors import AuthenticationError, DocumentError, RegistryConnectionError, RegistryError
from modelpack.files import atomic_write_bytes
from modelpack.targets.options import TargetOptions
from modelpack.targets.registry.bodies import read_by_deadline
from modelpack.targets.registry.hosts import (
    canonical_host,
    host_name,
    is_loopback_url,
    token_host_allowed,
)
from modelpack.targets.retry import RetryBudget

log = logging.getLogger("modelpack.targets.registry.auth")

ENV_USERNAME = settings.REGISTRY_USERNAME.name
ENV_PASSWORD = settings.REGISTRY_PASSWORD.name
ENV_HOST = settings.REGISTRY_HOST.name
#: token services on another host that a registry's credentials may go to (``REGISTRY=HOST`` …)
ENV_TOKEN_HOSTS = settings.TOKEN_HOSTS.name
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


def docker_config_dir(explicit: str | None = None) -> str:
    """``explicit`` (``TargetOptions.docker_config_dir``: one target's pull secret), else
    ``$DOCKER_CONFIG``, else ``~/.docker``."""
    return explicit or os.environ.get("DOCKER_CONFIG") or os.path.join(os.path.expanduser("~"), ".docker")


def docker_config_path(explicit_dir: str | None = None) -> str:
    return os.path.join(docker_config_dir(explicit_dir), "config.json")


def _docker_config_key(host: str) -> str:
    return "https://index.docker.io/v1/" if host in ("docker.io", "index.docker.io") else host


def _from_docker_config(host: str, config_dir: str | None = None) -> Credentials | None:
    path = docker_config_path(config_dir)
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


def resolve_credentials(host: str, options: TargetOptions | None = None) -> Credentials | None:
    """The credentials that belong to ``host``: command line → environment → docker config.json;
    None means anonymous. Credentials bound to another host are never returned."""
    opts = options or TargetOptions.from_environ()
    registry = canonical_host(host)
    for bound, (user, password) in (opts.registry_credentials or {}).items():
        if canonical_host(bound) == registry:
            return Credentials(user, password, source="command line")
    if opts.username:
        if opts.password is None:
            raise AuthenticationError(
                "a username was given without a password (use --password-stdin)", target=host
            )
        if not opts.credentials_host:
            raise AuthenticationError(
                "credentials were given without the registry they belong to; name it "
                "(TargetOptions.credentials_host) so they are never sent to another host",
                target=host,
            )
        if canonical_host(opts.credentials_host) == registry:
            return Credentials(opts.username, opts.password, source="command line")
    env_user, env_password = settings.REGISTRY_USERNAME.get(), settings.REGISTRY_PASSWORD.get()
    if env_user and env_password is not None:
        env_host = settings.REGISTRY_HOST.get() or opts.credentials_host
        if env_host and canonical_host(env_host) == registry:
            return Credentials(env_user, env_password, source="environment")
    return _from_docker_config(host, opts.docker_config_dir)


def unbound_environment_hint(host: str) -> str:
    """Why environment credentials were not used for ``host`` (empty when they were not set)."""
    if not settings.REGISTRY_USERNAME.get():
        return ""
    named = settings.REGISTRY_HOST.get()
    if named:
        return f"; {ENV_USERNAME} belongs to {named} ({ENV_HOST}), not to {host}"
    return f"; {ENV_USERNAME} is set but names no registry: set {ENV_HOST}={host}"


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
        retry_for: float | None = None,
    ) -> None:
        self.host = host
        self._retry_for = retry_for
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
        if creds is not None and not token_host_allowed(self.host, realm, settings.TOKEN_HOSTS.get()):
            raise AuthenticationError(
                f"the registry sends token requests to another host ({host_name(realm)}); credentials "
                f"from the {creds.source or 'caller'} belong to {canonical_host(self.host)} and are "
                f"never sent elsewhere (if that token service is the registry's own, say so: "
                f"{ENV_TOKEN_HOSTS}={canonical_host(self.host)}={host_name(realm)})",
                target=self.host,
            )
        log.debug(
            "token request: realm=%s service=%s scopes=%s as %s",
            realm,
            service,
            " ".join(scopes),
            "anonymous" if creds is None else "an authenticated user",
        )
        self.token_requests += 1
        budget = RetryBudget(self._retry_for)
        while True:
            try:
                status, body = self._token_request(realm, service, scopes, creds)
            except _TokenTransportError as exc:
                if budget.wait():
                    continue
                raise RegistryConnectionError(
                    f"token service {host_name(realm)} unreachable: {exc.reason}", target=self.host
                ) from None
            if status in (429, 502, 503, 504) and budget.wait():
                continue
            break
        if status in (401, 403):
            raise AuthenticationError(
                "the token service refused the credentials"
                if creds is not None
                else "the token service requires credentials (modelpack login, -u/--password-stdin, "
                f"or {ENV_USERNAME}/{ENV_PASSWORD})" + unbound_environment_hint(self.host),
                status=status,
                target=self.host,
            )
        if status != 200:
            raise RegistryError("token request failed", status=status, target=self.host)
        try:
            doc = boundedjson.loads_object(body, what="token response", max_bytes=MAX_TOKEN_RESPONSE)
        except DocumentError as exc:
            raise AuthenticationError(f"unusable token response ({exc.reason})", target=self.host) from None
        value = doc.get("token") or doc.get("access_token")
        if not isinstance(value, str) or not _TOKEN_RE.match(value):
            raise AuthenticationError("token response has no usable token", target=self.host)
        expires_in = doc.get("expires_in", 60)
        if not isinstance(expires_in, int) or expires_in < 60:
            expires_in = 60  # the spec's minimum
        return _Token(value, time.monotonic() + expires_in)

    def _token_request(
        self, realm: str, service: str | None, scopes: tuple[str, ...], creds: Credentials | None
    ) -> tuple[int, bytes]:
        """One token request: (status, body of at most 1 MiB + 1 byte); transport failures raise
        ``_TokenTransportError`` so the caller can retry them."""
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
            with resp:
                body, in_time = read_by_deadline(resp.raw, MAX_TOKEN_RESPONSE + 1, self._timeout)
                if not in_time:
                    raise _TokenTransportError(f"token response trickled past {self._timeout:.0f} s")
                return resp.status_code, body
        except (
            requests.RequestException,
            urllib3.exceptions.HTTPError,
            http.client.HTTPException,
            OSError,
        ) as exc:
            raise _TokenTransportError(type(exc).__name__) from None


class _TokenTransportError(Exception):
    """A token request that failed in transport (refused, reset, cut, timed out)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


# ----------------------------------------------------------------------------- login / logout
def _read_config(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            raw = f.read(16 * 1024 * 1024 + 1)
    except FileNotFoundError:
        return {}
    if len(raw) > 16 * 1024 * 1024:
        raise RegistryError(f"{path} is larger than 16 MiB")
    if not raw.strip():
        return {}
    try:
        return boundedjson.loads_object(raw, what=path, max_bytes=16 * 1024 * 1024)
    except DocumentError as exc:
        raise RegistryError(f"{path}: {exc.reason}; not touching it") from None


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
