"""Which files an ``--include``/``--exclude`` pair keeps: one meaning for pack (every source),
pull and the KServe initializer's ``?include=``/``?exclude=``.

A pattern is a shell glob (``fnmatch``) matched against the relative ``/``-separated path or its
base name. Patterns come from whoever writes a pod spec or an InferenceService, so their number
and length are bounded where they enter (``check_patterns``): matching is then at most
``MAX_PATTERNS × MAX_PATTERN_CHARS`` work per file.
"""

from __future__ import annotations

import fnmatch
import posixpath
from collections.abc import Callable, Sequence

from modelpack.errors import FileSelectionError

MAX_PATTERNS = 256
MAX_PATTERN_CHARS = 1024


def check_patterns(
    include: Sequence[str], exclude: Sequence[str], *, names: tuple[str, str] = ("--include", "--exclude")
) -> None:
    """Refuse more than ``MAX_PATTERNS`` patterns of a kind, or one longer than
    ``MAX_PATTERN_CHARS`` or holding a NUL, naming the flag (``names``) that carried it."""
    for patterns, name in ((include, names[0]), (exclude, names[1])):
        if len(patterns) > MAX_PATTERNS:
            raise FileSelectionError(f"{name}: {len(patterns)} patterns; at most {MAX_PATTERNS} are accepted")
        for p in patterns:
            if len(p) > MAX_PATTERN_CHARS or "\x00" in p:
                raise FileSelectionError(
                    f"{name}: a pattern of {len(p)} characters (at most {MAX_PATTERN_CHARS}, no NUL)"
                )


def matches_pattern(relpath: str, patterns: Sequence[str]) -> bool:
    name = posixpath.basename(relpath)
    return any(fnmatch.fnmatchcase(relpath, p) or fnmatch.fnmatchcase(name, p) for p in patterns)


def file_selector(include: Sequence[str], exclude: Sequence[str]) -> Callable[[str], bool] | None:
    """Whether a file path (relative, ``/``-separated) is kept; None when everything is."""
    if not include and not exclude:
        return None

    def selected(relpath: str) -> bool:
        if include and not matches_pattern(relpath, include):
            return False
        return not (exclude and matches_pattern(relpath, exclude))

    return selected
