"""``cache ls|verify|pin|unpin|gc|rm|path`` and ``k8s pod|init-container|prewarm``.

``pull REF --cache DIR`` lives on the ``pull`` command (``cli_transfer``) and calls
``cache_pull`` here, so every cache entry point shares one implementation.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import click

from modelpack.cli import (
    SIZE,
    build_target_options,
    emit_json,
    handle_errors,
    human_size,
    json_option,
    main,
    target_options,
)
from modelpack.mount import k8s
from modelpack.mount.cache import NodeCache, PullResult, default_cache_dir
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
    policy: Any = None,
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


def cache_pull_from_cli(
    reference: str,
    cache_dir: str,
    kwargs: dict[str, Any],
    *,
    jobs: int,
    as_json: bool,
    max_cache_bytes: int | None = None,
) -> PullResult:
    """``pull REF --cache DIR``: reuses the pull command's trust options (--key/--policy/--events)."""
    topts = build_target_options(kwargs)
    keys = tuple(kwargs.pop("trust_keys", ()) or ())
    policy_path = kwargs.pop("trust_policy", None)
    events = kwargs.pop("trust_events", None)
    if kwargs.pop("signature_path", None):
        raise click.UsageError("--signature writes into a pulled directory; it does not apply to --cache")
    from modelpack.cli.trust import _policy_from

    policy = _policy_from(keys, policy_path)
    return cache_pull(
        reference,
        cache_dir,
        target_options=topts,
        policy=policy,
        jobs=jobs,
        events=events,
        max_cache_bytes=max_cache_bytes,
        as_json=as_json,
    )


def _when(ts: float) -> str:
    if not ts:
        return "-"
    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@main.group("cache")
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


# --------------------------------------------------------------------------- k8s
def _resolve_if_asked(reference: str, resolve: bool, kwargs: dict[str, Any]) -> str:
    topts = build_target_options(kwargs)
    if not resolve:
        return reference
    from modelpack.oci.reference import parse_reference
    from modelpack.targets.opener import open_readable

    ref = parse_reference(reference)
    if ref.digest:
        return reference
    desc = open_readable(ref, topts).resolve(ref.identifier)
    return str(ref.with_tag(None).with_digest(desc.digest))


def _emit(obj: dict[str, Any], notes: list[str], as_json: bool) -> None:
    k8s.validate(obj)
    if as_json:
        emit_json(obj)
    else:
        click.echo(k8s.to_yaml(obj, notes), nl=False)


@main.group("k8s")
def k8s_group() -> None:
    """Kubernetes YAML (stdout) for image volumes, init-container pulls and pre-warming."""


@k8s_group.command("pod")
@click.option("--image-volume", "reference", required=True, help="Model reference, pinned by digest.")
@click.option("--mount-path", default="/models", show_default=True)
@click.option(
    "--pull-policy", type=click.Choice(k8s.PULL_POLICIES), default="IfNotPresent", show_default=True
)
@click.option(
    "--image", default="vllm/vllm-openai:latest", show_default=True, help="Serving container image."
)
@click.option("--name", default=None, help="Pod name (default: from the repository).")
@click.option("--namespace", default=None)
@click.option("--resolve", is_flag=True, help="Resolve a tag to its digest now (needs registry access).")
@target_options
@json_option
@handle_errors
def k8s_pod(
    reference: str,
    mount_path: str,
    pull_policy: str,
    image: str,
    name: str | None,
    namespace: str | None,
    resolve: bool,
    as_json: bool,
    **kwargs: Any,
) -> None:
    """A Pod that mounts the model as an image volume (kubelet pulls it read-only).

    \b
    Runtime needs: CRI-O >= 1.33 mounts the raw ModelPack artifact;
    containerd >= 2.1 needs the image-shaped variant (modelpack push --format image).
    """
    ref = _resolve_if_asked(reference, resolve, kwargs)
    obj = k8s.image_volume_pod(
        ref, mount_path=mount_path, pull_policy=pull_policy, image=image, name=name, namespace=namespace
    )
    _emit(obj, k8s.IMAGE_VOLUME_NOTES, as_json)


