"""Errors of the places an artifact lives: OCI layout, registry (and its mirrors), S3."""

from __future__ import annotations

from modelpack.errors.base import ModelpackError, NotFoundError
from modelpack.exit_codes import ExitCode


class LayoutError(ModelpackError):
    pass


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


class RangeListError(ModelpackError, ValueError):
    """Blob ranges a caller asked for that cannot be served as asked: out of order, overlapping,
    negative, or with destination views of another length (a bug in the caller, not the source)."""


class ListingCutError(RegistryError):
    """A tag or catalog listing stopped at its page bound: the registry kept linking to more
    pages (``Link: rel=next``) than any real listing needs. ``listed`` items came before it."""

    def __init__(self, message: str, *, target: str = "", listed: int = 0) -> None:
        super().__init__(message, target=target)
        self.listed = listed


class RegistryNotFoundError(RegistryError, NotFoundError):
    """A repository, tag, manifest or blob the registry does not have (404 / *_UNKNOWN)."""


class AuthenticationError(RegistryError):
    """401: no credentials, wrong credentials, or a token the registry refused."""


class PermissionDeniedError(RegistryError):
    """403 / DENIED: authenticated, but not allowed (e.g. push to a read-only repository)."""


class RegistryConnectionError(RegistryError):
    """The registry could not be reached (refused, reset, timed out).

    ``failure`` names why for the source events (``stall``: no answer in time;
    ``connection_refused``; ``connection``: anything else), decided where the transport error was
    seen, so nobody has to search the message (whose host, port and digest hold digits)."""

    failure = "connection"

    def __init__(self, message: str, *, target: str = "", failure: str = "connection") -> None:
        super().__init__(message, target=target)
        self.failure = failure


class MirrorTooSlowError(RegistryConnectionError):
    """A mirror or peer delivered less than its throughput floor over a window (it trickles)."""

    def __init__(self, message: str, *, target: str = "") -> None:
        super().__init__(message, target=target, failure="floor")


class RegistryTLSError(RegistryConnectionError):
    """TLS failed: unknown CA (pass --ca-file), wrong host name, or HTTPS spoken to an HTTP port."""


class InsecureRegistryError(RegistryError):
    """Plain HTTP asked for a non-loopback registry without --plain-http."""

    exit_code = ExitCode.USAGE


class UploadError(RegistryError):
    """A blob upload failed in a way a retry of the same session cannot fix."""


class UploadSourceError(ModelpackError):
    """Reading the local bytes of an upload failed (a disk error, a file that went away).

    Deliberately not a ``RegistryError``: asking the registry again cannot fix a source that
    cannot be read, so the upload fails at once instead of spending the retry budget."""


class ManifestTooLargeError(RegistryError):
    """A manifest above the 4 MiB registries accept; refused before sending."""


class MirrorConfigError(RegistryError):
    """A mirror list that cannot be used: a ``hosts.toml`` that does not parse, a mirror URL with
    a path prefix modelpack cannot address; ``target`` names the file or the flag at fault."""

    exit_code = ExitCode.USAGE


class S3Error(ModelpackError):
    """An S3 request failed; names the operation, the object (``s3://bucket/key``) and S3's code."""

    def __init__(
        self, message: str, *, operation: str = "", key: str = "", code: str = "", status: int = 0
    ) -> None:
        super().__init__(message)
        self.operation = operation
        self.key = key
        self.code = code
        self.status = status


class S3LayoutError(S3Error):
    """The prefix holds something that is not a usable OCI layout (bad oci-layout, bad index)."""
