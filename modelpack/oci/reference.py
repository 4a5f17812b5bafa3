"""Reference parsing for every place an artifact can live.

Forms:
  ``host[:port]/repo/path[:tag][@sha256:…]``  a registry repository (Docker Hub short names are
                                               expanded as docker does: ``docker.io/library/x``)
  ``oci://host[:port]/repo[:tag][@sha256:…]`` the same registry repository, spelled as KServe's
                                               storage URIs (and ORAS) spell one
  ``oci:PATH[:TAG|@sha256:…]``                an OCI image layout directory (no ``//``)
  ``s3://BUCKET[/PREFIX][:TAG|@sha256:…]``    an OCI image layout stored in an S3 bucket
"""

from __future__ import annotations

import os
import posixpath
import re
from dataclasses import dataclass, replace

from modelpack.errors import InvalidDigestError, InvalidReferenceError
from modelpack.oci.digest import Digest

_TAG_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
_REPO_COMPONENT_RE = re.compile(r"^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*$")
_HOST_RE = re.compile(r"^(?:[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*|\[[0-9A-Fa-f:]+\])(?::[0-9]+)?$")
_S3_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")

DOCKER_HUB = "docker.io"
#: Other names of Docker Hub's registry: one canonical name, so a policy rule written for one
#: spelling covers them all (docker's own normalisation does the same).
DOCKER_HUB_ALIASES = frozenset({"docker.io", "index.docker.io", "registry-1.docker.io"})
DEFAULT_TAG = "latest"
_NUMERIC_IPV4 = re.compile(r"^[0-9a-fA-FxX.]+$")


def validate_tag(tag: str) -> str:
    if not _TAG_RE.match(tag):
        raise InvalidReferenceError(f"invalid tag {tag!r}: 1-128 of [A-Za-z0-9_.-], not starting with . or -")
    return tag


@dataclass(frozen=True)
class Reference:
    """A parsed reference. ``scheme`` is ``registry``, ``oci`` or ``s3``.

    ``location`` is the registry host, the layout directory, or ``bucket/prefix``; ``repository``
    is only set for registries.
    """

    scheme: str
    location: str
    repository: str = ""
    tag: str | None = None
    digest: Digest | None = None

    @property
    def identifier(self) -> str:
        """What to resolve inside the target: the digest when pinned, else the tag."""
        if self.digest:
            return str(self.digest)
        return self.tag or DEFAULT_TAG

    @property
    def is_pinned(self) -> bool:
        return self.digest is not None

    @property
    def bucket(self) -> str:
        return self.location.split("/", 1)[0]

    @property
    def prefix(self) -> str:
        parts = self.location.split("/", 1)
        return parts[1] if len(parts) > 1 else ""

    def with_tag(self, tag: str | None) -> Reference:
        return replace(self, tag=validate_tag(tag) if tag else None, digest=None)

    def with_digest(self, digest: str) -> Reference:
        return replace(self, digest=Digest(digest))

    @property
    def repo_name(self) -> str:
        """``registry/repository`` (or the layout/bucket location) as written; policies match
        :attr:`canonical_name` instead."""
        if self.scheme == "registry":
            return f"{self.location}/{self.repository}"
        return f"{self.scheme}:{self.location}" if self.scheme == "oci" else f"s3://{self.location}"

    def canonical(self) -> Reference:
        """The same place, spelled one way: what trust decisions compare.

        Registry hosts are lower-cased, a port is written without leading zeros and ``:443`` is
        dropped, numeric IPv4 hosts are written as dotted quads (``127.1`` is ``127.0.0.1``, as
        the resolver reads it), IPv6 hosts in their compressed form, Docker Hub's aliases become
        ``docker.io`` and its one-component names get ``library/``. Layout paths become absolute
        and normalised (symlinks are not resolved here: that needs the filesystem, which the
        policy does). Tag and digest are kept.
        """
        if self.scheme == "registry":
            host = canonical_host(self.location)
            repository = self.repository
            if host == DOCKER_HUB and "/" not in repository:
                repository = f"library/{repository}"
            return replace(self, location=host, repository=repository)
        if self.scheme == "oci":
            return replace(self, location=canonical_path(self.location))
        return self

    @property
    def canonical_name(self) -> str:
        """:attr:`repo_name` of :meth:`canonical`: the string trust-policy globs match."""
        return self.canonical().repo_name

    def __str__(self) -> str:
        suffix = ""
        if self.tag:
            suffix += f":{self.tag}"
        if self.digest:
            suffix += f"@{self.digest}"
        if self.scheme == "registry":
            return f"{self.location}/{self.repository}{suffix}"
        if self.scheme == "oci":
            return f"oci:{self.location}{suffix}"
        return f"s3://{self.location}{suffix}"


def canonical_host(host: str) -> str:
    """``host[:port]`` in the one spelling that names the registry (see ``Reference.canonical``)."""
    name, port = _split_port(host.lower())
    if port is not None:
        port = port.lstrip("0") or "0"
        if port == "443":
            port = None
    if name.startswith("["):
        import ipaddress  # imported only for such hosts: the cache-hit path stays lean

        try:
            name = f"[{ipaddress.IPv6Address(name[1:-1]).compressed}]"
        except ValueError:
            pass
    elif _NUMERIC_IPV4.match(name) and any(c.isdigit() for c in name):
        import socket

        try:  # the resolver's reading (inet_aton): 127.1, 0x7f.0.0.1 and 127.000.0.01 are 127.0.0.1
            name = socket.inet_ntoa(socket.inet_aton(name))
        except OSError:
            pass
    if name in DOCKER_HUB_ALIASES and port is None:
        name = DOCKER_HUB
    return name if port is None else f"{name}:{port}"