@k8s_group.command("init-container")
@click.argument("reference")
@click.option(
    "--cache-path", default=k8s.DEFAULT_CACHE_MOUNT, show_default=True, help="Cache mount in the pod."
)
@click.option(
    "--cache-volume", type=click.Choice(["hostPath", "emptyDir"]), default="hostPath", show_default=True
)
@click.option("--host-path", default=k8s.DEFAULT_CACHE_HOST_PATH, show_default=True, help="Node directory.")
@click.option("--size-limit", default=None, help="emptyDir sizeLimit (e.g. 200Gi).")
@click.option("--policy-secret", default=None, help="Secret holding the trust policy (and keys).")
@click.option(
    "--policy-key", default="policy.yaml", show_default=True, help="Policy file name in that Secret."
)
@click.option(
    "--registry-secret", default=None, help="kubernetes.io/dockerconfigjson Secret for the registry."
)
@click.option("--modelpack-image", default=k8s.DEFAULT_MODELPACK_IMAGE, show_default=True)
@click.option(
    "--image", default="vllm/vllm-openai:latest", show_default=True, help="Serving container image."
)
@click.option("--name", default=None)
@click.option("--namespace", default=None)
@click.option("--resolve", is_flag=True, help="Resolve a tag to its digest now (needs registry access).")
@target_options
@json_option
@handle_errors
def k8s_init_container(reference: str, resolve: bool, as_json: bool, **kwargs: Any) -> None:
    """A Pod whose init container runs 'modelpack pull --cache' (verified, signature-checked)."""
    opts = {
        k: kwargs.pop(k)
        for k in (
            "cache_path",
            "cache_volume",
            "host_path",
            "size_limit",
            "policy_secret",
            "policy_key",
            "registry_secret",
            "modelpack_image",
            "image",
            "name",
            "namespace",
        )
    }
    ref = _resolve_if_asked(reference, resolve, kwargs)
    obj = k8s.init_container_pod(ref, **opts)
    notes = [
        "Init container: pulls, verifies digests (and signatures with --policy-secret), publishes a snapshot.",
        "The serving container reads $MODELPACK_MODEL_DIR (read-only); hostPath caches are shared per node.",
    ]
    _emit(obj, notes, as_json)


@k8s_group.command("prewarm")
@click.argument("references", nargs=-1, required=True)
@click.option("--node-selector", "selectors", multiple=True, required=True, metavar="KEY=VALUE")
@click.option("--host-path", default=k8s.DEFAULT_CACHE_HOST_PATH, show_default=True)
@click.option(
    "--interval", "interval_s", type=click.IntRange(10), default=300, show_default=True, help="Seconds."
)
@click.option("--policy-secret", default=None)
@click.option("--policy-key", default="policy.yaml", show_default=True)
@click.option("--registry-secret", default=None)
@click.option("--modelpack-image", default=k8s.DEFAULT_MODELPACK_IMAGE, show_default=True)
@click.option("--name", default="modelpack-prewarm", show_default=True)
@click.option("--namespace", default=None)
@click.option("--tolerate-all", is_flag=True, help="Also run on tainted (e.g. GPU) nodes.")
@json_option
@handle_errors
def k8s_prewarm(
    references: tuple[str, ...], selectors: tuple[str, ...], as_json: bool, **kwargs: Any
) -> None:
    """A DaemonSet that keeps REFERENCES pulled in the node cache of the selected nodes."""
    node_selector: dict[str, str] = {}
    for s in selectors:
        key, sep, value = s.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{s!r}: expected KEY=VALUE", param_hint="--node-selector")
        node_selector[key] = value
    obj = k8s.prewarm_daemonset(list(references), node_selector=node_selector, **kwargs)
    _emit(
        obj,
        ["Pre-warm: re-pulls every interval; a cached digest is a hit (no transfer, no hashing)."],
        as_json,
    )


__all__ = ["cache_dir_option", "cache_pull", "cache_pull_from_cli", "events_option"]
