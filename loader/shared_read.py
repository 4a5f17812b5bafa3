"""Each byte read once per node: the ranks of a process group share the chunk-verified reads.

Without a group every tensor-parallel rank reads every chunk its shard touches, so column-split
(dim-1) and replicated tensors are fetched whole by every rank — TP times per node. With
``LoaderOptions(group=…)`` (a ``torch.distributed`` process group holding exactly the TP ranks,
group rank = TP rank) every rank plans every rank's shard from the same headers and the chunks
of each chunk-verified file are split:

- a chunk that only one rank needs (most of a dim-0 share) is read by that rank alone, as
  without a group;
- a chunk that several ranks need (dim-1 and replicated tensors, the boundary chunk of two dim-0
  shares) has one owner: the shared chunks of a file, in order, are cut into ``group size``
  contiguous runs, run ``r`` owned by rank ``r``. The owner reads and verifies it and
  broadcasts it over the group (gloo: host memory; NCCL: the device scratch buffer);
- the chunks holding a file's header are read and verified by one rank (files in turn) and
  broadcast before planning; every rank verifies them and keeps them for the data pass, so
  they are never exchanged again.

So a rank reads its own share plus 1/TP of the shared chunks, and the node reads every needed
chunk once. Every rank **verifies every chunk it receives** against the signed table before using
any byte (a peer is not a trust root), so a broken or hostile peer costs a
``ChunkDigestMismatch``, never a wrong tensor. A read that fails at its owner is broadcast as a
failure (one status byte after the data), so every rank raises instead of waiting.

Every rank must load the same source with the same plan options: the first collective compares
a digest of the source (manifest digest, files, their modes and chunk sizes), a later one of the
plan (TP size, rules), across the group, and refuses a mismatch on every rank. Only tensors cross
the group (digests, chunk bytes, status bytes): nothing a peer sends is unpickled.

A rank that is killed, refuses or exits fails the others at once (its connections close). One
that stops but stays alive (a hang, SIGSTOP, a consumer that broke off, a failure outside a
shared read) would hold them in the backend's collective for its own timeout (30 minutes): every
collective here waits at most the group's progress deadline (``MODELPACK_GROUP_PROGRESS_TIMEOUT``,
120 s) and then raises ``GroupStalledError`` naming the rank it waited for (gloo's monitored
barrier names the missing ranks before the first exchange; a broadcast names its owner). Files
that are not chunk-verified (trusted snapshot files, whole-layer hashing) are read as without a
group.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import re
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from modelpack.loader.blocks import SpanIndex
from modelpack.loader.chunked import needed_chunks, read_chunked
from modelpack.loader.device_copier import Slot
from modelpack.loader.engine import LoadEngine
from modelpack.loader.headers import ChunkFetcher, VerifiedChunks, read_header
from modelpack.loader.nodes import node_size, nodes_of, totals_by_node
from modelpack.loader.plan import FilePlan, ReadPlan
from modelpack.loader.readers import RangeReader
from modelpack.loader.weight_files import ResolvedSource, WeightFile

from modelpack import settings
from modelpack.errors import GroupStalledError, LoaderError
from modelpack.packing.safetensors_format import SafetensorsHeader

if TYPE_CHECKING:
    from modelpack.signing.chunks import ChunkTable
    from torch.distributed import ProcessGroup

OK, FAILED = 1, 0
#: how long a rank waits for the group's next step when MODELPACK_GROUP_PROGRESS_TIMEOUT is unset
DEFAULT_GROUP_PROGRESS_S = 120.0


def progress_deadline() -> float:
    """Seconds a collective may wait for the other ranks (``MODELPACK_GROUP_PROGRESS_TIMEOUT``)."""
    return settings.GROUP_PROGRESS_TIMEOUT.get() or DEFAULT_GROUP_PROGRESS_S


def _stalled(what: str, waited_for: str, seconds: float, detail: str) -> GroupStalledError:
    return GroupStalledError(
        f"LoaderOptions.group: {waited_for} made no progress for {seconds:g} s during {what} "
        f"(alive but hung or stopped?; {settings.GROUP_PROGRESS_TIMEOUT.name} sets the limit): {detail}"
    )


def _finish(work: Any, what: str, waited_for: str) -> None:
    """Wait for an async collective at most the progress deadline."""
    seconds = progress_deadline()
    try:
        done = work.wait(timeout=datetime.timedelta(seconds=seconds))
    except RuntimeError as exc:  # gloo: "Timed out …" / "Application timeout caused pair closure"
        raise _stalled(what, waited_for, seconds, str(exc).splitlines()[0][:300]) from None
    if done is False:
        raise _stalled(what, waited_for, seconds, "the collective did not complete")


def _all_present(group: Any, what: str) -> None:
    """gloo: every rank reaches this point within the deadline, else name the ranks that did not
    (a monitored barrier; NCCL has none, its collectives are bounded by ``_finish`` alone)."""
    import torch.distributed as dist

    if dist.get_backend(group) != "gloo":
        return
    seconds = progress_deadline()
    try:
        dist.monitored_barrier(group, timeout=datetime.timedelta(seconds=seconds), wait_all_ranks=True)
    except RuntimeError as exc:
        text = str(exc)
        found = re.search(r"Ranks? ([0-9][0-9, ]*) failed", text)
        who = f"rank {found.group(1).strip()}" if found else "a rank of the group"
        raise _stalled(what, who, seconds, text.splitlines()[0][:300]) from None


def _broadcast(tensor: torch.Tensor, src: int, group: Any, what: str) -> None:
    import torch.distributed as dist

    _finish(dist.broadcast(tensor, src=src, group=group, async_op=True), what, f"rank {src} (its owner)")


def _comm_device(group: Any) -> torch.device:
    import torch.distributed as dist

    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _agree(group: Any, doc: Any, what: str) -> None:
    """Every rank holds the same ``doc`` (compared as sha256 digests: tensors, never pickles — a
    peer's bytes are data, not code), else ``LoaderError`` on every rank."""
    import torch.distributed as dist

    size = dist.get_world_size(group)
    digest = hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).digest()
    dev = _comm_device(group)
    mine = torch.frombuffer(bytearray(digest), dtype=torch.uint8).to(dev)
    everyone = [torch.empty(32, dtype=torch.uint8, device=dev) for _ in range(size)]
    _all_present(group, f"the check of {what}")
    _finish(dist.all_gather(everyone, mine, group=group, async_op=True), f"the check of {what}", "a rank")
    odd = [r for r, d in enumerate(everyone) if not torch.equal(d, everyone[0])]
    if odd:
        raise LoaderError(
            f"LoaderOptions.group: ranks {odd} load {what} different from rank 0's "
            "(digest, files, chunk tables and shard rules must be the same on every rank)"
        )


