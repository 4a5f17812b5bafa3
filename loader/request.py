"""One options object for a load (``LoadRequest``): what to load it as, how far to trust it, where
to report — everything but the source.

``iter_tensors``, ``load_state_dict``, ``load_into`` and ``serving.full_shape.iter_full_shape``
take a ``LoadRequest`` and/or its fields as keywords (typed: ``LoadFields``, so a misspelt or
mistyped keyword is a type error, not a silent ``**kwargs: Any``). Keywords override the
request's fields::

    req = LoadRequest(tp_size=8, tp_rank=3, trusted_keys=[key], options=LoaderOptions(views="shard"))
    for name, t in iter_tensors(ref, req): ...
    sd = load_state_dict(ref, req, stats=stats)

The second positional argument may still be a device (``iter_tensors(src, "cuda:3", …)``), as
before the request existed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypedDict

import torch
from modelpack.loader.experts import ExpertLayout, ExpertMapLike, ExpertRulesLike
from modelpack.loader.fingerprint import FingerprintLike
from modelpack.loader.options import LoaderOptions, LoadStats
from modelpack.loader.plan import ReadPlan, RulesLike

from modelpack.events import EventLog

EventsLike = EventLog | str | None

if TYPE_CHECKING:
    from modelpack.signing.chunks import ChunkTable

    from modelpack.targets.options import TargetOptions


@dataclass(frozen=True)
class LoadRequest:
    """A load's parameters; ``replace(**fields)`` derives a variant."""

    device: str | torch.device | None = None  # None: "cpu" (``load_into``: the module's device)
    tp_size: int = 1
    tp_rank: int = 0
    rules: RulesLike = None  # shard rules searched in tensor names, before the presets
    presets: bool = True
    # expert parallelism (experts.py): this rank holds the routed experts the map gives ep_rank,
    # whole; the rest follows tp_size/tp_rank. With a group, EP rank r must be TP rank r % tp_size.
    ep_size: int = 1
    ep_rank: int = 0
    expert_map: ExpertMapLike = "linear"  # "linear" | "round_robin" | one rank per expert
    expert_rules: ExpertRulesLike = None  # expert rules searched in tensor names, before the presets
    expert_presets: bool = True
    expected_digest: str | None = None  # the pinned manifest digest
    # the artifact's weight layout: "canonical" (whole tensors, sliced per rank) or "sharded_state"
    # (vLLM's per-rank files: each rank reads its own files whole); any other artifact is refused
    layout: str = "canonical"
    fingerprint: FingerprintLike | None = None  # compatibility fingerprint that must match
    trusted_keys: Sequence[Any] | None = None  # keys whose signed chunk table verifies chunks
    chunk_table: ChunkTable | None = None  # verified against (instead of finding a signed one)
    target_options: TargetOptions | None = None  # for a reference string
    allow_unverified: bool = False  # serve a plain directory (no digest, nothing pinned)
    progress: str = "off"
    events: EventsLike = None  # EventLog or path for the loader.* events
    start_id: str | None = None  # groups a pull's and a load's events (default $MODELPACK_START_ID)
    state: str | None = None  # the events' state (default: hit / streamed / local)
    options: LoaderOptions = field(default_factory=LoaderOptions)  # tuning: threads, views, group, …
    stats: LoadStats | None = None  # filled in place while the load runs
    out: Mapping[str, torch.Tensor] | None = None  # caller-owned destinations, filled in place
    on_plan: Callable[[ReadPlan], None] | None = None  # called with the plan before any data read

    @property
    def experts(self) -> ExpertLayout:
        return ExpertLayout(
            self.ep_size, self.ep_rank, self.expert_map, self.expert_rules, self.expert_presets
        )

    def replace(self, **changes: Any) -> LoadRequest:
        return dataclasses.replace(self, **changes)

    @classmethod
    def of(cls, request: LoadRequest | str | torch.device | None, fields: Mapping[str, Any]) -> LoadRequest:
        """``request`` (or a device given in its place) with ``fields`` on top; unknown keys refused."""
        base = request if isinstance(request, LoadRequest) else cls()
        changes = dict(fields)
        if isinstance(request, (str, torch.device)):
            changes.setdefault("device", request)
        if changes.get("options") is None:
            changes.pop("options", None)
        unknown = set(changes) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise TypeError(f"unknown load parameters: {sorted(unknown)}")
        return dataclasses.replace(base, **changes) if changes else base


class LoadFields(TypedDict, total=False):
    """``LoadRequest``'s fields as keywords (``**kwargs: Unpack[LoadFields]``)."""

    device: str | torch.device | None
    tp_size: int
    tp_rank: int
    rules: RulesLike
    presets: bool
    ep_size: int
    ep_rank: int
    expert_map: ExpertMapLike
    expert_rules: ExpertRulesLike
    expert_presets: bool
    expected_digest: str | None
    layout: str
    fingerprint: FingerprintLike | None
    trusted_keys: Sequence[Any] | None
    chunk_table: ChunkTable | None
    target_options: TargetOptions | None
    allow_unverified: bool
    progress: str
    events: EventsLike
    start_id: str | None
    state: str | None
    options: LoaderOptions | None
    stats: LoadStats | None
    out: Mapping[str, torch.Tensor] | None
    on_plan: Callable[[ReadPlan], None] | None


__all__ = ["EventsLike", "LoadFields", "LoadRequest"]
