"""Which node each rank of a process group runs on, and what each node read.

Expert parallelism over several nodes: the ranks of a group fill nodes in order of their global
rank, ``LoaderOptions.local_world_size`` at a time (0: torchrun's ``LOCAL_WORLD_SIZE``; unset
there too: the whole group is one node). ``shared_read.chunk_owners`` gives a chunk several ranks
need to a rank on a node that needs it, so a node reads only chunks one of its own ranks needs:
the experts its ranks hold, its part of the replicated tensors. After the load,
the ranks exchange their byte counts (one all-gather of integers) so every rank reports its
node's total and every node's (``shared_read.read_by_node``; ``LoadStats.node_bytes_read``,
``bytes_read_by_node``, the ``loader.read_done`` event).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from modelpack.errors import LoaderError

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["node_size", "nodes_of", "totals_by_node"]


def node_size(local_world_size: int, environ: Mapping[str, str] = os.environ) -> int:
    """Ranks per node: ``local_world_size``, else torchrun's ``LOCAL_WORLD_SIZE``, else 0 (one node)."""
    if local_world_size:
        return local_world_size
    raw = environ.get("LOCAL_WORLD_SIZE", "")
    try:
        value = int(raw) if raw else 0
    except ValueError:
        raise LoaderError(f"LOCAL_WORLD_SIZE={raw!r} is not a number of ranks per node") from None
    if value < 0:
        raise LoaderError(f"LOCAL_WORLD_SIZE={raw!r} is not a number of ranks per node")
    return value


def nodes_of(group: ProcessGroup | None, per_node: int) -> list[int]:
    """The node of each rank of ``group`` (by group rank): its global rank // ``per_node``."""
    import torch.distributed as dist

    size = dist.get_world_size(group)
    if per_node <= 0:
        return [0] * size
    if group is None:  # the default group: its ranks are the global ranks
        return [r // per_node for r in range(size)]
    return [dist.get_global_rank(group, r) // per_node for r in range(size)]


def totals_by_node(nodes: Sequence[int], counts: Sequence[int]) -> list[int]:
    """The sum of ``counts`` (one per rank) over the ranks of each node, nodes in ascending order."""
    ids = sorted(set(nodes))
    totals = [0] * len(ids)
    for node, count in zip(nodes, counts, strict=True):
        totals[ids.index(node)] += count
    return totals
