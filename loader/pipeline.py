"""The loader's public API: prepare a load, then stream its tensors (``iter_tensors``) or collect them.

A load runs plan → read (worker threads) → verify → stage → device, handing tensors over as they
land; ``read_paths`` says which path each file takes and ``engine`` holds the shared machinery.

Safeguards: the manifest digest is pinned (``expected_digest``), the compatibility fingerprint is
checked before any data is read, and a failure at any point raises after waiting for in-flight
reads and copies: ``load_state_dict`` then returns nothing and ``load_into`` leaves the module
untouched (it loads into fresh tensors and swaps them in at the end).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Unpack

import torch
from modelpack.loader.dtypes import torch_dtype
from modelpack.loader.engine import LoadEngine
from modelpack.loader.experts import ExpertLayout
from modelpack.loader.fingerprint import (
    Fingerprint,
    check_fingerprint,
    device_arch,
    rank_layout_digest,
)
from modelpack.loader.headers import ChunkFetcher, VerifiedChunks, read_header
from modelpack.loader.options import LoaderOptions, LoadStats
from modelpack.loader.plan import ReadPlan, RulesLike, group_position
from modelpack.loader.read_paths import run
from modelpack.loader.readers import RangeReader
from modelpack.loader.request import EventsLike, LoadFields, LoadRequest
from modelpack.loader.sharded_state import REPLICATE_ALL, check_layout_name, select_rank_files
from modelpack.loader.shared_read import (
    check_group,
    check_sources,
    peer_plans,
    read_by_node,
    read_header_shared,
)
from modelpack.loader.sources import resolve_source
from modelpack.loader.weight_files import ResolvedSource
from modelpack.mediatypes.variants import LAYOUT_CANONICAL, LAYOUT_SHARDED_STATE

from modelpack.errors import LoaderError, PlanError, SizeMismatchError
from modelpack.events import EventLog, NullEventLog
from modelpack.packing.safetensors_format import SafetensorsHeader
from modelpack.settings import resolve_start_id

if TYPE_CHECKING:
    from modelpack.signing.chunks import ChunkTable

    from modelpack.targets.options import TargetOptions


def _event_log(events: EventsLike) -> EventLog:
    if events is None:
        return NullEventLog()
    if isinstance(events, str):
        return EventLog(events)
    return events


@dataclass
class PreparedLoad:
    """A resolved source with its headers, plan and fingerprint — everything short of reading data."""

    source: ResolvedSource
    headers: dict[str, SafetensorsHeader]
    plan: ReadPlan
    fingerprint: Fingerprint
    readers: dict[str, RangeReader]
    # the bytes each header was parsed from: the whole-layer path checks them against the digest
    header_bytes: dict[str, bytes] = field(default_factory=dict)
    # chunks verified while reading headers, handed to the data pass so each is fetched once
    verified: VerifiedChunks | None = None
    # every rank's plan, when the ranks share reads over LoaderOptions.group
    peers: list[ReadPlan] = field(default_factory=list)

    def close(self) -> None:
        if self.verified is not None:
            self.verified.clear()
        for r in self.readers.values():
            r.close()
        self.source.close()


def prepare(
    source: Any,
    *,
    device: str | torch.device = "cpu",
    tp_size: int = 1,
    tp_rank: int = 0,
    rules: RulesLike = None,
    presets: bool = True,
    expected_digest: str | None = None,
    trusted_keys: Sequence[Any] | None = None,
    chunk_table: ChunkTable | None = None,
    target_options: TargetOptions | None = None,
    allow_unverified: bool = False,
    options: LoaderOptions | None = None,
    layout: str = LAYOUT_CANONICAL,
    experts: ExpertLayout | None = None,
) -> PreparedLoad:
    """Resolve the source, read (and verify, where a table exists) the headers, plan this rank.

    ``layout="sharded_state"``: only this rank's rank files are kept (``sharded_state.py``), before
    any header is read, and each is planned whole; the ranks read disjoint files, so there are no
    shared reads (``options.group`` is not used).

    ``experts``: the expert-parallel layout; with a group, the group holds the EP ranks in order
    (group rank = EP rank) and EP rank r is TP rank r % tp_size."""
    opts = options or LoaderOptions()
    check_layout_name(layout)
    ep = experts or ExpertLayout()
    ep.check()
    if ep.ep_size > 1 and layout == LAYOUT_SHARDED_STATE:
        raise PlanError(
            f"--ep-size {ep.ep_size}: a sharded_state artifact holds whole per-rank files; expert "
            "parallelism needs the canonical layout"
        )
    group_size, group_rank = group_position(tp_size, tp_rank, ep.ep_size, ep.ep_rank, opts.group is not None)
    if layout == LAYOUT_SHARDED_STATE:
        rules, presets = REPLICATE_ALL, False
        opts = dataclasses.replace(opts, group=None)
    opts.check()
    src = resolve_source(
        source,
        expected_digest=expected_digest,
        chunk_table=chunk_table,
        trusted_keys=trusted_keys,
        target_options=target_options,
        allow_unverified=allow_unverified,
        allow_missing_chunk_table=opts.allow_missing_chunk_table,
        direct=opts.direct_io,
        variant=opts.variant,
        share=tp_size > 1 or ep.ep_size > 1,
    )
    readers: dict[str, RangeReader] = {}
    verified = VerifiedChunks(opts.verified_chunk_cache_bytes)
    try:
        select_rank_files(src, layout, tp_size, tp_rank)
        if not src.files:
            raise LoaderError(f"{src.name}: the model has no safetensors weight files")
        headers: dict[str, SafetensorsHeader] = {}
        header_bytes: dict[str, bytes] = {}
        if opts.group is not None:
            check_sources(opts.group, src, group_size, group_rank)
        # plan order (the plan sorts files by path): the chunk budget goes to the files read first
        for i, f in enumerate(sorted(src.files, key=lambda f: f.relpath)):
            reader = f.open()
            readers[f.relpath] = reader
            if f.size >= 0 and reader.size != f.size:
                raise SizeMismatchError(
                    str(f.descriptor.digest) if f.descriptor else f.relpath,
                    f.size,
                    reader.size,
                    source=src.name,
                )
            name = f"{src.name}/{f.relpath}"
            if f.mode == "chunks" and opts.group is not None:  # one rank reads it, the others verify
                headers[f.relpath], header_bytes[f.relpath] = read_header_shared(
                    opts.group, i, f, reader, verified, name
                )
                continue
            verify = ChunkFetcher(reader, f, verified) if f.mode == "chunks" else None
            headers[f.relpath], header_bytes[f.relpath] = read_header(reader, name, reader.size, verify)

        def build(tp_r: int, ep_r: int) -> ReadPlan:
            return ReadPlan.build(
                headers,
                tp_size,
                tp_r,
                rules,
                presets=presets,
                uneven=opts.uneven,
                experts=dataclasses.replace(ep, ep_rank=ep_r),
                config=src.config,
            )

        plan = build(tp_rank, ep.ep_rank)
        dev = torch.device(device)
        for t in plan.tensors:
            torch_dtype(t.dtype, where=f"{t.file}: tensor {t.name!r}")
        fp = Fingerprint(
            manifest_digest=src.digest or "",
            dtype=",".join(sorted({t.dtype for t in plan.tensors})),
            quantization=src.quantization,
            tp_size=tp_size,
            tp_rank=tp_rank,
            rank_layout=rank_layout_digest({t.name: (t.rule.value, t.shape) for t in plan.tensors}),
            device_arch=device_arch(dev),
        )
        peers: list[ReadPlan] = []
        if opts.group is not None:
            check_group(opts.group, plan, src, opts.local_world_size)
            peers = peer_plans(plan, lambda r: build(r % tp_size, r) if ep.ep_size > 1 else build(r, 0))
        return PreparedLoad(src, headers, plan, fp, readers, header_bytes, verified, peers)
    except BaseException:
        verified.clear()
        for r in readers.values():
            r.close()
        src.close()
        raise


def iter_tensors(
    source: Any,
    request: LoadRequest | str | torch.device | None = None,
    /,
    **fields: Unpack[LoadFields],
) -> Generator[tuple[str, torch.Tensor], None, None]:
    """Yield ``(name, tensor)`` for this rank's shard of every tensor, as each one lands.

    ``source``: a snapshot directory, ``(NodeCache, ref)``, ``(ReadableTarget, ref)`` or a reference
    string. A remote reference must be pinned (``expected_digest`` or ``@sha256:…``). What to load
    and how: a ``LoadRequest`` and/or its fields as keywords (``request.py``); the second
    positional argument may be a device instead. If the load fails the iterator raises; tensors
    already yielded must then be discarded by the caller (``load_state_dict`` and ``load_into`` do
    that for you). ``out`` maps names to caller-owned destinations to fill in place (no
    allocation; on failure their content is undefined).
    """
    req = LoadRequest.of(request, fields)
    device: str | torch.device = req.device if req.device is not None else "cpu"
    tp_size, tp_rank, expected_digest, state = req.tp_size, req.tp_rank, req.expected_digest, req.state
    options, stats, out, on_plan, fingerprint = req.options, req.stats, req.out, req.on_plan, req.fingerprint
    opts = options or LoaderOptions()
    if req.layout == LAYOUT_SHARDED_STATE and opts.group is not None:
        opts = dataclasses.replace(opts, group=None)  # each rank reads its own files: nothing to share
    st = stats if stats is not None else LoadStats()
    # one start = one id across the node cache's and the loader's events (the k8s recipes set
    # MODELPACK_START_ID to the pod UID in both containers)
    st.start_id = resolve_start_id(req.start_id)
    log = _event_log(req.events)
    try:
        prep = prepare(
            source,
            device=device,
            tp_size=tp_size,
            tp_rank=tp_rank,
            rules=req.rules,
            presets=req.presets,
            expected_digest=expected_digest,
            trusted_keys=req.trusted_keys,
            chunk_table=req.chunk_table,
            target_options=req.target_options,
            allow_unverified=req.allow_unverified,
            options=opts,
            layout=req.layout,
            experts=req.experts,
        )
    except BaseException as exc:
        log.emit(
            "loader.refused",
            start_id=st.start_id,
            state=state,
            reference=source if isinstance(source, str) else type(source).__name__,
            digest=expected_digest,
            reason=f"{type(exc).__name__}: {exc}"[:2000],
        )
        raise
    st.reference = prep.source.name
    st.digest = prep.source.digest
    st.state = state or prep.source.state
    st.fingerprint = prep.fingerprint
    st.plan = prep.plan
    st.bytes_to_read = prep.plan.bytes_to_read
    st.verification = {f.relpath: f.verification or f.mode for f in prep.source.files}
    for event, notice in prep.source.notices:
        log.emit(
            event,
            start_id=st.start_id,
            state=st.state,
            reference=prep.source.name,
            digest=prep.source.digest,
            **notice,
        )
    if st.state == "streamed":
        # no node cache said "version confirmed" for this start: the pinned manifest (and its
        # chunk table) just resolved and verified here is that point
        log.emit(
            "loader.version_confirmed",
            stage="t2",
            start_id=st.start_id,
            state=st.state,
            reference=prep.source.name,
            digest=prep.source.digest,
        )
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    load: LoadEngine | None = None
    try:
        if fingerprint is not None:
            check_fingerprint(fingerprint, prep.fingerprint)
        if on_plan is not None:
            on_plan(prep.plan)
        load = LoadEngine(prep.source, prep.plan, dev, opts, st, log, out, req.progress)
        load.readers = prep.readers
        load.header_bytes = prep.header_bytes
        load.verified = prep.verified
        load.peers = prep.peers
        if opts.group is not None and prep.peers:
            group, per_node = opts.group, opts.local_world_size
            load.count_nodes = lambda n: read_by_node(group, per_node, n)
        load.setup()
        try:
            for idx in run(load):
                yield load.hand_over(idx)
            load.finish()
        except GeneratorExit:
            load.abort(None)  # the consumer stopped early: not a failure, but nothing more lands
            raise
        except BaseException as exc:
            load.abort(exc)
            raise
    except BaseException as exc:
        if load is None:
            log.emit(
                "loader.refused",
                start_id=st.start_id,
                state=st.state,
                reference=prep.source.name,
                digest=prep.source.digest,
                reason=f"{type(exc).__name__}: {exc}"[:2000],
            )
        raise
    finally:
        if load is not None:
            load.close()
        prep.close()


def load_state_dict(
    source: Any,
    request: LoadRequest | str | torch.device | None = None,
    /,
    **fields: Unpack[LoadFields],
) -> dict[str, torch.Tensor]:
    """All of this rank's tensors, or an exception and nothing: the dict exists only on success."""
    result: dict[str, torch.Tensor] = {}
    try:
        for name, tensor in iter_tensors(source, LoadRequest.of(request, fields)):
            result[name] = tensor
    except BaseException:
        result.clear()
        raise
    return result


