"""The initializer's settings, read from the container's environment.

KServe sets the argv pairs and, for registry credentials and TLS, ``KSERVE_OCI_DOCKER_CONFIG``
(the path of a docker ``config.json`` projected from the pod's image pull secret) and
``CA_BUNDLE_VOLUME_MOUNT_POINT`` (a directory holding ``cabundle.crt``). The
ClusterStorageContainer adds the ``MODELPACK_*`` settings: ``MODELPACK_CACHE`` (a node cache on a
hostPath), ``MODELPACK_POLICY`` (a mounted trust policy; or ``MODELPACK_POLICY_YAML``, its text), ``MODELPACK_PLAIN_HTTP`` (the only way
to speak plain HTTP to a registry that is not on loopback), ``MODELPACK_CA_FILE``,
``MODELPACK_EVENTS``, ``MODELPACK_JOBS``, ``MODELPACK_PROGRESS_INTERVAL``, ``MODELPACK_LINK``, and
for an index of variants ``MODELPACK_VARIANT``, ``_TP_SIZE``, ``_ENGINE``, ``_ACCELERATOR``
(``serving.variant_settings``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from modelpack import settings
from modelpack.errors import StorageInitializerError
from modelpack.oci.variant_selection import VariantSelector
from modelpack.serving.variant_settings import selector_from_environ
from modelpack.settings import Setting
from modelpack.targets.options import TargetOptions

KSERVE_DOCKER_CONFIG = "KSERVE_OCI_DOCKER_CONFIG"
KSERVE_CA_MOUNT = "CA_BUNDLE_VOLUME_MOUNT_POINT"
KSERVE_CA_FILE_NAME = "cabundle.crt"
DEFAULT_JOBS = settings.JOBS.default
DEFAULT_PROGRESS_INTERVAL_S = settings.PROGRESS_INTERVAL.default


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

    #: the connection settings the environment gives (timeout, retry budget, mirrors…), read by
    #: ``from_environ`` from the environ it was given; ``target_options`` adds the initializer's own
    environment_options: TargetOptions = field(
        default_factory=TargetOptions.from_environ, repr=False, compare=False
    )
    #: an index of variants: the entry for this node (``MODELPACK_VARIANT``, ``_TP_SIZE``,
    #: ``_ENGINE``, ``_ACCELERATOR``), read by ``from_environ`` from the environ it was given
    variant: VariantSelector = field(default_factory=selector_from_environ, repr=False, compare=False)

    @classmethod
    def from_environ(cls, env: Mapping[str, str] | None = None) -> InitializerSettings:
        """Read and check every setting; a bad one is an error naming the variable. An empty
        ``MODELPACK_POLICY`` or ``MODELPACK_POLICY_YAML`` is refused: it never means "no policy"."""
        env = os.environ if env is None else env
        return cls(
            cache_dir=settings.CACHE.get(env) or None,
            policy_path=_existing_file(env, settings.POLICY),
            policy_yaml=_policy_text(env),
            plain_http=settings.PLAIN_HTTP.get(env),
            ca_file=_ca_file(env),
            docker_config_dir=_docker_config_dir(env),
            events_path=settings.EVENTS.get(env) or None,
            jobs=settings.JOBS.get(env),
            progress_interval=settings.PROGRESS_INTERVAL.get(env),
            link=settings.LINK.get(env),
            environment_options=TargetOptions.from_environ(env),
            variant=selector_from_environ(env),
        )

    def target_options(
        self, *, timeout: float | None = None, retry_for: float | None = None
    ) -> TargetOptions:
        """The environment's options with the initializer's own: plain HTTP, CA bundle, the pull
        secret's directory (for the credential lookup of these targets only, never the process's
        ``DOCKER_CONFIG``), and ``--timeout``/``--retry-for`` when the command line gave them."""
        base = self.environment_options
        return dataclasses.replace(
            base,
            plain_http=self.plain_http,
            ca_file=self.ca_file,
            docker_config_dir=self.docker_config_dir,
            timeout=base.timeout if timeout is None else timeout,
            retry_for=base.retry_for if retry_for is None else retry_for,
        )


def _existing_file(env: Mapping[str, str], setting: Setting[str | None]) -> str | None:
    path = setting.get(env)
    if path is not None and not os.path.isfile(path):
        # fail closed: a policy that is named but not mounted never means "no policy"
        raise StorageInitializerError(
            f"${setting.name}={path}: no such file (is its Secret or ConfigMap mounted?)"
        )
    return path


def _policy_text(env: Mapping[str, str]) -> str | None:
    text = settings.POLICY_YAML.get(env)
    if text is not None and settings.POLICY.is_set(env):
        raise StorageInitializerError("set $MODELPACK_POLICY or $MODELPACK_POLICY_YAML, not both")
    return text


def _ca_file(env: Mapping[str, str]) -> str | None:
    explicit = _existing_file(env, settings.CA_FILE)
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
