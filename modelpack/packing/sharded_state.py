"""Packing a vLLM ``sharded_state`` checkpoint (per-rank files from ``save_sharded_state``) as a variant.

Recognised from the file names alone, wherever the checkpoint lives (a directory, S3, the HF
cache): a checkpoint whose weight files are ``model-rank-R-part-P.safetensors`` is packed as
today — one raw weight layer per file, same digests — and the manifest says what it is
(``dev.modelpack.variant.layout: sharded_state``, ``dev.modelpack.variant.tp-size: N``) while each
rank file's layer carries its rank (``dev.modelpack.sharded-state.rank``). The naming contract and
its strictness are in ``modelpack.mediatypes.sharded_state``.

Checked here, before anything is hashed into an artifact, because a broken sharded_state
checkpoint fails only at load time inside vLLM, on every replica: ranks 0..N-1 all present
(``MissingRankError`` names the first missing one); no tensor twice within one rank (vLLM's
loader pops each parameter once, so a second copy is a ``KeyError`` mid-load); every rank holding
the same tensor names (files of two different saves mixed in one directory).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from modelpack.errors import ShardedStateError
from modelpack.mediatypes.sharded_state import ShardedStateLayout, sharded_state_layout
from modelpack.packing.safetensors_format import SafetensorsHeader


def describe_sharded_state(
    relpaths: Sequence[str], headers: Mapping[str, SafetensorsHeader], *, where: str
) -> ShardedStateLayout | None:
    """The checkpoint's sharded_state layout, checked against its headers; None for any other layout."""
    layout = sharded_state_layout(relpaths, where=where)
    if layout is None:
        return None
    names_of: dict[int, set[str]] = {}
    for rank in range(layout.tp_size):
        seen: dict[str, str] = {}
        for f in layout.files_of(rank):
            header = headers.get(f.path)
            if header is None:  # pragma: no cover - every .safetensors file's header is read first
                raise ShardedStateError(f"{where}: {f.path}: no safetensors header was read", file=f.path)
            for t in header.tensors:
                if t.name in seen:
                    raise ShardedStateError(
                        f"{where}: tensor {t.name!r} of rank {rank} is in both {seen[t.name]} and {f.path}; "
                        "vLLM's sharded_state loader takes each parameter once",
                        file=f.path,
                    )
                seen[t.name] = f.path
        names_of[rank] = set(seen)
    for rank in range(1, layout.tp_size):
        if names_of[rank] != names_of[0]:
            only = sorted(names_of[rank] ^ names_of[0])
            raise ShardedStateError(
                f"{where}: rank {rank}'s tensors differ from rank 0's ({len(only)} names, e.g. {only[:3]}); "
                "the rank files come from different saves",
                file=layout.files_of(rank)[0].path,
            )
    return layout


__all__ = ["describe_sharded_state"]
