"""A load of vLLM's ``sharded_state`` layout: check the artifact's layout, keep only this rank's files.

A sharded_state artifact holds, per tensor-parallel rank, that rank's own state dict (vLLM's
parameter names, already split) in ``model-rank-R-part-P.safetensors`` files. A rank needs exactly
its own files, whole, and nothing of any other rank's — not even their headers — so the selection
runs right after the source is resolved and before a single header is read; each kept file is
then verified as any other (trusted store blob, signed chunk table, or whole-layer digest).

What is checked, and why (the manifest and its annotations come from whoever pushed it):

- the layout the caller asked for (``canonical`` by default) is the artifact's
  (``dev.modelpack.variant.layout``), else ``LayoutMismatchError`` naming both: a canonical load
  of rank files would hand every rank every rank's tensors; a sharded_state load of canonical
  files would hand vLLM checkpoint names it cannot copy;
- the rank files are complete and unambiguous (``mediatypes.sharded_state``: strict names, ranks
  0..N-1 all present), the manifest's ``tp-size`` is that N, and every rank file's layer
  annotation names the rank its file name does — a manifest lying about either is refused
  (``ShardedStateError``), never resolved in favour of one of them;
- the engine's TP size is the artifact's (``TpSizeMismatchError`` naming both).

A plain directory (``--allow-unverified``) has no manifest: its layout comes from the file names.
"""

from __future__ import annotations

import re

from modelpack.loader.weight_files import ResolvedSource
from modelpack.mediatypes.sharded_state import ShardedStateLayout, declared_rank, sharded_state_layout
from modelpack.mediatypes.variants import (
    ANNOTATION_VARIANT_LAYOUT,
    ANNOTATION_VARIANT_TP_SIZE,
    LAYOUT_CANONICAL,
    LAYOUT_SHARDED_STATE,
    LAYOUTS,
)

from modelpack.errors import LayoutMismatchError, LoaderError, ShardedStateError, TpSizeMismatchError

#: the plan rule for a sharded_state load: every tensor of the rank's files is read whole
REPLICATE_ALL: tuple[tuple[str, str], ...] = (("", "replicate"),)
_TP_SIZE = re.compile(r"[1-9][0-9]{0,5}\Z")


def check_layout_name(layout: str) -> str:
    if layout not in LAYOUTS:
        raise LoaderError(f"unknown layout {layout!r}: use one of {', '.join(LAYOUTS)}")
    return layout


def artifact_layout(src: ResolvedSource) -> str:
    """What the artifact says it is: the manifest's layout annotation (canonical when absent), or,
    for a plain directory, sharded_state when its weight files are rank files."""
    if src.manifest is None:
        found = sharded_state_layout([f.relpath for f in src.files], where=src.name)
        return LAYOUT_SHARDED_STATE if found is not None else LAYOUT_CANONICAL
    value = (src.manifest.annotations or {}).get(ANNOTATION_VARIANT_LAYOUT, LAYOUT_CANONICAL)
    if value not in LAYOUTS:
        raise ShardedStateError(
            f"{src.name}: manifest annotation {ANNOTATION_VARIANT_LAYOUT} is {value[:40]!r}, not one of "
            f"{', '.join(LAYOUTS)}; refusing the load"
        )
    return value


def select_rank_files(
    src: ResolvedSource, layout: str, tp_size: int, tp_rank: int
) -> ShardedStateLayout | None:
    """Refuse a layout other than ``layout``; for sharded_state keep only rank ``tp_rank``'s files in
    ``src.files`` (in place) and return the checked layout. Nothing is read here."""
    check_layout_name(layout)
    found = artifact_layout(src)
    if found != layout:
        raise LayoutMismatchError(layout, found, source=src.name)
    if layout != LAYOUT_SHARDED_STATE:
        return None
    ranks = sharded_state_layout([f.relpath for f in src.files], where=src.name)
    if ranks is None:
        raise ShardedStateError(
            f"{src.name}: declares layout sharded_state but has no model-rank-*-part-*.safetensors files"
        )
    if src.manifest is not None:
        _check_manifest_agrees(src, ranks)
    if ranks.tp_size != tp_size:
        raise TpSizeMismatchError(ranks.tp_size, tp_size, source=src.name)
    if not 0 <= tp_rank < tp_size:
        raise LoaderError(f"tp_rank {tp_rank} is outside 0..{tp_size - 1}")
    src.files = [f for f in src.files if ranks.rank_of(f.relpath) == tp_rank]
    return ranks


def _check_manifest_agrees(src: ResolvedSource, ranks: ShardedStateLayout) -> None:
    """The manifest's tp-size and each layer's rank annotation say what the file names say."""
    assert src.manifest is not None
    declared = (src.manifest.annotations or {}).get(ANNOTATION_VARIANT_TP_SIZE)
    if declared is None or not _TP_SIZE.match(declared):
        raise ShardedStateError(
            f"{src.name}: a sharded_state manifest needs {ANNOTATION_VARIANT_TP_SIZE} (a positive integer), "
            f"got {declared if declared is None else declared[:40]!r}; refusing the load"
        )
    if int(declared) != ranks.tp_size:
        raise ShardedStateError(
            f"{src.name}: manifest annotation {ANNOTATION_VARIANT_TP_SIZE} says {declared}, but the rank files "
            f"are for ranks 0..{ranks.tp_size - 1} (tensor-parallel size {ranks.tp_size}); refusing the load"
        )
    for f in src.files:
        by_name = ranks.rank_of(f.relpath)
        annotations = f.descriptor.annotations if f.descriptor is not None else None
        by_annotation = declared_rank(annotations, f.relpath, where=src.name)
        if by_annotation != by_name:
            raise ShardedStateError(
                f"{src.name}: layer {f.relpath!r} is annotated as rank {by_annotation}, its file name says "
                f"rank {by_name}; refusing the load",
                file=f.relpath,
            )


__all__ = ["REPLICATE_ALL", "artifact_layout", "check_layout_name", "select_rank_files"]
