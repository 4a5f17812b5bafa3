"""The root of the hierarchy, errors every layer shares, and the contract's (mediatypes)."""

from __future__ import annotations

from modelpack.exit_codes import ExitCode


class ModelpackError(Exception):
    """Base of every error modelpack raises on purpose; the CLI maps it to exit code 1."""

    exit_code: int = ExitCode.FAILURE


class InvalidReferenceError(ModelpackError, ValueError):
    """A reference string that cannot be parsed (``host/repo:tag``, ``oci:DIR:TAG``, ``s3://…``)."""

    exit_code = ExitCode.USAGE


class InvalidDigestError(ModelpackError, ValueError):
    """A digest string that is not ``sha256:<64 lowercase hex>``."""

    exit_code = ExitCode.USAGE


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


class ShardedStateError(ModelpackError, ValueError):
    """A vLLM ``sharded_state`` checkpoint (per-rank ``model-rank-R-part-P.safetensors`` files) whose
    ranks cannot be told exactly: a name that looks like a rank file but is not one, rank files
    mixed with other weight files, a missing rank, or annotations that disagree with the file names.
    ``file`` names the file at fault when there is one."""

    def __init__(self, message: str, *, file: str | None = None) -> None:
        super().__init__(message)
        self.file = file


class MissingRankError(ShardedStateError):
    """Rank files for ranks above ``rank`` exist but ``rank`` has none: the checkpoint is incomplete."""

    def __init__(self, where: str, rank: int, tp_size: int) -> None:
        super().__init__(
            f"{where}: sharded_state rank {rank} has no model-rank-{rank}-part-*.safetensors file, but "
            f"files up to rank {tp_size - 1} exist (a tensor-parallel size of {tp_size} needs ranks "
            f"0..{tp_size - 1}); refusing an incomplete checkpoint"
        )
        self.rank = rank
        self.tp_size = tp_size


class ModelfileError(PackError):
    """A Modelfile (modctl's format) that cannot be used: too large, an unknown command, bad
    quoting, a glob leaving the context directory. Names the file and, when known, the line (1-based)."""

    def __init__(self, path: str, message: str, *, line: int | None = None) -> None:
        super().__init__(f"{path}:{line}: {message}" if line is not None else f"{path}: {message}")
        self.path = path
        self.line = line


class HFSourceError(PackError):
    """An ``hf://ORG/NAME[@REVISION]`` source that cannot be packed: a bad repository id or revision,
    huggingface_hub missing, or a cache entry that is not what huggingface_hub writes (a symlink out of
    the cache's ``blobs/``). ``repo_id`` and ``revision`` name it; both are data, escaped when printed."""

    def __init__(self, message: str, *, repo_id: str = "", revision: str | None = None) -> None:
        super().__init__(message)
        self.repo_id = repo_id
        self.revision = revision


class HFRevisionNotFoundError(HFSourceError):
    """The revision is not in the Hugging Face cache and the Hub may not be asked (``HF_HUB_OFFLINE``),
    or the Hub does not have it."""


class UnsafePathError(ModelpackError, ValueError):
    """A path from an untrusted manifest or checkpoint would escape its directory."""


class SettingsError(ModelpackError, ValueError):
    """An environment setting (``MODELPACK_*``) that cannot be used: malformed, or empty where
    emptiness would switch a protection off. ``name`` is the variable; a secret's value is never
    part of the message. Exit code 2, like any other setting a command cannot start with."""

    exit_code = 2

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(f"${name}: {reason}")
        self.name = name


class FileSelectionError(ModelpackError, ValueError):
    """``--include``/``--exclude`` patterns beyond their bounds (count, length). A usage error."""

    exit_code = 2


class ConfigError(ModelpackError, ValueError):
    """A model config that breaks the ModelPack schema; ``path`` is the JSON path at fault."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"model config {path}: {message}")
        self.path = path


class VariantIndexError(ManifestError):
    """An index of variants (or a ``--variant KEY=VALUE``) that breaks the variant rules: too many
    entries, an oversized or unprintable annotation, a nested index, an entry that is not a
    ModelPack manifest. Names the index digest and the entry."""


class VariantSelectionError(ModelpackError):
    """No entry of an index fits this node, or several fit equally: never a silent pick.

    ``reasons`` maps each entry (``#i sha256:…``) to the fields that did not match (empty for
    the tied candidates); ``candidates`` lists the entries that tied."""

    def __init__(
        self,
        message: str,
        *,
        index: str,
        reasons: dict[str, list[str]] | None = None,
        candidates: list[str] | None = None,
    ) -> None:
        super().__init__(message)
        self.index = index
        self.reasons = reasons or {}
        self.candidates = candidates or []
