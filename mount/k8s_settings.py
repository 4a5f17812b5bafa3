"""The pull settings a generated Kubernetes object hands to every container that reaches a registry.

A pod's ``modelpack pull``, ``cache serve --fill``, KServe storage initializer and streaming vLLM
all read their connection settings from the environment (``TargetOptions.from_environ``,
docs/configuration.md), so the objects carry them as the same ``MODELPACK_*`` variables:
mirrors, plain HTTP, a CA bundle (mounted from a ConfigMap), the retry budget and the timeout.
The peer token comes from a Secret (``valueFrom``), never as a value in the object.

The images are the user's: ``modelpack_image_warning`` says when one is not pinned by digest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from modelpack.errors import InvalidReferenceError, K8sError
from modelpack.oci.reference import parse_reference

CA_MOUNT = "/etc/modelpack/ca"
CA_VOLUME = "registry-ca"
PEER_TOKEN_KEY = "token"


def _literal(value: str) -> str:
    return value.replace("$", "$$")  # as mount.k8s.literal: the kubelet expands $(VAR) in values


def _env(name: str, value: str) -> dict[str, str]:
    return {"name": name, "value": _literal(value)}


def _seconds(value: float) -> str:
    return f"{int(value)}s" if float(value).is_integer() else f"{value}s"


@dataclass(frozen=True)
class PodPullSettings:
    """What a person asked of every pull in the generated objects (None/empty: the default)."""

    mirrors: tuple[str, ...] = ()
    plain_http: bool = False
    #: a ConfigMap holding the registry's CA bundle under ``ca_key`` (mounted at ``CA_MOUNT``)
    ca_configmap: str | None = None
    ca_key: str = "ca.crt"
    retry_for: float | None = None
    timeout: float | None = None

    @property
    def ca_file(self) -> str | None:
        """Where the CA bundle is inside the pod."""
        return f"{CA_MOUNT}/{self.ca_key}" if self.ca_configmap else None

    def env(self, *, mirrors_first: tuple[str, ...] = (), with_mirrors: bool = True) -> list[dict[str, Any]]:
        """The ``MODELPACK_*`` variables for one container; ``mirrors_first`` (the peers) go
        before the user's mirrors; ``with_mirrors=False`` for a container that must ask the
        origin itself (a fill)."""
        out: list[dict[str, Any]] = []
        mirrors = [*mirrors_first, *self.mirrors] if with_mirrors else []
        if mirrors:
            out.append(_env("MODELPACK_MIRRORS", " ".join(mirrors)))
        if self.plain_http:
            out.append(_env("MODELPACK_PLAIN_HTTP", "true"))
        if self.ca_file:
            out.append(_env("MODELPACK_CA_FILE", self.ca_file))
        if self.retry_for is not None:
            out.append(_env("MODELPACK_RETRY_FOR", _seconds(self.retry_for)))
        if self.timeout is not None:
            out.append(_env("MODELPACK_TIMEOUT", _seconds(self.timeout)))
        return out

    def mounts(self) -> list[dict[str, Any]]:
        return [{"name": CA_VOLUME, "mountPath": CA_MOUNT, "readOnly": True}] if self.ca_configmap else []

    def volumes(self) -> list[dict[str, Any]]:
        if not self.ca_configmap:
            return []
        return [
            {
                "name": CA_VOLUME,
                "configMap": {
                    "name": self.ca_configmap,
                    "items": [{"key": self.ca_key, "path": self.ca_key}],
                    "defaultMode": 0o444,
                },
            }
        ]

    def check(self) -> None:
        for url in self.mirrors:
            if not url.strip() or any(c.isspace() or c == "," for c in url):
                raise K8sError(f"--mirror {url!r}: one URL, no blanks or commas")
        if "/" in self.ca_key or self.ca_key in ("", ".", ".."):
            raise K8sError(f"--ca-key {self.ca_key!r}: a key of the ConfigMap, not a path")
        if self.timeout is not None and not self.timeout > 0:
            raise K8sError("--timeout must be a positive number of seconds")
        if self.retry_for is not None and self.retry_for < 0:
            raise K8sError("--retry-for must not be negative")


def peer_token_env(name: str, secret: str) -> dict[str, Any]:
    """``name`` from the Secret ``secret``'s ``token`` key (never a value in the object)."""
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": PEER_TOKEN_KEY}}}


def image_pin_warning(image: str, *, flag: str) -> str | None:
    """None for an image pinned by digest; a warning for one named by tag (two nodes may run
    different code under one tag). A value that is not an image reference is a ``K8sError``."""
    try:
        ref = parse_reference(image)
    except InvalidReferenceError as exc:
        raise K8sError(f"{flag} {image!r} is not an image reference: {exc}") from None
    if ref.scheme != "registry" or any(c.isspace() for c in image):
        raise K8sError(f"{flag} {image!r} is not a registry image reference (HOST/REPO@sha256:…)")
    if ref.digest:
        return None
    return (
        f"warning: {flag} {image} is named by tag, not pinned by digest: nodes may run different "
        "code under it; prefer HOST/REPO@sha256:…"
    )
