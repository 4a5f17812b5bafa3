"""Typed errors. Each carries the reference, digest, file or status a person needs to act."""

from __future__ import annotations

from collections.abc import Sequence


class ModelpackError(Exception):
    """Base of every error modelpack raises on purpose; the CLI maps it to exit code 1."""

    exit_code = 1


class InvalidReferenceError(ModelpackError, ValueError):
    """A reference string that cannot be parsed (``host/repo:tag``, ``oci:DIR:TAG``, ``s3://…``)."""

    exit_code = 2


class InvalidDigestError(ModelpackError, ValueError):
    """A digest string that is not ``sha256:<64 lowercase hex>``."""

    exit_code = 2


class DigestMismatchError(ModelpackError):
    """Content did not hash to the digest (or size) it was addressed by. Always fatal."""

    def __init__(self, expected: str, actual: str, *, what: str = "blob", source: str = "") -> None:
        where = f" from {source}" if source else ""
        super().__init__(f"{what}{where}: expected {expected}, got {actual}; refusing it")
        self.expected = expected
        self.actual = actual
        self.source = source


class SizeMismatchError(ModelpackError):
    def __init__(self, digest: str, expected: int, actual: int, *, source: str = "") -> None:
        where = f" from {source}" if source else ""
        super().__init__(f"blob {digest}{where}: expected {expected} bytes, got {actual}; refusing it")
        self.digest = digest
        self.expected = expected
        self.actual = actual


class NotFoundError(ModelpackError):
    """A tag, manifest or blob that the target does not have."""


class ManifestError(ModelpackError, ValueError):
    """A manifest or index that is malformed, too large or of an unsupported media type."""


class DocumentError(ModelpackError, ValueError):
    """A JSON document from outside that is too large, too deep, not UTF-8/JSON or has duplicate
    keys; ``what`` names the document (e.g. ``manifest sha256:…``, ``referrer …``, a file path)."""

    def __init__(self, what: str, reason: str) -> None:
        super().__init__(f"{what}: {reason}; refusing it")
        self.what = what
        self.reason = reason


class PackError(ModelpackError):
    """The checkpoint directory cannot be packed (bad file, escaping symlink, empty, …)."""


class SafetensorsError(PackError):
    """A safetensors file that breaks the format rules; names the file and, when known, the tensor."""

    def __init__(self, path: str, message: str, *, tensor: str | None = None) -> None:
        where = f"{path}: tensor {tensor!r}: " if tensor else f"{path}: "
        super().__init__(where + message)
        self.path = path
        self.tensor = tensor


class UnsafePathError(ModelpackError, ValueError):
    """A path from an untrusted manifest or checkpoint would escape its directory."""


# --- The contract (mediatypes) -----------------------------------------------------------------


class ConfigError(ModelpackError, ValueError):
    """A model config that breaks the ModelPack schema; ``path`` is the JSON path at fault."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"model config {path}: {message}")
        self.path = path


# --- Targets: OCI layout, registry, S3 ---------------------------------------------------------


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
    """The registry could not be reached (refused, reset, timed out)."""


class MirrorTooSlowError(RegistryConnectionError):
    """A mirror or peer delivered less than its throughput floor over a window (it trickles)."""


class RegistryTLSError(RegistryConnectionError):
    """TLS failed: unknown CA (pass --ca-file), wrong host name, or HTTPS spoken to an HTTP port."""


class InsecureRegistryError(RegistryError):
    """Plain HTTP asked for a non-loopback registry without --plain-http."""

    exit_code = 2


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

    exit_code = 2


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


# --- Packing and transfer ----------------------------------------------------------------------


class UnsafeTarError(ModelpackError):
    """A layer tar holds a link, device, absolute/escaping path or duplicate; names the member."""


class UnsupportedLayerError(ModelpackError):
    """A layer whose media type/format this build cannot turn into files."""


class PullError(ModelpackError):
    """The artifact cannot be materialised (no file path, two layers for one path, …)."""


class ExpansionLimitError(UnsafeTarError):
    """A tar layer would write more than this pull may (``--max-bytes``, free space, the cache
    quota): counted from the members' declared sizes before a byte of them is written."""

    def __init__(self, where: str, member: str, declared: int, left: int, limit: str) -> None:
        super().__init__(
            f"{where}: member {member!r} declares {declared} bytes but only {left} bytes are left "
            f"of {limit}; refusing the layer (a decompression bomb, or raise the limit)"
        )
        self.member = member
        self.declared = declared
        self.left = left


class LayerFormatError(UnsafeTarError):
    """A layer blob that is not a readable tar: corrupt compression, malformed headers, a truncated
    stream or data after the end of the archive."""


class DestinationConflictError(PullError):
    """Files at the destination differ from the artifact's; pull never overwrites them without
    ``--force``. ``conflicts`` are paths relative to the destination."""

    def __init__(self, dest: str, conflicts: list[str], *, extra: str = "") -> None:
        more = f" and {len(conflicts) - 10} more" if len(conflicts) > 10 else ""
        shown = ", ".join(conflicts[:10]) + more
        super().__init__(
            f"{dest}: {len(conflicts)} file(s) differ from the artifact's: {shown}; nothing was "
            f"overwritten. Pull into an empty directory, or pass --force to replace them{extra}"
        )
        self.dest = dest
        self.conflicts = conflicts


