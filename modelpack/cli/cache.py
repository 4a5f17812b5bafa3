"""``cache ls|verify|pin|unpin|gc|rm|path``: inspect and maintain the node cache.

``pull REF --cache DIR`` lives on the ``pull`` command (``modelpack.cli.pull``) and calls
``cache_pull`` here, so every way into the cache shares one implementation.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import click

from modelpack.cli.options import SIZE, emit_json, handle_errors, human_size, json_option
from modelpack.mount.cache import NodeCache, PullResult, default_cache_dir

if TYPE_CHECKING:
    from modelpack.signing.policy import TrustPolicy
    from modelpack.targets.opener import TargetOptions


def cache_dir_option(fn: Any) -> Any:
    return click.option(
        "--cache",
        "cache_dir",
        envvar="MODELPACK_CACHE",
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
        help="Also write the cache's JSON events to stderr (-) or FILE; they always go to "
        "<cache>/events.jsonl.",
    )(fn)


def open_cache(cache_dir: str | None, events: str | None = None, **kwargs: Any) -> NodeCache:
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
) -> PullResult:
    """What ``modelpack pull REF --cache DIR`` does: pull into the node cache, print the snapshot."""
    cache = open_cache(cache_dir, events, max_cache_bytes=max_cache_bytes)
    result = cache.pull(reference, target_options, policy=policy, jobs=jobs)
    if as_json:
        emit_json(result.to_json())
    else:
        click.echo(
            f"{result.state}: {result.digest} ({result.files} files, {human_size(result.bytes_total)}; "
            f"downloaded {human_size(result.bytes_downloaded)}, reused {human_size(result.bytes_reused)}) "
            f"in {result.timings.get('total', 0):.0f} ms",
            err=True,
        )
        click.echo(result.path)
    return result


def _when(ts: float) -> str:
    if not ts:
        return "-"
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


@click.group("cache")
def cache_group() -> None:
    """Inspect and maintain the node cache (snapshots of pulled models)."""


@cache_group.command("ls")
@cache_dir_option
@json_option
@handle_errors
def cache_ls(cache_dir: str | None, as_json: bool) -> None:
    """List ready snapshots, most recently used first."""
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
    click.echo(f"{len(entries)} snapshots, {human_size(cache.usage())} in {cache.root}", err=True)


@cache_group.command("path")
@click.argument("reference")
@cache_dir_option
@handle_errors
def cache_path(reference: str, cache_dir: str | None) -> None:
    """Print the snapshot directory of REFERENCE (no network: tags as last pulled)."""
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
    """Re-hash every file of REFERENCE (default: all snapshots). Exit 1 if any is damaged.

    A damaged snapshot is unpublished (its ready marker removed) and its bad blobs deleted, so
    the next pull fetches them again.
    """
    reports = open_cache(cache_dir, events).verify(reference, repair=not no_repair)
    if as_json:
        emit_json([r.to_json() for r in reports])
    else:
        for r in reports:
            status = "ok" if r.ok else "DAMAGED"
            click.echo(f"{r.digest}  {status}  {r.files} files, {human_size(r.bytes)}, {r.seconds:.2f}s")
            for p in r.problems:
                click.echo(f"  {p}")
    if any(not r.ok for r in reports):
        raise SystemExit(1)


@cache_group.command("pin")
@click.argument("reference")
@cache_dir_option
@handle_errors
def cache_pin(reference: str, cache_dir: str | None) -> None:
    """Keep REFERENCE's snapshot through every GC."""
    click.echo(open_cache(cache_dir).pin(reference))


@cache_group.command("unpin")
@click.argument("reference")
@cache_dir_option
@handle_errors
def cache_unpin(reference: str, cache_dir: str | None) -> None:
    """Let GC evict REFERENCE's snapshot again."""
    click.echo(open_cache(cache_dir).unpin(reference))


@cache_group.command("gc")
@cache_dir_option
@click.option(
    "--keep-versions", type=click.IntRange(0), default=None, help="Keep N most recent per repository."
)
@click.option("--max-bytes", type=SIZE, default=None, help="Evict least recently used until under SIZE.")
@click.option("--dry-run", is_flag=True, help="Say what would be evicted; delete nothing.")
@events_option
@json_option
@handle_errors
def cache_gc(
    cache_dir: str | None,
    keep_versions: int | None,
    max_bytes: int | None,
    dry_run: bool,
    events: str | None,
    as_json: bool,
) -> None:
    """Evict snapshots (LRU), never pinned, in-use or being-pulled ones; sweep crash leftovers.

    Deletes refs, then snapshots, then the blobs no remaining manifest needs.
    """
    res = open_cache(cache_dir, events).gc(keep_versions=keep_versions, max_bytes=max_bytes, dry_run=dry_run)
    if as_json:
        emit_json(res.to_json())
        return
    verb = "would evict" if dry_run else "evicted"
    click.echo(
        f"{verb} {len(res.evicted)} snapshots, removed {res.blobs_removed} blobs, freed "
        f"{human_size(res.bytes_freed)}; kept {len(res.kept_in_use)} in use, {len(res.kept_pinned)} pinned, "
        f"{len(res.kept_pulling)} being pulled; swept {len(res.swept)} leftovers"
    )


@cache_group.command("rm")
@click.argument("reference")
@cache_dir_option
@click.option("--force", is_flag=True, help="Also remove a pinned or in-use snapshot.")
@handle_errors
def cache_rm(reference: str, cache_dir: str | None, force: bool) -> None:
    """Remove REFERENCE's refs, snapshot and unshared blobs."""
    click.echo(open_cache(cache_dir).rm(reference, force=force))


__all__ = ["cache_dir_option", "cache_group", "cache_pull", "events_option", "open_cache"]
