"""Errors of packing, pulling and writing files."""

from __future__ import annotations

from modelpack.errors.base import ModelpackError
from modelpack.exit_codes import ExitCode


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
    """A transfer stopped on a signal (SIGINT, SIGTERM, SIGHUP); its temp files were removed first
    and its partial downloads kept for the rerun to resume."""

    def __init__(self, message: str, *, exit_code: int = ExitCode.SIGINT) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class TransferCancelled(TransferInterrupted):
    """A part of a transfer stopped because a sibling failed or the whole was interrupted; never
    the error a person sees (the sibling's, or the signal, is raised instead)."""


class OutputClosedError(TransferInterrupted):
    """stdout/stderr was closed under us (``| head``): stop at once, like a process on SIGPIPE."""

    def __init__(self, message: str = "output closed") -> None:
        super().__init__(message, exit_code=ExitCode.OUTPUT_CLOSED)
