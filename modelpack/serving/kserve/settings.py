"""The initializer's settings, read from the container's environment.

KServe sets the argv pairs and, for registry credentials and TLS, ``KSERVE_OCI_DOCKER_CONFIG``
(the path of a docker ``config.json`` projected from the pod's image pull secret) and
``CA_BUNDLE_VOLUME_MOUNT_POINT`` (a directory holding ``cabundle.crt``). The
ClusterStorageContainer adds the ``MODELPACK_*`` settings: ``MODELPACK_CACHE`` (a node cache on a
hostPath), ``MODELPACK_POLICY`` (a mounted trust policy; or ``MODELPACK_POLICY_YAML``, its text), ``MODELPACK_PLAIN_HTTP`` (the only way
to speak plain HTTP to a registry that is not on loopback), ``MODELPACK_CA_FILE``,
``MODELPACK_EVENTS``, ``MODELPACK_JOBS``, ``MODELPACK_PROGRESS_INTERVAL``, ``MODELPACK_LINK``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from modelpack.errors import StorageInitializerError

KSERVE_DOCKER_CONFIG = "KSERVE_OCI_DOCKER_CONFIG"
KSERVE_CA_MOUNT = "CA_BUNDLE_VOLUME_MOUNT_POINT"
KSERVE_CA_FILE_NAME = "cabundle.crt"
DEFAULT_JOBS = 4
DEFAULT_PROGRESS_INTERVAL_S = 10.0
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


@dataclass(frozen=True)
class InitializerSettings:
    cache_dir: str | None = None
    policy_path: str | None = None
    #: the policy document itself (``MODELPACK_POLICY_YAML``, e.g. from a ConfigMap key): a
    #: LocalModelNode download Job gets no volumes but the PVC, so a file cannot be mounted there
    policy_yaml: str | None = None
    plain_http: bool = False
    ca_file: str | None = None
    #: the directory whose ``config.json`` holds registry credentials (None: the usual places)
    docker_config_dir: str | None = None
    events_path: str | None = None
    jobs: int = DEFAULT_JOBS
    progress_interval: float = DEFAULT_PROGRESS_INTERVAL_S
    #: how a node-cache snapshot's files reach DEST: auto (reflink, hard link, copy) | reflink | copy
    link: str = "auto"

    @classmethod
    def from_environ(cls, env: Mapping[str, str] | None = None) -> InitializerSettings:
        """Read and check every setting; a bad one is a ``StorageInitializerError`` naming the variable."""
        env = os.environ if env is None else env
        return cls(
            cache_dir=env.get("MODELPACK_CACHE") or None,
            policy_path=_existing_file(env, "MODELPACK_POLICY"),
            policy_yaml=_policy_text(env),
            plain_http=_flag(env, "MODELPACK_PLAIN_HTTP"),
            ca_file=_ca_file(env),
            docker_config_dir=_docker_config_dir(env),
            events_path=env.get("MODELPACK_EVENTS") or None,
            jobs=_number(env, "MODELPACK_JOBS", DEFAULT_JOBS, int, minimum=1),
            progress_interval=_number(
                env, "MODELPACK_PROGRESS_INTERVAL", DEFAULT_PROGRESS_INTERVAL_S, float, minimum=0
            ),
            link=_choice(env, "MODELPACK_LINK", ("auto", "reflink", "copy")),
        )


def _flag(env: Mapping[str, str], name: str) -> bool:
    value = env.get(name, "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise StorageInitializerError(f"${name}={env[name]!r}: expected true or false")


def _choice(env: Mapping[str, str], name: str, choices: tuple[str, ...]) -> str:
    value = env.get(name, "").strip() or choices[0]
    if value not in choices:
        raise StorageInitializerError(f"${name}={value!r}: expected one of {', '.join(choices)}")
    return value


def _number(env: Mapping[str, str], name: str, default: float, kind: type[float], *, minimum: float) -> Any:
    text = env.get(name, "").strip()
    if not text:
        return default
    try:
        value = kind(text)
    except ValueError:
        raise StorageInitializerError(f"${name}={text!r}: expected a number") from None
    if value < minimum:
        raise StorageInitializerError(f"${name}={text!r}: must be at least {minimum:g}")
    return value


def _existing_file(env: Mapping[str, str], name: str) -> str | None:
    path = env.get(name) or None
    if path is not None and not os.path.isfile(path):
        # fail closed: a policy that is named but not mounted never means "no policy"
        raise StorageInitializerError(f"${name}={path}: no such file (is its Secret or ConfigMap mounted?)")
    return path


def _policy_text(env: Mapping[str, str]) -> str | None:
    text = env.get("MODELPACK_POLICY_YAML") or None
    if text is not None and env.get("MODELPACK_POLICY"):
        raise StorageInitializerError("set $MODELPACK_POLICY or $MODELPACK_POLICY_YAML, not both")
    return text


def _ca_file(env: Mapping[str, str]) -> str | None:
    explicit = _existing_file(env, "MODELPACK_CA_FILE")
    if explicit:
        return explicit
    mount = env.get(KSERVE_CA_MOUNT)
    if mount:
        bundle = os.path.join(mount, KSERVE_CA_FILE_NAME)
        if os.path.isfile(bundle):
            return bundle
    return None


def _docker_config_dir(env: Mapping[str, str]) -> str | None:
    """``KSERVE_OCI_DOCKER_CONFIG`` names a ``config.json``; the credential lookup reads
    ``<dir>/config.json``, so the file must have that name (KServe always projects it so)."""
    path = env.get(KSERVE_DOCKER_CONFIG)
    if not path:
        return None
    if os.path.basename(path) != "config.json":
        raise StorageInitializerError(
            f"${KSERVE_DOCKER_CONFIG}={path}: expected the path of a file named config.json"
        )
    if not os.path.isfile(path):
        raise StorageInitializerError(
            f"${KSERVE_DOCKER_CONFIG}={path}: no such file (is the pull secret mounted?)"
        )
    return os.path.dirname(os.path.abspath(path))
