"""vLLM's ``sharded_state`` layout as an artifact: which file belongs to which tensor-parallel rank.

vLLM's ``save_sharded_state`` (``ShardedStateLoader.save_model``) writes each TP rank's own state
dict — vLLM's parameter names, already split for that rank — as
``model-rank-{rank}-part-{part}.safetensors`` at the top of the model directory, and its
``--load-format sharded_state`` globs ``model-rank-{its rank}-part-*.safetensors`` there. A packed
sharded_state artifact records that on the manifest (``dev.modelpack.variant.layout:
sharded_state``, ``dev.modelpack.variant.tp-size: N``, keys of ``variants.py``) and on every rank
file's layer (``dev.modelpack.sharded-state.rank: R``), so a reader learns each layer's rank
without trusting a glob.

Who controls the names: whoever made the checkpoint (packing) and whoever pushed the manifest
(loading). A rank is therefore derived only from a name that matches the strict pattern below —
decimal without leading zeros, top-level, exactly vLLM's spelling — and a name that merely looks
like a rank file (``model-rank-01-part-0``, ``Model-Rank-0-…``, ``model-rank-0-part-0.safetensors``
in a subdirectory, vLLM's pipeline-parallel ``model-pp-…-tp-…`` names) is refused rather than
guessed: two readers must never disagree on which rank a file is for. This module is the contract
only (pattern, keys, the completeness rule); no I/O.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from modelpack.mediatypes.annotations import PROJECT_PREFIX
from modelpack.mediatypes.variants import (
    ANNOTATION_VARIANT_LAYOUT,
    ANNOTATION_VARIANT_TP_SIZE,
    LAYOUT_SHARDED_STATE,
)

from modelpack.errors import MissingRankError, ShardedStateError

#: on each rank file's layer: the TP rank (decimal) the file belongs to
ANNOTATION_SHARDED_STATE_RANK = PROJECT_PREFIX + "sharded-state.rank"
#: ranks and parts are decimal without leading zeros (vLLM formats ints), bounded
MAX_TP_SIZE = 100_000
_RANK_FILE = re.compile(r"model-rank-(0|[1-9][0-9]{0,4})-part-(0|[1-9][0-9]{0,5})\.safetensors\Z")
#: names a reader could take for a rank file (case-folded); anything of this shape must match exactly
_LOOKS_LIKE = ("model-rank-", "model-pp-")
_RANK_VALUE = re.compile(r"(0|[1-9][0-9]{0,4})\Z")


@dataclass(frozen=True)
class RankFile:
    """One ``model-rank-R-part-P.safetensors`` file of a sharded_state checkpoint."""

    path: str
    rank: int
    part: int


def looks_like_rank_file(relpath: str) -> bool:
    """Whether a reader could take ``relpath`` for a rank file: its base name, case-folded, starts
    like one and names safetensors (``model-rank-0-part-0.safetensors.bak`` too)."""
    name = posixpath.basename(relpath).lower()
    return name.startswith(_LOOKS_LIKE) and ".safetensors" in name


def parse_rank_file(relpath: str, *, where: str = "checkpoint") -> RankFile | None:
    """The rank file ``relpath`` names, None for a file that is not one, ShardedStateError for a
    name that looks like one but is not exactly vLLM's top-level spelling (ambiguous)."""
    m = _RANK_FILE.match(relpath)
    if m:
        return RankFile(relpath, int(m.group(1)), int(m.group(2)))
    if not looks_like_rank_file(relpath):
        return None
    if posixpath.basename(relpath).lower().startswith("model-pp-"):
        reason = "a pipeline-parallel sharded_state file (model-pp-…-tp-…); only tensor-parallel files are supported"
    elif "/" in relpath:
        reason = "a rank file below the top level (vLLM reads model-rank-* files only next to config.json)"
    else:
        reason = (
            "not exactly model-rank-<rank>-part-<part>.safetensors (decimal, no leading zeros, lower case)"
        )
    raise ShardedStateError(
        f"{where}: {relpath!r} is {reason}; refusing an ambiguous rank file", file=relpath
    )


@dataclass(frozen=True)
class ShardedStateLayout:
    """The rank files of a complete sharded_state checkpoint: ranks ``0 .. tp_size-1`` all present."""

    tp_size: int
    files: tuple[RankFile, ...]

    def rank_of(self, relpath: str) -> int | None:
        for f in self.files:
            if f.path == relpath:
                return f.rank
        return None

    def files_of(self, rank: int) -> list[RankFile]:
        return sorted((f for f in self.files if f.rank == rank), key=lambda f: f.part)

    def manifest_annotations(self) -> dict[str, str]:
        return {
            ANNOTATION_VARIANT_LAYOUT: LAYOUT_SHARDED_STATE,
            ANNOTATION_VARIANT_TP_SIZE: str(self.tp_size),
        }

    def layer_annotations(self, relpath: str) -> dict[str, str]:
        rank = self.rank_of(relpath)
        return {} if rank is None else {ANNOTATION_SHARDED_STATE_RANK: str(rank)}


def sharded_state_layout(relpaths: Iterable[str], *, where: str = "checkpoint") -> ShardedStateLayout | None:
    """The layout of a file list: None when no file is (or looks like) a rank file; otherwise every
    safetensors file must be a rank file and ranks 0..N-1 must all be there (N = highest rank + 1)."""
    weights = [p for p in relpaths if p.endswith(".safetensors") or looks_like_rank_file(p)]
    ranked = [(p, parse_rank_file(p, where=where)) for p in weights]
    files = [f for _, f in ranked if f is not None]
    if not files:
        return None
    others = sorted(p for p, f in ranked if f is None)
    if others:
        raise ShardedStateError(
            f"{where}: sharded_state rank files mixed with other weight files {others[:5]}; which layout "
            "is meant is ambiguous (vLLM's sharded_state loader would ignore them, the canonical loaders "
            "would ignore the rank files); pack the two layouts separately",
            file=others[0],
        )
    ranks = {f.rank for f in files}
    tp_size = max(ranks) + 1
    if tp_size > MAX_TP_SIZE:  # pragma: no cover - the pattern bounds ranks to 5 digits
        raise ShardedStateError(f"{where}: rank {tp_size - 1} is above the limit {MAX_TP_SIZE - 1}")
    missing = sorted(set(range(tp_size)) - ranks)
    if missing:
        raise MissingRankError(where, missing[0], tp_size)
    return ShardedStateLayout(tp_size, tuple(sorted(files, key=lambda f: (f.rank, f.part))))


def declared_rank(annotations: Mapping[str, str] | None, relpath: str, *, where: str) -> int:
    """The rank a layer's ``dev.modelpack.sharded-state.rank`` annotation declares, checked."""
    value = (annotations or {}).get(ANNOTATION_SHARDED_STATE_RANK)
    if value is None:
        raise ShardedStateError(
            f"{where}: layer {relpath!r} has no {ANNOTATION_SHARDED_STATE_RANK} annotation; a sharded_state "
            "artifact names every rank file's rank",
            file=relpath,
        )
    if not isinstance(value, str) or not _RANK_VALUE.match(value):
        raise ShardedStateError(
            f"{where}: layer {relpath!r}: {ANNOTATION_SHARDED_STATE_RANK} {value[:40]!r} is not a rank number",
            file=relpath,
        )
    return int(value)


__all__ = [
    "ANNOTATION_SHARDED_STATE_RANK",
    "MAX_TP_SIZE",
    "RankFile",
    "ShardedStateLayout",
    "declared_rank",
    "looks_like_rank_file",
    "parse_rank_file",
    "sharded_state_layout",
]
