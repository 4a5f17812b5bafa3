"""Typed registry errors: every one names the registry/repository at fault, the HTTP status and the
OCI error code, and never carries credentials (URLs in errors are stripped of query strings)."""

from __future__ import annotations

from modelpack.errors import ModelpackError, NotFoundError


class RegistryError(ModelpackError):
    """A registry answered with an error (or not at all).

    ``status`` is the HTTP status (None for transport failures), ``code`` the first OCI error code
    (``BLOB_UNKNOWN``, ``MANIFEST_INVALID``, ``DENIED``…) when the body had one.
    """

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        code: str | None = None,
        target: str = "",
        detail: str = "",
    ) -> None:
        parts = [f"{target}: " if target else "", message]
        if status is not None:
            parts.append(f" (HTTP {status}" + (f", {code}" if code else "") + ")")
        if detail:
            parts.append(f": {detail}")
        super().__init__("".join(parts))
        self.status = status
        self.code = code
        self.target = target


class RegistryNotFoundError(RegistryError, NotFoundError):
    """A repository, tag, manifest or blob the registry does not have (404 / *_UNKNOWN)."""


class AuthenticationError(RegistryError):
    """401: no credentials, wrong credentials, or a token the registry refused."""


class PermissionDeniedError(RegistryError):
    """403 / DENIED: authenticated, but not allowed (e.g. push to a read-only repository)."""


class RegistryConnectionError(RegistryError):
    """The registry could not be reached (refused, reset, timed out)."""


class RegistryTLSError(RegistryConnectionError):
    """TLS failed: unknown CA (pass --ca-file), wrong host name, or HTTPS spoken to an HTTP port."""


class InsecureRegistryError(RegistryError):
    """Plain HTTP asked for a non-loopback registry without --plain-http."""

    exit_code = 2


class UploadError(RegistryError):
    """A blob upload failed in a way a retry of the same session cannot fix."""


class ManifestTooLargeError(RegistryError):
    """A manifest above the 4 MiB registries accept; refused before sending."""