def load_into(
    module: torch.nn.Module,
    source: Any,
    request: LoadRequest | str | torch.device | None = None,
    /,
    *,
    strict: bool = True,
    **fields: Unpack[LoadFields],
) -> LoadStats:
    """Load this rank's weights into ``module``: fresh tensors first, one swap at the end.

    Shapes and dtypes are checked against the module before any data is read, so a mismatch
    refuses the load without touching the module; a failure while reading leaves it untouched.
    The device defaults to the module's.
    """
    req = LoadRequest.of(request, fields)
    device = req.device
    if device is None:
        try:
            device = next(module.parameters()).device
        except StopIteration:
            device = "cpu"
    stats = req.stats or LoadStats()
    expected = module.state_dict()
    caller_on_plan = req.on_plan

    def on_plan(plan: ReadPlan) -> None:
        _check_against_module(plan, expected, strict)
        if caller_on_plan is not None:
            caller_on_plan(plan)

    tensors: dict[str, torch.Tensor] = {}
    try:
        for name, tensor in iter_tensors(source, req.replace(device=device, stats=stats, on_plan=on_plan)):
            tensors[name] = tensor
    except BaseException:
        tensors.clear()
        raise
    missing, unexpected = module.load_state_dict(tensors, strict=strict, assign=True)
    del missing, unexpected
    return stats


