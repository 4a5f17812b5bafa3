"""Full-shape CPU tensors in which only this tensor-parallel rank's slice was read and filled.

vLLM's weight loaders take checkpoint-shaped tensors and ``narrow`` them to the rank's part
(``ColumnParallelLinear``: output rows, ``RowParallelLinear``: input columns, vocab-parallel
embeddings: rows); the merged q/k/v and gate/up parameters narrow each checkpoint tensor the same
way. So a rank can read only its slice and still hand vLLM the shape it expects: the rest of the
tensor is allocated but never read, never written and never looked at.

- ``dim0`` slices are rows ``[b, e)`` of a contiguous tensor, itself contiguous: the loader reads
  straight into that view of the full tensor (its ``out=`` destinations), no copy;
- ``dim1`` slices are strided: the loader gathers the rank's columns into a shard tensor, which is
  copied into the full tensor's column slice (the only extra copy, 1/TP of those bytes);
- replicated tensors are read whole and passed through;
- with ``LoaderOptions(views="full")``, every tensor of a node-cache store blob trusted by inode
  is a view of the mapped blob, whole (``loader.mapped``): passed through, no allocation and no
  read here, vLLM's ``narrow`` + ``copy_`` is the only pass over those bytes, as with its default
  loader.

Tensors are allocated lazily, one file at a time as the loader reaches it, and this module keeps
no reference once a tensor is handed over, so memory holds about one file's share at a time (the
unread parts of a large allocation are untouched pages).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, Unpack

import torch

from modelpack.loader import LoadFields, LoadRequest, ReadPlan, ShardRule, iter_tensors
from modelpack.loader.dtypes import torch_dtype
from modelpack.loader.plan import TensorRead


class RowSliceDestinations(Mapping[str, torch.Tensor]):
    """The loader's ``out=`` mapping: for each sharded ``dim0`` tensor, rows ``[b, e)`` of a fresh
    full-shape tensor, allocated when the loader first asks for it (that is, per file); and the
    engine's own parameter memory for the tensors ``into`` placed there."""

    def __init__(
        self,
        into: Callable[[ReadPlan], Mapping[str, torch.Tensor]] | None = None,
        device: torch.device = torch.device("cpu"),
    ) -> None:
        self.device = device
        self._plan: ReadPlan | None = None
        self._reads: dict[str, TensorRead] = {}
        self._into = into
        self.direct: Mapping[str, torch.Tensor] = {}
        self.full: dict[str, torch.Tensor] = {}

    def set_plan(self, plan: ReadPlan) -> None:
        self._plan = plan
        self._reads = {t.name: t for t in plan.tensors if t.rule is ShardRule.DIM0 and t.sharded}
        if self._into is not None:
            self.direct = self._into(plan)

    def __contains__(self, name: object) -> bool:
        return name in self.direct or name in self._reads

    def __getitem__(self, name: str) -> torch.Tensor:
        direct = self.direct.get(name)
        if direct is not None:
            return direct
        t = self._reads[name]
        full = self.full.get(name)
        if full is None:
            dt = torch_dtype(t.dtype, where=f"{t.file}: {name}")
            full = torch.empty(t.full_shape, dtype=dt, device=self.device)
            self.full[name] = full
        return t.select(full)  # this rank's rows, as the plan computed them (scales: block rows)

    def __iter__(self) -> Iterator[str]:
        return iter({**dict.fromkeys(self.direct), **dict.fromkeys(self._reads)})

    def __len__(self) -> int:
        return len(set(self.direct) | set(self._reads))

    def take(self, name: str) -> torch.Tensor | None:
        """The full tensor behind a handed-over slice; forgotten here so its memory can go."""
        self._reads.pop(name, None)
        return self.full.pop(name, None)


def iter_full_shape(
    source: Any,
    request: LoadRequest | None = None,
    /,
    into: Callable[[ReadPlan], Mapping[str, torch.Tensor]] | None = None,
    **fields: Unpack[LoadFields],
) -> Iterator[tuple[str, torch.Tensor]]:
    """``iter_tensors`` for the request's rank, yielding checkpoint-shaped tensors on the request's
    device (CPU by default; a GPU when the destinations ``into`` names are GPU parameters).

    Only the rank's slice of each sharded tensor holds data. The request (or its fields as
    keywords) says what to load, as for ``iter_tensors``; ``out`` is this
    function's own, and a caller ``on_plan`` runs after the destinations learned the plan.
    ``into(plan)``, called before any data is read, names whole tensors to read straight into
    memory the caller owns (the engine's parameters, ``param_destinations.py``); they are yielded
    as those tensors.
    """
    req = LoadRequest.of(request, fields)
    device = torch.device(req.device if req.device is not None else "cpu")
    dests = RowSliceDestinations(into, device)
    caller_on_plan = req.on_plan
    reads: dict[str, TensorRead] = {}

    def on_plan(plan: ReadPlan) -> None:
        dests.set_plan(plan)
        reads.update((t.name, t) for t in plan.tensors)
        if caller_on_plan is not None:
            caller_on_plan(plan)

    it = iter_tensors(source, req.replace(device=device, out=dests, on_plan=on_plan))
    try:
        for name, shard in it:
            full = dests.take(name)
            if full is not None:  # dim0: the loader filled the view of this full tensor in place
                del shard
                yield name, full
                continue
            t = reads[name]
            if tuple(shard.shape) == t.full_shape:  # whole (replicated, or a view of a mapped blob)
                yield name, shard
                continue
            if t.rule is ShardRule.DIM1 and t.sharded:
                full = torch.empty(t.full_shape, dtype=shard.dtype, device=shard.device)
                t.select(full).copy_(shard)
                del shard
                yield name, full
                continue
            yield name, shard
    finally:
        it.close()
        dests.full.clear()
        dests.direct = {}
