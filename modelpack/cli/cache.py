"""``cache ls|verify|pin|unpin|gc|rm|path``: inspect and maintain the node cache (``cache serve``
is in ``modelpack.cli.cache_serve``, ``cache lora-args`` in ``modelpack.cli.adapters``).

``pull REF --cache DIR`` lives on the ``pull`` command (``modelpack.cli.pull``) and calls
``cache_pull`` here, so every way into the cache shares one implementation. Only a pull creates
a cache; the maintenance commands open an existing one and refuse a directory that is not one,
so a mistyped ``--cache`` is an error, not a new empty cache.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import click

from modelpack import settings as env_settings
from modelpack.cli.lazy_group import LazyCommand, LazyGroup
from modelpack.cli.options import SIZE, emit_json, handle_errors, human_size, json_option
from modelpack.exit_codes import ExitCode
from modelpack.mount.cache import NodeCache, PullResult, default_cache_dir
from modelpack.mount.gc import DEFAULT_FOREIGN_LEASE_S, DEFAULT_MIN_AGE_S
from modelpack.terminal import for_terminal

if TYPE_CHECKING:
    from modelpack.signing.policy import TrustPolicy
    from modelpack.targets.opener import TargetOptions


def cache_dir_option(fn: Any) -> Any:
    return click.option(
        "--cache",
        "cache_dir",
        envvar=env_settings.CACHE.name,
        default=None,
        metavar="DIR",
        help="Node cache directory (default: $MODELPACK_CACHE, else $XDG_CACHE_HOME/modelpack, "
        "else ~/.cache/modelpack).",
    )(fn)


def events_option(fn: Any) -> Any:
    return click.option(
        "--events",
        "events",
        default=None,
        metavar="-|FILE",
        help="Also write the cache's JSON events to stderr (-) or FILE (never through a symlink, "
        "never into another user's file). They go to <cache>/events.jsonl too when it can be "
        "written; on a read-only cache that is skipped with one line on stderr.",
    )(fn)


_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


class SecondsType(click.ParamType):
    """A length of time: ``300`` (seconds), ``90s``, ``5m``, ``2h``, ``1d``."""

    name = "DURATION"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        if isinstance(value, (int, float)):
            return float(value)
        text = str(value).strip().lower()
        unit = _UNITS.get(text[-1:]) if text else None
        number = text[:-1] if unit is not None else text
        try:
            seconds = float(number) * (unit or 1.0)
        except ValueError:
            self.fail(f"{value!r} is not a duration (e.g. 300, 90s, 5m, 2h)", param, ctx)
        if seconds < 0 or not math.isfinite(seconds):
            self.fail(f"{value!r}: a duration is a finite number of seconds, not negative", param, ctx)
        return seconds


SECONDS = SecondsType()


def open_cache(cache_dir: str | None, events: str | None = None, **kwargs: Any) -> NodeCache:
    """An existing cache (maintenance commands); ``create=True`` in ``kwargs`` for a pull."""
    kwargs.setdefault("create", False)
    return NodeCache(cache_dir or default_cache_dir(), events=events, **kwargs)


def cache_pull(
    reference: str,
    cache_dir: str | None,
    *,
    target_options: TargetOptions | None = None,
    policy: TrustPolicy | None = None,
    jobs: int = 4,
    events: str | None = None,
    max_cache_bytes: int | None = None,
    as_json: bool = False,
    progress: str = "auto",
    hold: float | None = None,
    allow_rollback: bool = False,
    variant: Any = None,
    signature_path: str | None = None,
) -> PullResult:
    """What ``modelpack pull REF --cache DIR`` does: pull into the node cache, print the snapshot.
    ``variant`` (a ``VariantSelector``) picks the entry when REF is an index of variants.
    ``signature_path``: write the model_signing directory signature the cache verified and kept
    beside the snapshot (read from the cache, so a pinned hit needs no registry)."""
    cache = open_cache(cache_dir, events, max_cache_bytes=max_cache_bytes, create=True)
    result = cache.pull(
        reference,
        target_options,
        policy=policy,
        jobs=jobs,
        progress=progress,
        hold=hold,
        allow_rollback=allow_rollback,
        variant=variant,
    )
    if signature_path:
        _write_kept_directory_signature(cache, reference, str(result.digest), policy, signature_path)
    if as_json:
        emit_json(result.to_json())
    else:
        if result.variant:
            fields = " ".join(f"{k}={v}" for k, v in result.variant["variant"].items())
            click.echo(f"variant {for_terminal(fields)} of index {result.variant['index']}", err=True)
        held = f"; held until {_when(result.hold_until)}" if result.hold_path else ""
        click.echo(
            f"{result.state}: {result.digest} ({result.files} files, {human_size(result.bytes_total)}; "
            f"downloaded {human_size(result.bytes_downloaded)}, reused {human_size(result.bytes_reused)}) "
            f"in {result.timings.get('total', 0):.0f} ms{held}",
            err=True,
        )
        click.echo(result.path)
    return result


def _write_kept_directory_signature(
    cache: NodeCache, reference: str, digest: str, policy: TrustPolicy | None, path: str
) -> None:
    from modelpack.oci.reference import parse_reference
    from modelpack.signing import write_directory_signature
    from modelpack.signing.verify import resolve_policy
    from modelpack.targets.layout import OCILayoutTarget

    kept = OCILayoutTarget(cache.store.root)
    keys = list(resolve_policy(policy, parse_reference(reference)).keys) if policy is not None else []
    write_directory_signature(kept, kept.resolve(digest), path, keys or None)


def _when(ts: float) -> str:
    from modelpack.timestamps import rfc3339_utc_or_none

    return rfc3339_utc_or_none(ts) or "-"


@click.group(
    "cache",
    cls=LazyGroup,
    # imported only when it runs: a cache hit (pull --cache) does not load the adapters' CLI
    lazy_commands={
        "lora-args": LazyCommand(
            "modelpack.cli.adapters:cache_lora_args",
            "Print vLLM's LoRA flags for BASE and its cached adapters (no network; creates nothing).",
        ),
        "serve": LazyCommand(
            "modelpack.cli.cache_serve:cache_serve",
            "Serve the node cache to peers as a read-only OCI registry mirror.",
        ),
    },
)
def cache_group() -> None:
    """Inspect and maintain the node cache (snapshots of pulled models).

    \b
    Examples:
      modelpack pull reg.example/models/llama:v1 --cache /var/cache/modelpack
      modelpack cache ls --cache /var/cache/modelpack
      MODELPACK_CACHE=/var/cache/modelpack modelpack cache gc --keep-versions 2
    """


@cache_group.command("ls")
@cache_dir_option
@json_option
@handle_errors
def cache_ls(cache_dir: str | None, as_json: bool) -> None:
    """List ready snapshots, most recently used first.

    \b
    Examples:
      modelpack cache ls --cache /var/cache/modelpack
      modelpack cache ls --cache /var/cache/modelpack --json
    """
    cache = open_cache(cache_dir)
    entries = cache.ls()
    if as_json:
        emit_json({"cache": cache.root, "usage": cache.usage(), "snapshots": [e.to_json() for e in entries]})
        return
    for e in entries:
        flags = ",".join(f for f, on in (("pinned", e.pinned), ("in-use", e.in_use)) if on) or "-"
        click.echo(
            f"{e.digest[:19]}…  {human_size(e.size):>10}  {e.files:>5} files  {flags:<14} "
            f"{_when(e.last_used)}  {', '.join(e.references) or e.repository}"
        )
        for ix in e.indexes:  # the variant indexes this snapshot was chosen from
            fields = " ".join(f"{k}={v}" for k, v in (ix.get("variant") or {}).items())
            click.echo(
                f"    variant of {ix['index'][:19]}… ({for_terminal(fields)}) via {for_terminal(str(ix.get('reference')))}"
            )
    click.echo(f"{len(entries)} snapshots, {human_size(cache.usage())} in {cache.root}", err=True)


@cache_group.command("path")
@click.argument("reference")
@cache_dir_option
@handle_errors
def cache_path(reference: str, cache_dir: str | None) -> None:
    """Print the snapshot directory of REFERENCE (no network: tags as last pulled).

    \b
    Examples:
      modelpack cache path reg.example/models/llama:v1 --cache /var/cache/modelpack
    """
    click.echo(open_cache(cache_dir).snapshot_path(reference))


@cache_group.command("verify")
@click.argument("reference", required=False)
@cache_dir_option
@click.option("--no-repair", is_flag=True, help="Report damage without unpublishing the snapshot.")
@events_option
@json_option
@handle_errors
def cache_verify(
    reference: str | None, cache_dir: str | None, no_repair: bool, events: str | None, as_json: bool
) -> None:
    """Check REFERENCE's snapshot (default: all) against its manifest. Exit 1 if any is damaged.

    Every file is re-hashed; the ready marker must list exactly the files the manifest implies,
    and the directory must hold nothing else. A damaged snapshot is unpublished (its ready
    marker removed) and its bad blobs deleted, so the next pull fetches them again.

    \b
    Examples:
      modelpack cache verify --cache /var/cache/modelpack
      modelpack cache verify reg.example/models/llama:v1 --cache /var/cache/modelpack --no-repair --json
    """
    reports = open_cache(cache_dir, events).verify(reference, repair=not no_repair)
    if as_json:
        emit_json([r.to_json() for r in reports])
    else:
        for r in reports:
            status = "ok" if r.ok else "DAMAGED"
            click.echo(f"{r.digest}  {status}  {r.files} files, {human_size(r.bytes)}, {r.seconds:.2f}s")
            for p in r.problems:
                click.echo(f"  {for_terminal(p)}")  # names found in the cache: inert
    if any(not r.ok for r in reports):
        raise SystemExit(ExitCode.FAILURE)


@cache_group.command("pin")
@click.argument("reference")
@cache_dir_option
@handle_errors
def cache_pin(reference: str, cache_dir: str | None) -> None:
    """Keep REFERENCE's snapshot through every GC.

    \b
    Examples:
      modelpack cache pin reg.example/models/llama:v1 --cache /var/cache/modelpack
    """
    click.echo(open_cache(cache_dir).pin(reference))


@cache_group.command("unpin")
@click.argument("reference")
@cache_dir_option
@handle_errors
def cache_unpin(reference: str, cache_dir: str | None) -> None:
    """Let GC evict REFERENCE's snapshot again.

    \b
    Examples:
      modelpack cache unpin reg.example/models/llama:v1 --cache /var/cache/modelpack
    """
    click.echo(open_cache(cache_dir).unpin(reference))


@cache_group.command("gc")
@cache_dir_option
@click.option(
    "--keep-versions", type=click.IntRange(0), default=None, help="Keep N most recent per repository."
)
@click.option("--max-bytes", type=SIZE, default=None, help="Evict least recently used until under SIZE.")
@click.option(
    "--min-age",
    type=SECONDS,
    default=f"{DEFAULT_MIN_AGE_S:g}s",
    show_default=True,
    help="Never evict a snapshot used or published less than DURATION ago (its pull may still be "
    "handing it to the process that reads it).",
)
@click.option(
    "--foreign-lease-limit",
    type=SECONDS,
    default=f"{DEFAULT_FOREIGN_LEASE_S:g}s",
    show_default=True,
    help="A reader lease held only by other users' processes keeps a snapshot at most DURATION "
    "after the cache owner last used it (the owner's and root's leases count however old).",
)
@click.option(
    "--dry-run",
    is_flag=True,
    help="Print the plan (each removal, its size and reason) the real run would execute; delete nothing.",
)
@events_option
@json_option
@handle_errors
def cache_gc(
    cache_dir: str | None,
    keep_versions: int | None,
    max_bytes: int | None,
    min_age: float,
    foreign_lease_limit: float,
    dry_run: bool,
    events: str | None,
    as_json: bool,
) -> None:
    """Evict snapshots (LRU), never pinned, in-use, being-pulled, held or young ones; sweep leftovers.

    Deletes refs, then snapshots, then the blobs no remaining manifest needs.

    \b
    Examples:
      modelpack cache gc --cache /var/cache/modelpack --keep-versions 2
      modelpack cache gc --cache /var/cache/modelpack --max-bytes 500G --dry-run
      modelpack cache gc --cache /var/cache/modelpack --keep-versions 0 --min-age 0 --json  # all that may go
    """
    res = open_cache(cache_dir, events).gc(
        keep_versions=keep_versions,
        max_bytes=max_bytes,
        dry_run=dry_run,
        min_age=min_age,
        foreign_lease_s=foreign_lease_limit,
    )
    if as_json:
        emit_json(res.to_json())
        return
    if dry_run:
        for r in res.plan:  # the plan the real run executes, item by item
            click.echo(f"would remove {r.kind} {r.what} ({human_size(r.bytes)}): {r.reason}")
        click.echo(
            f"would evict {len(res.evicted)} snapshots, remove {res.blobs_removed} blobs and "
            f"{len(res.swept)} leftovers; would free {human_size(res.bytes_freed)} "
            f"of {human_size(res.bytes_before)}; kept {len(res.kept_in_use)} in use, "
            f"{len(res.kept_pinned)} pinned, {len(res.kept_pulling)} being pulled, "
            f"{len(res.kept_held)} held, {len(res.kept_young)} younger than --min-age"
        )
        return
    click.echo(
        f"evicted {len(res.evicted)} snapshots, removed {res.blobs_removed} blobs, freed "
        f"{human_size(res.bytes_freed)}; kept {len(res.kept_in_use)} in use, {len(res.kept_pinned)} pinned, "
        f"{len(res.kept_pulling)} being pulled, {len(res.kept_held)} held, "
        f"{len(res.kept_young)} younger than --min-age; swept {len(res.swept)} leftovers"
    )


@cache_group.command("rm")
@click.argument("reference")
@cache_dir_option
@click.option("--force", is_flag=True, help="Also remove a pinned or in-use snapshot.")
@handle_errors
def cache_rm(reference: str, cache_dir: str | None, force: bool) -> None:
    """Remove REFERENCE's refs, snapshot and unshared blobs.

    \b
    Examples:
      modelpack cache rm reg.example/models/llama:v1 --cache /var/cache/modelpack
    """
    click.echo(open_cache(cache_dir).rm(reference, force=force))


__all__ = ["SECONDS", "cache_dir_option", "cache_group", "cache_pull", "events_option", "open_cache"]