def _check_against_module(plan: ReadPlan | None, expected: Mapping[str, torch.Tensor], strict: bool) -> None:
    if plan is None:
        return
    problems = []
    names = set()
    for t in plan.tensors:
        names.add(t.name)
        e = expected.get(t.name)
        if e is None:
            if strict:
                problems.append(f"{t.name}: not in the module")
            continue
        if tuple(e.shape) != t.shape:
            problems.append(f"{t.name}: module has {tuple(e.shape)}, the checkpoint shard is {t.shape}")
        elif e.dtype != torch_dtype(t.dtype):
            problems.append(f"{t.name}: module has {e.dtype}, the checkpoint has {t.dtype}")
    if strict:
        problems.extend(f"{n}: missing from the checkpoint" for n in sorted(set(expected) - names))
    if problems:
        raise LoaderError("checkpoint does not fit the module: " + "; ".join(problems[:20]))


def emit_check(
    events: EventsLike,
    *,
    start_id: str,
    digest: str | None,
    passed: bool,
    duration_ms: float | None = None,
    **fields: Any,
) -> None:
    """Record the t9 point (first deterministic check after the load) for ``modelpack timeline``."""
    _event_log(events).emit(
        "loader.check",
        stage="t9" if passed else None,
        start_id=start_id,
        digest=digest,
        passed=passed,
        duration_ms=duration_ms,
        **fields,
    )


__all__ = [
    "EventsLike",
    "LoadFields",
    "LoadRequest",
    "PreparedLoad",
    "emit_check",
    "iter_tensors",
    "load_into",
    "load_state_dict",
    "prepare",
]