def _split_port(host: str) -> tuple[str, str | None]:
    if host.startswith("["):
        end = host.find("]")
        if end != -1 and host[end + 1 : end + 2] == ":":
            return host[: end + 1], host[end + 2 :]
        return host, None
    name, sep, port = host.rpartition(":")
    return (name, port) if sep and port.isdigit() else (host, None)


def canonical_path(path: str) -> str:
    """An absolute, normalised layout path (``/srv/./models//x`` → ``/srv/models/x``)."""
    normal = posixpath.normpath(os.path.abspath(path))
    # POSIX keeps a leading "//" as implementation-defined; Linux treats it as "/"
    return "/" + normal.lstrip("/") if normal.startswith("//") else normal


def _split_digest(text: str) -> tuple[str, Digest | None]:
    if "@" not in text:
        return text, None
    head, _, dig = text.rpartition("@")
    try:
        return head, Digest(dig)
    except InvalidDigestError as exc:
        raise InvalidReferenceError(f"reference {text!r}: {exc}") from exc


def _split_tag(text: str) -> tuple[str, str | None]:
    """Split a trailing ``:tag`` that is not part of a path or a host:port."""
    head, sep, tail = text.rpartition(":")
    if not sep or "/" in tail or not tail:
        return text, None
    return head, validate_tag(tail)


#: ``oci://HOST/REPO`` names a registry repository everywhere (CLI, API, storage initializer)
OCI_REGISTRY_SCHEME = "oci://"


def _parse_oci_registry(text: str) -> Reference:
    """``oci://HOST[:PORT]/REPO[:TAG][@sha256:…]``: the host must look like one (a dot, a port or
    ``localhost``), so ``oci://./dir`` is refused with the layout spelling, never read as the
    directory ``//./dir`` nor as a Docker Hub name."""
    rest = text[len(OCI_REGISTRY_SCHEME) :]
    host = rest.split("/", 1)[0]
    hint = (
        f"reference {text!r}: oci://HOST[:PORT]/REPO names a registry repository and needs its host "
        "(a dot, a port or localhost); an OCI layout directory is written oci:DIR[:TAG]"
    )
    if "/" not in rest or not ("." in host or ":" in host or host == "localhost" or host.startswith("[")):
        raise InvalidReferenceError(hint)
    try:
        ref = parse_reference(rest)
    except InvalidReferenceError as exc:
        raise InvalidReferenceError(f"{hint} ({exc})") from exc
    if ref.scheme != "registry":
        raise InvalidReferenceError(hint)
    return ref


def parse_reference(text: str) -> Reference:
    if not isinstance(text, str) or not text or len(text) > 4096:
        raise InvalidReferenceError(f"invalid reference {text!r}")
    if text.startswith(OCI_REGISTRY_SCHEME):
        return _parse_oci_registry(text)
    if text.startswith("oci:"):
        body, digest = _split_digest(text[4:])
        path, tag = (body, None) if digest else _split_tag(body)
        if not path:
            raise InvalidReferenceError(f"reference {text!r}: missing layout directory after 'oci:'")
        return Reference("oci", path, tag=tag, digest=digest)
    if text.startswith("s3://"):
        body, digest = _split_digest(text[5:])
        loc, tag = (body, None) if digest else _split_tag(body)
        loc = loc.strip("/")
        bucket = loc.split("/", 1)[0]
        if not _S3_BUCKET_RE.match(bucket):
            raise InvalidReferenceError(f"reference {text!r}: {bucket!r} is not a valid S3 bucket name")
        if ".." in loc.split("/"):
            raise InvalidReferenceError(f"reference {text!r}: '..' in the S3 prefix")
        return Reference("s3", loc, tag=tag, digest=digest)
    if "://" in text:
        raise InvalidReferenceError(
            f"reference {text!r}: unknown scheme; use host/repo:tag, oci://host/repo:tag, oci:DIR:TAG or s3://…"
        )
    body, digest = _split_digest(text)
    name, tag = _split_tag(body)
    parts = name.split("/")
    first = parts[0]
    if len(parts) == 1 and tag is not None and tag.isdigit() and ("." in first or first == "localhost"):
        # Docker's grammar reads HOST:PORT as Docker Hub's library/HOST at tag PORT: a registry
        # typed where a repository belongs, which would wait on Docker Hub instead of failing
        raise InvalidReferenceError(
            f"reference {text!r} names a registry (HOST:PORT), not a repository: write "
            f"{text}/REPOSITORY (HOST:PORT/REPOSITORY; Docker Hub's library/{first} at tag {tag} is "
            f"docker.io/library/{text})"
        )
    if len(parts) > 1 and ("." in first or ":" in first or first == "localhost" or first.startswith("[")):
        host, repo_parts = first, parts[1:]
    else:
        host, repo_parts = DOCKER_HUB, (["library", *parts] if len(parts) == 1 else parts)
    if not _HOST_RE.match(host):
        raise InvalidReferenceError(f"reference {text!r}: invalid registry host {host!r}")
    for comp in repo_parts:
        if not _REPO_COMPONENT_RE.match(comp):
            raise InvalidReferenceError(
                f"reference {text!r}: invalid repository component {comp!r} (lowercase letters, digits, . _ -)"
            )
    repository = "/".join(repo_parts)
    if len(repository) > 255:
        raise InvalidReferenceError(f"reference {text!r}: repository name longer than 255 characters")
    return Reference("registry", host, repository=repository, tag=tag, digest=digest)
