"""Connection settings every command hands to whichever backing serves its reference.

Its own module so that backings (``s3``, ``registry``) can name it without importing
``opener``, which imports them.

Credentials given here belong to one registry each. A command that talks to two registries
(``cp``, ``diff``) must never hand the first one's password to the second, so ``username`` and
``password`` apply only to ``credentials_host`` (the command's registry, filled in by the CLI and
by the ``push``/``pull``/``cp``/``tag`` functions from the reference they were given), and
``registry_credentials`` holds more, keyed by host (``cp --src-creds/--dest-creds``). A
registry target opened with a username but no host to bind it to is refused.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


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
    #: containerd-style ``<dir>/<host>/hosts.toml`` mirror config (else ``MODELPACK_HOSTS_DIR``,
    #: else ``/etc/containerd/certs.d``)
    hosts_dir: str | None = None
    s3_endpoint: str | None = field(default=None, repr=False)  # may carry KEY:SECRET@
    s3_region: str | None = None
    create: bool = True
    link: str = "auto"
    extra: dict[str, Any] = field(default_factory=dict)

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
