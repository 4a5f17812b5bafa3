"""``timeline`` (start-up stages from event logs) and ``load`` (a quick loader check).

The loader (and with it torch) is imported inside each command, never when this module loads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from modelpack.cli.options import (
    build_target_options,
    emit_json,
    handle_errors,
    human_size,
    json_option,
    progress_option,
    selector_from,
    target_options,
    variant_options,
)

if TYPE_CHECKING:
    from modelpack.loader.stream_through import StreamReport
    from modelpack.targets.options import TargetOptions


@click.command("timeline")
@click.argument("event_logs", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@json_option
@handle_errors
def timeline_cmd(event_logs: tuple[str, ...], as_json: bool) -> None:
    """Per-stage start-up latency (count, p50, p95) from EVENT_LOGS, per cache state.

    \b
    Stages: t2 version confirmed → t3 read start → t4 read done → t5 device load done
            → t8 engine healthy → t9 check passed, plus the spans t4−t3, t5−t3, t8−t0 and
            t9−t0 (t0: a start's first event, or its serving engine's process start).
            Events are grouped by start_id across all files given;
    states: cold (downloaded), hit (node cache), streamed (range reads, no cache).

    \b
    Example:
      modelpack timeline ~/.cache/modelpack/events.jsonl loader-events.jsonl --json
    """
    from modelpack.loader.timeline import format_table, timeline

    summary = timeline(list(event_logs))
    if as_json:
        emit_json(summary)
    else:
        click.echo(format_table(summary))


def _streamed_source(source: str, opts: Any, events: str | None) -> tuple[Any, Any]:
    """A registry reference is opened here, with ``--events`` for its source events, so the
    report can say which source (peer, mirror, origin) served the bytes (``bytesBySource``);
    any other source is passed on as given. Returns (source for the loader, the target or None)."""
    import os

    from modelpack.errors import ModelpackError
    from modelpack.events import EventLog
    from modelpack.oci.reference import parse_reference
    from modelpack.targets.opener import open_readable

    if os.path.isdir(source) or "://" in source or source.startswith("oci:"):
        return source, None
    try:
        ref = parse_reference(source)
    except ModelpackError:
        return source, None
    if ref.scheme != "registry":
        return source, None
    if events and opts.events is None:
        opts.events = EventLog(events)  # the loader's own reads (target_options) report too
    target = open_readable(ref, opts)
    return (target, str(ref.digest) if ref.digest else ref.tag), target


def _cache_stream(
    source: str, cache_dir: str, opts: TargetOptions, events: str | None, fill: str
) -> tuple[Any, Any]:
    """``load REF@D --cache DIR``: the pinned reference streamed through the node cache
    (``loader.stream_through``); DIR is created as ``pull --cache`` creates it. Returns (source
    for the loader, the target both the cache and the load read)."""
    import os

    from modelpack.errors import ModelpackError
    from modelpack.events import EventLog
    from modelpack.loader import CacheStream
    from modelpack.mount.cache import NodeCache
    from modelpack.oci.reference import parse_reference
    from modelpack.targets.opener import open_readable

    if os.path.isdir(source):
        raise click.UsageError(
            f"--cache streams a pinned reference into the node cache; {source} is a directory"
        )
    try:
        ref = parse_reference(source)
    except ModelpackError as exc:
        raise click.UsageError(f"--cache: {source!r} is not a reference: {exc}") from None
    if events and opts.events is None:
        opts.events = EventLog(events)  # the source events: which source served each read
    target = open_readable(ref, opts)
    return CacheStream(
        NodeCache(cache_dir, events=events), ref, target_options=opts, target=target, fill=fill
    ), target


def _cache_line(report: StreamReport) -> str:
    if report.state == "share":
        return f"{report.root}: not published (this rank read its share; left to a full fill)"
    if report.published:
        return f"{report.state}: {report.path}"
    return f"{report.root}: not published ({report.error or report.state})"


def _expert_map(value: str) -> str | list[int]:
    """--expert-map: a placement name, or one EP rank per expert (``0,0,1,1``)."""
    if value in ("linear", "round_robin"):
        return value
    try:
        return [int(x) for x in value.split(",")]
    except ValueError:
        raise click.BadParameter(
            f"{value[:80]!r}: use linear, round_robin or a comma-separated rank per expert",
            param_hint="--expert-map",
        ) from None


@click.command("load")
@click.argument("source")
@click.option("--tp-size", type=click.IntRange(1, 1024), default=1, show_default=True)
@click.option("--tp-rank", type=click.IntRange(0, 1023), default=0, show_default=True)
@click.option(
    "--ep-size",
    type=click.IntRange(1, 1024),
    default=1,
    show_default=True,
    help="Expert-parallel ranks: this rank reads only its routed experts (whole), the router and "
    "its --tp-rank share of the rest.",
)
@click.option("--ep-rank", type=click.IntRange(0, 1023), default=0, show_default=True)
@click.option(
    "--expert-map",
    default="linear",
    show_default=True,
    help="Expert → EP rank: linear (vLLM's default: contiguous runs), round_robin (expert e on "
    "rank e % --ep-size), or a comma-separated rank per expert.",
)
@click.option("--device", default="cpu", show_default=True, help="torch device, e.g. cpu or cuda:0.")
@click.option("--expected-digest", help="Pin the manifest digest (required for tag references).")
@click.option(
    "--trusted-key",
    "trusted_keys",
    multiple=True,
    type=click.Path(exists=True, dir_okay=False),
    help="PEM public key whose signed chunk table enables verified range reads (repeatable).",
)
@click.option(
    "--fingerprint",
    "fingerprint",
    type=click.Path(exists=True, dir_okay=False),
    help="Recorded fingerprint file the load must match (fails closed).",
)
@click.option(
    "--record-fingerprint", type=click.Path(dir_okay=False), help="Write this load's fingerprint here."
)
@click.option(
    "--events", "events", type=click.Path(dir_okay=False), help="Append loader events (JSON lines)."
)
@click.option("--start-id", help="Group this load's events with a pull's (see 'modelpack timeline').")
@click.option(
    "--allow-unverified", is_flag=True, help="Accept a plain directory (no snapshot marker, no digest)."
)
@click.option(
    "--allow-missing-chunk-table",
    is_flag=True,
    help="With --trusted-key: accept whole-layer digest checks for layers no signed chunk table "
    "covers (every rank then reads whole layers); refused without this flag.",
)
@click.option(
    "--uneven",
    type=click.Choice(["refuse", "chunk"]),
    default="refuse",
    show_default=True,
    help="A dimension --tp-size does not divide: refuse, or split it like torch.chunk.",
)
@click.option("--direct-io", is_flag=True, help="Read local files with O_DIRECT (cold NVMe).")
@click.option(
    "--column-reads",
    type=click.Choice(["local", "always", "never"]),
    default="local",
    show_default=True,
    help="A rank without a process group, column-split tensors, a chunk table with column blocks: "
    "read only this rank's columns (one range per row) from local files and OCI layouts (local), "
    "from a registry too (always: fewer bytes, but each range costs the registry ~0.4 ms, so slower "
    "unless the link is slow or metered), or read the covering chunks (never).",
)
@click.option(
    "--cache",
    "cache_dir",
    default=None,
    metavar="DIR",
    help="Stream a pinned reference through the node cache DIR (as 'pull --cache DIR'): a hit "
    "reads the snapshot; a miss writes each verified blob into DIR while the load reads it, and "
    "publishes the snapshot once every blob is committed (docs/loader.md#stream-through-cache).",
)
@click.option(
    "--cache-fill",
    type=click.Choice(["leave", "background"]),
    default="leave",
    show_default=True,
    help="With --cache, for a rank that reads only its share (--tp-size/--ep-size above 1): leave "
    "the snapshot to a full fill (pull --cache, pre-warm), or fill the whole model in the "
    "background and read the share from the cache as it lands.",
)
@click.option(
    "--layout",
    type=click.Choice(["canonical", "sharded_state"]),
    default="canonical",
    show_default=True,
    help="The artifact's weight layout: canonical (each rank reads its slice of whole tensors) or "
    "sharded_state (vLLM's per-rank files: the rank reads only its own files; --tp-size must be "
    "the artifact's). An artifact of the other layout is refused.",
)
@variant_options(with_tp_size=False)
@target_options
@progress_option
@json_option
@handle_errors
def load_cmd(
    source: str,
    tp_size: int,
    tp_rank: int,
    ep_size: int,
    ep_rank: int,
    expert_map: str,
    device: str,
    expected_digest: str | None,
    trusted_keys: tuple[str, ...],
    fingerprint: str | None,
    record_fingerprint: str | None,
    events: str | None,
    start_id: str | None,
    allow_unverified: bool,
    allow_missing_chunk_table: bool,
    uneven: str,
    direct_io: bool,
    column_reads: str,
    cache_dir: str | None,
    cache_fill: str,
    layout: str,
    progress: str,
    as_json: bool,
    **kwargs: Any,
) -> None:
    """Load SOURCE's weights for one tensor-parallel (and expert-parallel) rank and report what it cost.

    SOURCE is a snapshot directory (printed by 'modelpack pull --cache'), or a reference
    streamed by range reads: host/repo@sha256:…, oci:DIR@sha256:…, s3://BUCKET/PREFIX@sha256:….
    With --trusted-key every chunk is checked against the signed chunk table before it is used;
    a model without one is refused unless --allow-missing-chunk-table. The report (and --json:
    bytesRead against modelBytes, bytesBySplit, verification) says what each rank read, per split
    kind. With --ep-size the rank reads only its routed experts (docs/loader.md).

    \b
    Examples:
      modelpack load ~/.cache/modelpack/snapshots/<hex> --expected-digest sha256:<hex>
      modelpack load registry.example/llama@sha256:<hex> --trusted-key ci.pub --tp-size 8 --tp-rank 3 --json
      modelpack load oci:./layout@sha256:<hex> --allow-missing-chunk-table --trusted-key ci.pub
      modelpack load oci:./layout@sha256:<hex> --layout sharded_state --tp-size 2 --tp-rank 1 --json
      modelpack load oci:./moe@sha256:<hex> --trusted-key ci.pub --ep-size 8 --ep-rank 5 --json
    """
    from modelpack.loader import LoaderOptions, LoadStats, load_state_dict

    if tp_rank >= tp_size:
        raise click.UsageError(f"--tp-rank {tp_rank} must be below --tp-size {tp_size}")
    if ep_rank >= ep_size:
        raise click.UsageError(f"--ep-rank {ep_rank} must be below --ep-size {ep_size}")
    placement = _expert_map(expert_map)
    keys = None
    if trusted_keys:
        from modelpack.signing.keys import load_public_key

        keys = [load_public_key(k) for k in trusted_keys]
    stats = LoadStats()
    # SOURCE pinning an index of variants: the entry for this device, TP size and --variant
    selector = selector_from(kwargs, tp_size=tp_size, device=device)
    opts = build_target_options(kwargs)
    if cache_fill != "leave" and cache_dir is None:
        raise click.UsageError(
            "--cache-fill says what a rank does about the node cache: it needs --cache DIR"
        )
    if cache_dir is not None:
        src, streamed = _cache_stream(source, cache_dir, opts, events, cache_fill)
    else:
        src, streamed = _streamed_source(source, opts, events)
    sd = load_state_dict(
        src,
        device,
        tp_size=tp_size,
        tp_rank=tp_rank,
        expected_digest=expected_digest,
        trusted_keys=keys,
        fingerprint=fingerprint,
        events=events,
        start_id=start_id,
        allow_unverified=allow_unverified,
        target_options=opts,
        layout=layout,
        ep_size=ep_size,
        ep_rank=ep_rank,
        expert_map=placement,
        options=LoaderOptions(
            direct_io=direct_io,
            column_reads=column_reads,
            uneven=uneven,
            allow_missing_chunk_table=allow_missing_chunk_table,
            variant=selector,
        ),
        progress=progress,
        stats=stats,
    )
    if record_fingerprint and stats.fingerprint is not None:
        stats.fingerprint.write(record_fingerprint)
    doc = {
        "reference": stats.reference,
        "digest": stats.digest,
        "tensors": len(sd),
        "bytesToRead": stats.bytes_to_read,
        "bytesRead": stats.bytes_read,
        "bytesBySplit": stats.bytes_by_split,
        "verification": stats.verification,
        "seconds": round(stats.seconds, 6),
        "gbps": round(stats.gbps, 3),
        "tpSize": tp_size,
        "tpRank": tp_rank,
        "epSize": ep_size,
        "epRank": ep_rank,
        "experts": list(stats.plan.experts) if stats.plan else [],
        "modelBytes": stats.plan.total_bytes if stats.plan else 0,
        "node": stats.node,
        "nodeBytesRead": stats.node_bytes_read,
        "bytesReadByNode": stats.bytes_read_by_node,
        "layout": layout,
        "bytesByFile": dict(sorted(stats.per_file_bytes.items())),
        "device": device,
        "state": stats.state,
        "startId": stats.start_id,
        "fingerprint": stats.fingerprint.to_dict() if stats.fingerprint else None,
        "fingerprintDigest": stats.fingerprint.digest if stats.fingerprint else None,
        "bytesBySource": streamed.bytes_by_source() if hasattr(streamed, "bytes_by_source") else {},
    }
    if cache_dir is not None:
        doc["cache"] = src.report.to_json()
    if as_json:
        emit_json(doc)
        return
    click.echo(
        f"loaded {len(sd)} tensors ({human_size(stats.bytes_read)} read) in {stats.seconds:.3f} s "
        f"({stats.gbps:.2f} GB/s), rank {tp_rank}/{tp_size} on {device}"
    )
    if stats.plan is not None:
        share = stats.bytes_read / stats.plan.total_bytes if stats.plan.total_bytes else 0.0
        click.echo(f"model       {human_size(stats.plan.total_bytes)} ({share:.3f}× read by this rank)")
    if ep_size > 1 and stats.plan is not None:
        held = ", ".join(str(e) for e in stats.plan.experts) or "none"
        click.echo(f"ep rank     {ep_rank}/{ep_size}: experts {held} of {stats.plan.num_experts}")
    click.echo(f"digest      {stats.digest or '-'}")
    for kind, label in (
        ("dim0", "row-split"),
        ("dim1", "column-split"),
        ("replicate", "replicated"),
        ("expert", "routed experts"),
    ):
        b = stats.bytes_by_split.get(kind)
        if b and b["tensorBytes"]:
            click.echo(
                f"{kind:<11} {human_size(b['read'])} read for {human_size(b['planned'])} needed of "
                f"{human_size(b['tensorBytes'])} ({label})"
            )
    modes = sorted(set(stats.verification.values()))
    click.echo(f"verified    {', '.join(modes) or '-'}")
    if cache_dir is not None:
        click.echo(f"node cache  {_cache_line(src.report)}")
    if stats.fingerprint:
        click.echo(f"fingerprint {stats.fingerprint.digest}")