class FileWriteError(ModelpackError):
    """The operating system refused a write: a directory where a file goes (or a file where a
    directory goes), permissions, a read-only filesystem. Names the path."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


class DiskFullError(FileWriteError):
    """No space left (ENOSPC, EDQUOT) for a file being written; says what was kept for a resume."""


class TransferInterrupted(ModelpackError):
    """A transfer stopped on a signal (SIGTERM, SIGINT); its temp files were removed first."""

    def __init__(self, message: str, *, exit_code: int = 130) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class TransferCancelled(TransferInterrupted):
    """A part of a transfer stopped because a sibling failed or the whole was interrupted; never
    the error a person sees (the sibling's, or the signal, is raised instead)."""


class OutputClosedError(TransferInterrupted):
    """stdout/stderr was closed under us (``| head``): stop at once, like a process on SIGPIPE."""

    def __init__(self, message: str = "output closed") -> None:
        super().__init__(message, exit_code=141)


# --- Trust (signing) ---------------------------------------------------------------------------


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

    exit_code = 2


# --- Node cache (mount) ------------------------------------------------------------------------


class LockTimeoutError(ModelpackError):
    """A lock could not be taken in time; names the lock file and its last holder."""


class StoreError(ModelpackError):
    """The cache store is damaged or cannot be written."""


class CacheServeError(ModelpackError):
    """``cache serve`` cannot start: TLS files that do not load, an address that cannot be bound."""

    exit_code = 2


class SnapshotError(ModelpackError):
    """A snapshot cannot be built, published or used."""


class SnapshotInUseError(SnapshotError):
    """A reader holds the snapshot's lease; it cannot be removed now."""


class CacheError(ModelpackError):
    """A node-cache operation that cannot proceed; the message names the cache, reference or digest."""


class EventLogError(ModelpackError):
    """An event log file that cannot take events: a symlink, another user's file, a read-only or
    special file, a write that failed. Names the file."""


class InsufficientSpaceError(CacheError):
    """Not enough free space on the cache filesystem for the blobs still to download."""

    def __init__(self, root: str, needed: int, available: int, reserve: int) -> None:
        super().__init__(
            f"{root}: {needed} bytes to download but only {available} bytes free"
            + (f" ({reserve} reserved)" if reserve else "")
            + "; free space or run 'modelpack cache gc'"
        )
        self.needed = needed
        self.available = available


class QuotaExceededError(CacheError):
    def __init__(self, root: str, needed: int, used: int, quota: int) -> None:
        super().__init__(
            f"{root}: pulling needs {needed} more bytes; cache holds {used} of a {quota}-byte quota "
            "(--max-cache-bytes); run 'modelpack cache gc --max-bytes …' or raise the quota"
        )
        self.needed = needed
        self.used = used
        self.quota = quota


class K8sError(ModelpackError):
    """A Kubernetes object cannot be generated from the given inputs."""


class StorageInitializerError(ModelpackError):
    """KServe's storage initializer was started with argv pairs or settings it cannot use (an odd
    argument count, a setting that does not parse, a policy or docker config named but not
    mounted); names the argument or environment variable."""

    exit_code = 2


# --- Loader ------------------------------------------------------------------------------------


class LoaderError(ModelpackError):
    """Base of every refusal or failure of the streaming loader."""


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


# --- Runtime assets (compile caches as referrers of a model) -----------------------------------


class AssetError(ModelpackError):
    """A runtime asset (compile cache) that cannot be packed, pushed, listed or materialised; the
    message names the model reference, the asset kind and, when known, the asset's digest."""


class AssetKindError(AssetError, ValueError):
    """An asset kind nobody registered (``inductor``, ``triton``, ``vllm`` are built in)."""

    exit_code = 2


class AssetFingerprintError(AssetError):
    """An environment fingerprint (a ``--fingerprint`` file or a stored asset's record) that is
    missing, oversized, malformed, or whose recorded digest does not match its fields."""


class AssetRefused(AssetError):
    """No stored asset may be used for this start: the nearest one differs in ``fields`` or failed
    verification (``reason``). Raised only on request (``require_hit``); a plain pull reports the
    refusal as its state, writes an ``assets.refused`` event, and the start proceeds cold."""

    def __init__(
        self, model: str, kind: str, reason: str, *, asset_digest: str = "", fields: Sequence[str] = ()
    ) -> None:
        at = f" (asset {asset_digest})" if asset_digest else ""
        super().__init__(f"{model}: {kind} asset refused{at}: {reason}")
        self.model = model
        self.kind = kind
        self.reason = reason
        self.asset_digest = asset_digest
        self.fields = list(fields)


# --- Serving engines (the vLLM load format `modelpack`) ----------------------------------------


class ServingError(ModelpackError):
    """A serving engine cannot take its weights through modelpack; the message names the model
    directory or reference and the setting a person has to change."""


class ServingConfigError(ServingError, ValueError):
    """``--model-loader-extra-config`` (or the model directory it points at) is unusable: an unknown
    key, a wrong type, an unpinned source, or config/tokenizer files that are not the pinned
    artifact's."""

    exit_code = 2


class ReadinessError(ServingError):
    """The served model did not become ready (health endpoint) or its deterministic check did not
    return the expected tokens; names the URL and what was seen."""
