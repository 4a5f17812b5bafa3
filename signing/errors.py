"""Typed errors of the trust layer. Each names the reference, digest or file a person must look at."""

from __future__ import annotations

from modelpack.errors import DigestMismatchError, ModelpackError


class SigningError(ModelpackError):
    """Signing could not be done (no writable target, unsupported artifact, …)."""


class KeyLoadError(ModelpackError):
    """A key file or environment value that is missing, malformed, encrypted without a passphrase,
    or not an ECDSA P-256 key."""


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
