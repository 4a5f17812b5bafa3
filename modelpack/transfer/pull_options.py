"""``PullOptions``: what shapes a pull into a directory, as one value passed through.

The CLI builds it from its flags, ``modelpack.pull()`` from its keywords, the KServe initializer
from its URI's filters; ``transfer.materialize.pull_to_directory`` reads it. None of these
options decides WHAT may be fetched: that is ``mount.resolve.resolve_trusted``'s, before.
"""

from __future__ import annotations

from dataclasses import dataclass

from modelpack.file_selection import check_patterns


@dataclass(frozen=True)
class PullOptions:
    """How the files of one artifact are written into a destination directory."""

    #: only files matching one of these globs (empty: every file)
    include: tuple[str, ...] = ()
    #: skip files matching one of these globs
    exclude: tuple[str, ...] = ()
    #: concurrent blob downloads
    jobs: int = 4
    #: progress bars on stderr: auto (a terminal, never in CI) | on | off
    progress: str = "auto"
    #: replace a file in the destination that differs from the artifact's (else: refuse)
    force: bool = False
    #: remove files the artifact does not contain (else: list them)
    delete: bool = False
    #: write at most this many bytes, tar layers counted as they expand (None: the free space)
    max_bytes: int | None = None
    #: a container image's ``models/`` files stay under ``models/`` (else: at their paths below it)
    keep_prefix: bool = False

    def __post_init__(self) -> None:
        # tuples, so a caller's list cannot change the options afterwards (and they hash)
        object.__setattr__(self, "include", tuple(self.include))
        object.__setattr__(self, "exclude", tuple(self.exclude))
        check_patterns(self.include, self.exclude)

    @property
    def selects_files(self) -> bool:
        return bool(self.include or self.exclude)
