"""Errors of signing, verification and trust policy."""

from __future__ import annotations

from modelpack.errors.base import DigestMismatchError, ModelpackError
from modelpack.exit_codes import ExitCode


class SigningError(ModelpackError):
    """Signing could not be done (no writable target, unsupported artifact, …)."""


class KeyLoadError(ModelpackError):
    """A key file or environment value that is missing, malformed, encrypted without a passphrase,
    or not an ECDSA P-256 key."""


class KeyTextArgumentError(KeyLoadError):
    """A private key's PEM text given where a key source belongs (``--key``, ``--sign-key``): an
    argument is readable by every local user in ``/proc/PID/cmdline``, so it is refused unread."""

    exit_code = ExitCode.USAGE


class BundleError(ModelpackError):
    """A Sigstore bundle, DSSE envelope or in-toto statement that cannot be parsed."""


class SignatureRefused(ModelpackError):
    """Verification refused the artifact: the reason says which check failed.

    Raised only after the refusal was written as an event (``signing.refused``), so a failed
    start can be located from the event log alone.
    """

    def __init__(self, reference: str, digest: str, reason: str) -> None:
        super().__init__(f"{reference} ({digest}): signature verification refused: {reason}")
        self.reference = reference
        self.digest = digest
        self.reason = reason


class DirectorySignatureError(SignatureRefused):
    """A materialised model directory does not match its signed file list."""


class RollbackRefused(SignatureRefused):
    """A tag names a version signed earlier than one this node cache already accepted for it
    (a rollback, or a replay of an old signed version): both digests and signing times are
    named. ``pull --allow-rollback`` accepts it; pulling by digest is not a tag pull."""

    def __init__(
        self, reference: str, digest: str, signed_at: str, newest_digest: str, newest_signed_at: str
    ) -> None:
        super().__init__(
            reference,
            digest,
            f"rollback: {digest} was signed {signed_at}, before {newest_digest} (signed "
            f"{newest_signed_at}), which this node cache already accepted for the tag; "
            "pull with --allow-rollback to accept the older version",
        )
        self.signed_at = signed_at
        self.newest_digest = newest_digest
        self.newest_signed_at = newest_signed_at


class TagHistoryError(SignatureRefused):
    """The node cache's record of a tag's newest signed version cannot be trusted (another uid's
    file, writable by others, malformed): the bar it sets is unknown, so the tag pull is refused."""


class ChunkTableError(ModelpackError):
    """A chunk-digest table referrer exists but is unsigned by a trusted key, bound to another
    manifest, or malformed. Never silently ignored: a loader would otherwise fall back to trusting
    ranges it cannot check."""


class ChunkDigestMismatch(DigestMismatchError):
    """One chunk of a weight layer did not hash to its signed chunk digest."""

    def __init__(
        self, layer_digest: str, index: int, expected: str, actual: str, *, source: str = ""
    ) -> None:
        super().__init__(expected, actual, what=f"layer {layer_digest} chunk {index}", source=source)
        self.layer_digest = layer_digest
        self.index = index


class PolicyError(ModelpackError):
    """A policy file that cannot be read or is malformed (names the file and the field)."""

    exit_code = ExitCode.USAGE