def check_sources(group: Any, src: ResolvedSource, tp_size: int, tp_rank: int) -> None:
    """Before any collective read: the group is exactly the TP ranks (with expert parallelism, the
    EP ranks: ``tp_size``/``tp_rank`` are then the EP size and rank), all loading the same files."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise LoaderError("LoaderOptions.group: torch.distributed is not initialized")
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if size != tp_size or rank != tp_rank:
        raise LoaderError(
            f"LoaderOptions.group has {size} ranks and this process is rank {rank}; the load is rank "
            f"{tp_rank} of --tp-size {tp_size} (or --ep-size, with expert parallelism): the group must "
            "hold exactly the TP ranks (or EP ranks) in order"
        )
    files = sorted(
        (
            f.relpath,
            f.mode,
            f.chunks.chunk_size if f.mode == "chunks" else 0,
            f.chunks.aligned if f.mode == "chunks" else False,
            f.size,
        )
        for f in src.files
    )
    _agree(group, {"digest": src.digest, "files": files}, "a source")


def check_group(group: Any, plan: ReadPlan, src: ResolvedSource, local_world_size: int) -> None:
    """After planning: every rank planned with the same rules and the same ranks per node (so
    every rank's view of who needs which chunk, who reads it, and so the order and roots of the
    broadcasts, is the same)."""
    _agree(
        group,
        {
            "tp": plan.tp_size,
            "ep": plan.ep_size,
            "rules": plan.rules_digest,
            "uneven": plan.uneven,
            "ranks_per_node": node_size(local_world_size),
        },
        "a plan",
    )


def read_header_shared(
    group: Any, index: int, f: WeightFile, reader: RangeReader, keep: VerifiedChunks, name: str
) -> tuple[SafetensorsHeader, bytes]:
    """A chunk-verified file's header, its chunks read once per group: rank ``index % size``
    reads and verifies them and broadcasts them; every other rank verifies what it received
    before parsing it (and keeps them for the data pass, as for a header it read itself)."""
    import torch.distributed as dist

    size, me = dist.get_world_size(group), dist.get_rank(group)
    owner = index % size
    src_rank = dist.get_global_rank(group, owner)
    fetcher = ChunkFetcher(reader, f, keep)
    dev = _comm_device(group)
    result: tuple[SafetensorsHeader, bytes] | None = None
    failure: BaseException | None = None
    payload = b""
    count = 0
    if me == owner:
        try:
            result = read_header(reader, name, reader.size, fetcher)
            seen = fetcher.seen
            count = max(seen) + 1 if seen else 0
            if sorted(seen) != list(range(count)):  # pragma: no cover - headers start at byte 0
                raise LoaderError(f"{name}: header chunks {sorted(seen)} are not a prefix of the file")
            payload = b"".join(bytes(seen[i]) for i in range(count))
        except BaseException as exc:
            failure = exc
    meta = torch.tensor([0 if failure else OK, count, len(payload)], dtype=torch.int64, device=dev)
    _broadcast(meta, src_rank, group, f"the header of {name}")
    status, count, total = (int(x) for x in meta.tolist())
    data = torch.empty(total, dtype=torch.uint8, device=dev)
    if me == owner and total:
        data.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    if status == OK:
        _broadcast(data, src_rank, group, f"the header of {name}")
    if me == owner:
        if failure is not None:
            raise failure
        assert result is not None
        return result
    if status != OK:
        raise LoaderError(f"{name}: rank {owner} failed to read the header chunks it shares; see its error")
    host = bytearray(data.cpu().numpy().tobytes())
    layer = str(f.descriptor.digest) if f.descriptor else ""
    for i in range(count):
        c0, clen = f.chunks.chunk_range(layer, i)
        if c0 + clen > len(host):
            raise LoaderError(
                f"{name}: rank {owner} sent {len(host)} header bytes, chunk {i} ends at {c0 + clen}"
            )
        buf = bytearray(host[c0 : c0 + clen])
        f.chunks.verify_chunk(layer, i, memoryview(buf))  # a peer is not a trust root
        fetcher.preload(i, buf)
    return read_header(reader, name, reader.size, fetcher)  # from the verified chunks, no read


def header_chunks(fp: FilePlan, table: ChunkTable, layer: str) -> set[int]:
    """Chunks holding header bytes: every rank verified them already to plan the load."""
    return set(table.chunks_covering(layer, 0, fp.header.data_start)) or {0}


def chunk_owners(
    needs: Sequence[set[int]], local: set[int], nodes: Sequence[int] | None = None
) -> tuple[dict[int, int], list[int]]:
    """(owner of every chunk some rank needs, except ``local``; the shared chunks in order).

    A chunk one rank needs is that rank's; the chunks several ranks need are cut, in file order,
    into ``len(needs)`` contiguous runs of (nearly) equal count, run ``r`` owned by rank ``r``.
    Over several nodes (``nodes``: the node of each rank) a run's chunk that no rank of rank
    ``r``'s node needs goes to the rank nearest ``r`` that needs it instead, so a node reads only
    chunks its own ranks need (its experts, its part of the replicated tensors; ``nodes.py``).
    """
    users: dict[int, list[int]] = {}
    for r, chunks in enumerate(needs):
        for c in chunks - local:
            users.setdefault(c, []).append(r)
    owner = {c: rs[0] for c, rs in users.items() if len(rs) == 1}
    shared = sorted(c for c, rs in users.items() if len(rs) > 1)
    p = len(needs)
    for i, c in enumerate(shared):
        run = i * p // len(shared)
        if nodes is not None and all(nodes[u] != nodes[run] for u in users[c]):
            run = min(users[c], key=lambda u: (abs(u - run), u))
        owner[c] = run
    return owner, shared


def read_chunked_shared(
    load: LoadEngine,
    reader: RangeReader,
    f: WeightFile,
    fp: FilePlan,
    ids: list[int],
    peers: Sequence[FilePlan],
) -> Iterator[int]:
    """This rank's chunks of a chunk-verified file: its own reads, then the group's exchange."""
    import torch.distributed as dist

    group = load.opts.group
    me = load.plan.group_rank
    table = f.chunks
    layer = str(f.descriptor.digest) if f.descriptor else ""
    local = header_chunks(fp, table, layer)
    needs = [needed_chunks(peer, table, layer) for peer in peers]
    nodes = nodes_of(group, node_size(load.opts.local_world_size))
    owner, shared = chunk_owners(needs, local, nodes if len(set(nodes)) > 1 else None)
    mine = needs[me]
    shared_set = set(shared)
    own_private = {c for c in mine if c in local or (c not in shared_set and owner.get(c) == me)}
    yield from read_chunked(load, reader, f, fp, ids, only=own_private)

    cap = load.copier.slot_bytes - 1  # the status byte follows the data
    blocks: list[list[int]] = []
    block_bytes = 0
    for c in shared:
        clen = table.chunk_range(layer, c)[1]
        last = blocks[-1] if blocks else None
        if last and last[-1] == c - 1 and owner[last[-1]] == owner[c] and block_bytes + clen <= cap:
            last.append(c)
            block_bytes += clen
        else:
            blocks.append([c])
            block_bytes = clen
    index = SpanIndex({i: load.tensors[i].span for i in ids if load.tensors[i].span.nbytes})
    for block in blocks:
        src_rank = owner[block[0]]
        g0, _ = table.chunk_range(layer, block[0])
        last0, last_len = table.chunk_range(layer, block[-1])
        glen = last0 + last_len - g0
        slot = yield from load.next_slot()
        failure: list[BaseException] = []

        def task(
            slot: Slot = slot,
            block: list[int] = block,
            g0: int = g0,
            glen: int = glen,
            owned: bool = src_rank == me,
            failure: list[BaseException] = failure,
        ) -> None:
            if not owned:
                return
            try:
                reader.read_into(g0, slot.view[:glen])
                for c in block:
                    c0, clen = table.chunk_range(layer, c)
                    table.verify_chunk(layer, c, slot.view[c0 - g0 : c0 - g0 + clen])
                slot.view[glen] = OK
            except BaseException as exc:  # broadcast the failure, then raise it (no rank waits forever)
                failure.append(exc)
                slot.view[glen] = FAILED

        def done(
            _: Any,
            slot: Slot = slot,
            block: list[int] = block,
            g0: int = g0,
            glen: int = glen,
            src_rank: int = src_rank,
            failure: list[BaseException] = failure,
        ) -> None:
            _exchange(load, slot, glen + 1, dist.get_global_rank(group, src_rank), src_rank == me, f.relpath)
            if failure:
                load.release(slot)
                raise failure[0]
            if slot.view[glen] != OK:
                load.release(slot)
                raise LoaderError(
                    f"{load.src.name}/{f.relpath}: rank {src_rank} failed to read chunks "
                    f"{block[0]}–{block[-1]} it shares with this rank; see its error"
                )
            if src_rank != me:
                for c in block:  # a peer is not a trust root: every received chunk is checked
                    c0, clen = table.chunk_range(layer, c)
                    table.verify_chunk(layer, c, slot.view[c0 - g0 : c0 - g0 + clen])
                load.received(glen)
            if mine.intersection(block):
                load.copy_out(slot, g0, g0 + glen, index.candidates(g0, g0 + glen))
            load.release(slot)

        yield from load.submit(task, done)


def _exchange(load: LoadEngine, slot: Slot, n: int, src: int, owned: bool, what: str) -> None:
    """Broadcast ``slot``'s first ``n`` bytes from global rank ``src`` through the device seam
    (gloo: host memory; NCCL: the slot's device buffer, on the current stream)."""
    group = load.opts.group
    load.copier.broadcast(
        slot, n, owned, group, lambda t: _broadcast(t, src, group, f"the shared chunks of {what}")
    )


def read_by_node(group: ProcessGroup | None, local_world_size: int, bytes_read: int) -> tuple[int, list[int]]:
    """(this rank's node, the bytes each node's ranks read): every rank's count all-gathered
    (``nodes.py``; ``local_world_size`` 0: torchrun's ``LOCAL_WORLD_SIZE``)."""
    import torch.distributed as dist

    nodes = nodes_of(group, node_size(local_world_size))
    dev = _comm_device(group)
    mine = torch.tensor([bytes_read], dtype=torch.int64, device=dev)
    everyone = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in nodes]
    _finish(dist.all_gather(everyone, mine, group=group, async_op=True), "the byte counts", "a rank")
    me = nodes[dist.get_rank(group)]
    return sorted(set(nodes)).index(me), totals_by_node(nodes, [int(c.item()) for c in everyone])


def peer_plans(plan: ReadPlan, build: Any) -> list[ReadPlan]:
    """Every rank's plan (``build(group rank)``), this rank's being ``plan`` itself."""
    return [plan if r == plan.group_rank else build(r) for r in range(plan.group_size)]
