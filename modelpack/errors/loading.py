"""Errors of the streaming loader."""

from __future__ import annotations

from collections.abc import Sequence

from modelpack.errors.base import DigestMismatchError, ModelpackError


class LoaderError(ModelpackError):
    """Base of every refusal or failure of the streaming loader."""


class GroupStalledError(LoaderError):
    """A rank of the loading process group made no progress within the group's deadline (it
    hangs, or was stopped, but stays alive): named, so the operator knows which pod to look at."""


class CacheFillStalledError(LoaderError):
    """A streamed load that fills the node cache waited for a blob's bytes and the fill (this
    process's or another's) made no progress within the deadline: names the blob and the cache."""


class PlanError(LoaderError, ValueError):
    """The tensor-parallel read plan cannot be built (bad rule, uneven split, duplicate tensor)."""


class SourceError(LoaderError):
    """The load source cannot be opened or does not describe a model (no weights, bad snapshot)."""


class UnverifiedSourceError(LoaderError):
    """The bytes could not be tied to a verified manifest digest; serving them is refused."""


class UnpinnedReferenceError(LoaderError):
    """A remote load without a pinned manifest digest: a tag could move between two ranks."""


class ExpectedDigestError(LoaderError, DigestMismatchError):
    """The source holds a different manifest than the digest the caller pinned."""

    def __init__(self, expected: str, actual: str, *, source: str = "") -> None:
        DigestMismatchError.__init__(self, expected, actual, what="manifest", source=source)


class TruncatedSourceError(LoaderError):
    """A file or blob ended before the bytes its header (or manifest) promised."""

    def __init__(self, source: str, offset: int, wanted: int, got: int) -> None:
        super().__init__(
            f"{source}: truncated: wanted {wanted} bytes at offset {offset}, got {got}; refusing the load"
        )
        self.source = source
        self.offset = offset


class UnsupportedDtypeError(LoaderError):
    """A safetensors dtype torch cannot represent (sub-byte floats F4/F6 for now)."""


class FingerprintMismatchError(LoaderError):
    """The compatibility fingerprint differs from the expected one; lists every differing field."""

    def __init__(self, fields: Sequence[tuple[str, object, object]], *, where: str = "") -> None:
        self.fields = [f for f, _, _ in fields]
        self.details = list(fields)
        parts = [f"{name}: expected {exp!r}, got {act!r}" for name, exp, act in fields]
        at = f" ({where})" if where else ""
        super().__init__(
            f"compatibility fingerprint mismatch{at}: " + "; ".join(parts) + "; refusing the load"
        )


class FingerprintFileError(LoaderError):
    """A recorded fingerprint file that is missing, oversized or malformed."""


class TimelineError(LoaderError):
    """An event log that cannot be read (missing, oversized, not JSON lines)."""


class HeaderMismatchError(LoaderError):
    """The safetensors header the load was planned from is not the header inside the bytes that
    matched the layer digest: the source served different bytes for the same range (a forged
    header). Names the file and the layer; nothing placed by that header is kept."""

    def __init__(self, file: str, layer_digest: str, *, source: str = "") -> None:
        where = f" from {source}" if source else ""
        super().__init__(
            f"{file} (layer {layer_digest}){where}: the header read to plan the load differs from the "
            "header inside the bytes that matched the layer digest; the source served different bytes "
            "for the same range. Refusing the load"
        )
        self.file = file
        self.layer_digest = layer_digest


class UnsignedSourceError(LoaderError):
    """Trusted keys were given, but part of the model is not covered by anything they signed (no
    chunk-table referrer, or one that skips a weight layer): the load is refused instead of
    falling back to unsigned checks. ``files`` names what is not covered."""

    def __init__(self, message: str, files: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.files = list(files)


class LayoutMismatchError(LoaderError):
    """The artifact's weight layout (``dev.modelpack.variant.layout``: ``canonical`` or
    ``sharded_state``) is not the one the load asked for; names both and the source."""

    def __init__(self, requested: str, found: str, *, source: str = "") -> None:
        at = f"{source}: " if source else ""
        super().__init__(
            f"{at}the artifact's layout is {found!r}, the load asked for {requested!r}; refusing the load "
            f"(ask for layout {found!r} to load it, or pick the {requested!r} variant)"
        )
        self.requested = requested
        self.found = found


class TpSizeMismatchError(LoaderError):
    """A ``sharded_state`` artifact pre-split for one tensor-parallel size, loaded by an engine
    running another: each rank's files hold exactly that rank's part, so no other size can use them."""

    def __init__(self, artifact_tp_size: int, engine_tp_size: int, *, source: str = "") -> None:
        at = f"{source}: " if source else ""
        super().__init__(
            f"{at}sharded_state artifact is split for tensor-parallel size {artifact_tp_size}, the engine "
            f"runs tensor-parallel size {engine_tp_size}; refusing the load (start the engine with "
            f"--tensor-parallel-size {artifact_tp_size}, or load the canonical variant)"
        )
        self.artifact_tp_size = artifact_tp_size
        self.engine_tp_size = engine_tp_size
