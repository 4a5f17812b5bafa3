"""Connection settings every command hands to whichever backing serves its reference.

Its own module so that backings (``s3``, ``registry``) can name it without importing
``opener``, which imports them.

Credentials given here belong to one registry each. A command that talks to two registries
(``cp``, ``diff``) must never hand the first one's password to the second, so ``username`` and
``password`` apply only to ``credentials_host`` (the command's registry, filled in by the CLI and
by the ``push``/``pull``/``cp``/``tag`` functions from the reference they were given), and
``registry_credentials`` holds more, keyed by host (``cp --src-creds/--dest-creds``). A
registry target opened with a username but no host to bind it to is refused.

``TargetOptions.from_environ`` is the one factory: every entry point (the CLI, the Python API's
defaults, the vLLM load format, the KServe initializer) starts from what the environment says
(``modelpack.settings``) and overrides the fields it decides itself (a flag, ``plain_http`` from
the load format's config). Nothing else builds a ``TargetOptions`` from scratch, so a setting
honoured by one entry point is honoured by all of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from modelpack import settings

if TYPE_CHECKING:
    from modelpack.events import EventLog


@dataclass(frozen=True)
class S3Tuning:
    """Transfer tuning for S3 targets (``MODELPACK_S3_*``); None: the S3 target's default."""

    part_size: int | None = None
    multipart_threshold: int | None = None
    concurrency: int | None = None
    conditional_writes: str | None = None  # auto | on | off


@dataclass(frozen=True)
class MirrorThresholds:
    """When a mirror is left for the next source (``MODELPACK_MIRROR_*``); None: the default."""

    #: seconds without a byte (0 or None: the default)
    stall_s: float | None = None
    #: bytes per second a mirror must deliver over each window (0 turns the floor off)
    min_rate: float | None = None
    rate_window_s: float | None = None


@dataclass
class TargetOptions:
    """Connection settings shared by every command; backings read what applies to them."""

    plain_http: bool = False
    ca_file: str | None = None
    insecure_skip_verify: bool = False
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    #: the registry ``username``/``password`` belong to (and, when no username is given, the one
    #: ``MODELPACK_REGISTRY_USERNAME``/``PASSWORD`` belong to unless ``MODELPACK_REGISTRY_HOST`` says)
    credentials_host: str | None = None
    #: more credentials, each for one registry host: host → (username, password)
    registry_credentials: dict[str, tuple[str, str]] = field(default_factory=dict, repr=False)
    #: how long to keep retrying through an outage, in seconds (None: the default, 60 s)
    retry_for: float | None = None
    #: how long one registry request may wait: to connect (at most 30 s), for each read, and for
    #: a whole document (manifest, index, tag list) to arrive, in seconds (``--timeout``, else
    #: ``MODELPACK_TIMEOUT``; None: the registry client's default, 300 s). Each retry within
    #: ``retry_for`` gets its own.
    timeout: float | None = None
    #: mirrors asked for blobs before the origin, in order (``--mirror``; else ``MODELPACK_MIRRORS``)
    mirrors: list[str] = field(default_factory=list)
    #: the bearer token presented to ``mirrors`` (``MODELPACK_PEER_TOKEN``: the peers' ``cache
    #: serve`` token); never to an origin registry, a hosts.toml mirror or a redirect target
    peer_token: str | None = field(default=None, repr=False)
    #: containerd-style ``<dir>/<host>/hosts.toml`` mirror config (else ``MODELPACK_HOSTS_DIR``,
    #: else ``/etc/containerd/certs.d``)
    hosts_dir: str | None = None
    s3_endpoint: str | None = field(default=None, repr=False)  # may carry KEY:SECRET@
    s3_region: str | None = None
    create: bool = True
    link: str = "auto"
    #: the JSON event log a registry target's source events (mirror, peer, origin) go to
    events: EventLog | None = field(default=None, repr=False)
    #: bytes per upload chunk (None: the registry target's default); also lowers the single-PUT limit
    chunk_size: int | None = None
    s3: S3Tuning = field(default_factory=S3Tuning)
    mirror_thresholds: MirrorThresholds = field(default_factory=MirrorThresholds)
    #: the directory whose ``config.json`` holds registry credentials for this target (the KServe
    #: pull secret); None: ``$DOCKER_CONFIG``, else ``~/.docker``
    docker_config_dir: str | None = None

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> TargetOptions:
        """What the environment (default ``os.environ``) says: plain HTTP, CA bundle, timeout, retry
        budget, mirrors and the token presented to them, hosts.toml directory, S3 endpoint and
        tuning, mirror thresholds. Every entry point starts
        here and overrides what it decides itself (``dataclasses.replace``)."""
        return cls(
            plain_http=settings.PLAIN_HTTP.get(environ),
            ca_file=settings.CA_FILE.get(environ),
            timeout=settings.TIMEOUT.get(environ),
            retry_for=settings.RETRY_FOR.get(environ),
            mirrors=list(settings.MIRRORS.get(environ)),
            peer_token=settings.PEER_TOKEN.get(environ),
            hosts_dir=settings.HOSTS_DIR.get(environ),
            s3_endpoint=settings.S3_ENDPOINT.get(environ),
            s3=S3Tuning(
                part_size=settings.S3_PART_SIZE.get(environ),
                multipart_threshold=settings.S3_MULTIPART_THRESHOLD.get(environ),
                concurrency=settings.S3_CONCURRENCY.get(environ),
                conditional_writes=settings.S3_CONDITIONAL_WRITES.get(environ),
            ),
            mirror_thresholds=MirrorThresholds(
                stall_s=settings.MIRROR_STALL.get(environ),
                min_rate=settings.MIRROR_MIN_RATE.get(environ),
                rate_window_s=settings.MIRROR_RATE_WINDOW.get(environ),
            ),
        )

    def bound_to(self, reference: Any) -> TargetOptions:
        """These options with their credentials bound to ``reference``'s registry host, unless
        they already name one (a copy; ``reference`` is a Reference or a reference string).

        ``push``, ``cp`` and ``tag`` bind to the destination, ``pull`` to the source: the
        registry a person means when they give one user name to a command."""
        if self.credentials_host:
            return self
        from modelpack.oci.reference import Reference, parse_reference

        ref = reference if isinstance(reference, Reference) else parse_reference(str(reference))
        if ref.scheme != "registry":
            return self
        return dataclasses.replace(self, credentials_host=ref.location)
