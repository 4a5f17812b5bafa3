"""``pull``: a model's files into a directory, or a verified snapshot into the node cache.

This is the command a node runs on every pod start, usually as a cache hit that takes a few
milliseconds of work, so the process start is most of its cost: this module imports only
click and the shared options, and each branch imports the library it drives (the node
cache, the transfer API, signing) when it runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from modelpack.cli.options import (
    SIZE,
    build_target_options,
    emit_json,
    handle_errors,
    human_size,
    jobs_option,
    json_option,
    progress_option,
    selector_from,
    signals_interrupt,
    target_options,
    variant_options,
)
from modelpack.cli.trust_options import trust_policy_from
from modelpack.terminal import for_terminal

if TYPE_CHECKING:
    from modelpack.oci.variant_selection import VariantSelector
    from modelpack.transfer.materialize import PullResult
    from modelpack.transfer.pull_options import PullOptions


def pull_trust_options(fn: Any) -> Any:
    opts = [
        click.option(
            "--key", "trust_keys", multiple=True, help="Verify the signature with this public key first."
        ),
        click.option(
            "--policy",
            "trust_policy",
            type=click.Path(exists=True, dir_okay=False),
            help="Verify against this trust policy before any file is written.",
        ),
        click.option(
            "--signature",
            "signature_path",
            help="Also write the model_signing signature here (for `model_signing verify key` of the pulled "
            "directory or, with --cache, of the snapshot; there it needs --key or --policy).",
        ),
        click.option(
            "--events", "trust_events", help="Append JSON events (signing.*) here ('-' for stderr)."
        ),
        click.option(
            "--allow-rollback",
            is_flag=True,
            help="With --cache and a policy: accept a tag's version signed before the newest one this "
            "cache accepted for the tag (refused otherwise); it becomes the tag's newest.",
        ),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


def pull_into_directory(
    reference: str,
    dest_dir: str,
    options: PullOptions,
    kwargs: dict[str, Any],
    selector: VariantSelector,
) -> PullResult:
    """``pull REF DIR``: the trust flags (--key/--policy/--events) become the policy of
    ``modelpack.pull``'s trusted-resolve step (index verified, entry selected and verified,
    pinned by digest before a file is written); ``--signature`` is written afterwards with the
    policy's keys."""
    if kwargs.pop("allow_rollback", False):
        raise click.UsageError(
            "--allow-rollback applies to --cache pulls (the node cache keeps the tag history)"
        )
    signature = kwargs.pop("signature_path", None)
    events_spec = kwargs.pop("trust_events", None)
    policy = trust_policy_from(tuple(kwargs.pop("trust_keys", ()) or ()), kwargs.pop("trust_policy", None))
    topts = build_target_options(kwargs)
    from modelpack.api.transfer import pull_trusted
    from modelpack.events import EventLog

    events = EventLog.from_spec(None, events_spec) if events_spec else None
    with signals_interrupt():
        pinned, result = pull_trusted(
            reference,
            dest_dir,
            options,
            target_options=topts,
            policy=policy,
            selector=selector,
            events=events,
        )
    if signature:
        from modelpack.signing import write_directory_signature

        desc = pinned.target.resolve(pinned.digest)
        write_directory_signature(pinned.target, desc, signature, list(pinned.keys) or None)
    return result


def pull_into_cache(
    reference: str,
    cache_dir: str,
    kwargs: dict[str, Any],
    *,
    jobs: int,
    as_json: bool,
    max_cache_bytes: int | None = None,
    progress: str = "auto",
    hold: str | None = None,
    variant: Any = None,
) -> None:
    """``pull REF --cache DIR``: the pull command's trust flags (--key/--policy/--events) become
    the cache's policy and event log; the cache itself verifies, before publishing."""
    signature = kwargs.pop("signature_path", None)
    topts = build_target_options(kwargs)
    policy = trust_policy_from(tuple(kwargs.pop("trust_keys", ()) or ()), kwargs.pop("trust_policy", None))
    if signature and policy is None:
        raise click.UsageError(
            "--signature with --cache needs --key or --policy: the cache keeps only the signatures it verified"
        )
    events = kwargs.pop("trust_events", None)
    allow_rollback = bool(kwargs.pop("allow_rollback", False))
    from modelpack.cli.cache import cache_pull

    hold_s = _hold_seconds(hold)
    cache_pull(
        reference,
        cache_dir,
        target_options=topts,
        policy=policy,
        jobs=jobs,
        events=events,
        max_cache_bytes=max_cache_bytes,
        as_json=as_json,
        progress=progress,
        hold=hold_s,
        allow_rollback=allow_rollback,
        variant=variant,
        signature_path=signature,
    )


def _hold_seconds(hold: str | None) -> float | None:
    """``--hold``'s DURATION in seconds (None when not given)."""
    if hold is None:
        return None
    from modelpack.cli.cache import SECONDS

    try:
        return SECONDS.convert(hold, None, None)
    except click.BadParameter as exc:
        raise click.BadParameter(exc.message, param_hint="'--hold'") from None


def _hold_option(fn: Any) -> Any:
    # a plain string here, read as a duration by the cache branch: the pull-to-directory path
    # does not import the node cache's command module
    return click.option(
        "--hold",
        default=None,
        metavar="DURATION",
        help="With --cache: keep the snapshot (and each adapter's) from 'cache gc' for DURATION after the "
        "pull (e.g. 10m), so the process it is handed to finds it; that process's own lease protects it "
        "from then on.",
    )(fn)


def report_pull(result: PullResult) -> None:
    """The summary on stderr: counts, replaced files, and what the artifact does not contain."""
    replaced = f", {len(result.replaced)} replaced (--force)" if result.replaced else ""
    resumed = f", {human_size(result.resumed_bytes)} resumed" if result.resumed_bytes else ""
    click.echo(
        f"pulled {len(result.files)} files to {result.dest_dir}: {result.downloaded} downloaded "
        f"({human_size(result.bytes_downloaded)}{resumed}), {result.present} already present{replaced}",
        err=True,
    )
    if result.bytes_by_source:
        sources = ", ".join(f"{name} {human_size(n)}" for name, n in sorted(result.bytes_by_source.items()))
        click.echo(f"blob bytes by source: {sources}", err=True)
    for what, names in (
        ("not part of this artifact (kept; --delete removes them)", result.extra_files),
        ("not part of this artifact deleted (--delete)", result.deleted),
    ):
        if names:
            # names found in the destination (anyone who could write there chose them): inert
            shown = ", ".join(for_terminal(n) for n in names[:10])
            shown += f" and {len(names) - 10} more" if len(names) > 10 else ""
            click.echo(f"{len(names)} file(s) in {result.dest_dir} {what}: {shown}", err=True)


@click.command("pull")
@click.argument("reference")
@click.argument("dest_dir", type=click.Path(file_okay=False), required=False)
@click.option(
    "--cache",
    "cache_dir",
    default=None,
    metavar="DIR",
    help="Pull into the node cache DIR instead (verified snapshot; prints its path). DEST_DIR is then omitted.",
)
@click.option(
    "--max-cache-bytes", type=SIZE, default=None, help="With --cache: refuse to grow the cache past SIZE."
)
@_hold_option
@click.option("--include", multiple=True, metavar="GLOB", help="Only files matching GLOB (repeatable).")
@click.option("--exclude", multiple=True, metavar="GLOB", help="Skip files matching GLOB (repeatable).")
@click.option(
    "--force", is_flag=True, help="Replace files in DEST_DIR that differ from the artifact's (else: refuse)."
)
@click.option(
    "--delete",
    is_flag=True,
    help="Remove files in DEST_DIR that the artifact does not contain (else: list them), like rsync --delete.",
)
@click.option(
    "--max-bytes",
    type=SIZE,
    default=None,
    help="Write at most SIZE into DEST_DIR, tar layers counted as they expand (default: its free space).",
)
@click.option(
    "--keep-prefix",
    is_flag=True,
    help="For a container image (--format image, a KServe modelcar): write its models/ files under "
    "DEST_DIR/models/ as in the image (default: at their paths below models/, ready to load).",
)
@click.option(
    "--with-adapters",
    is_flag=True,
    help="Also pull every LoRA adapter whose subject is this base (each verified and checked against "
    "the policy): to DEST_DIR/adapters/NAME/, or each into its own --cache snapshot.",
)
@click.option(
    "--adapter",
    "adapter_refs",
    multiple=True,
    metavar="REF",
    help="Also pull the adapter at REF (repeatable); refused unless its subject is this base.",
)
@target_options
@pull_trust_options
@variant_options
@jobs_option
@progress_option
@json_option
@handle_errors
def pull_cmd(
    reference: str,
    dest_dir: str | None,
    include: tuple[str, ...],
    exclude: tuple[str, ...],
    jobs: int,
    progress: str,
    as_json: bool,
    **kwargs: Any,
) -> None:
    """Materialise the model at REFERENCE as files under DEST_DIR, each verified before it appears.

    Files are written to temp names and renamed only after their size and sha256 match the
    manifest. Files already present and correct are kept; a file that differs is refused
    unless --force; files the artifact does not contain are listed (removed with --delete).
    A download cut short by a full disk or a lost connection is kept and resumed next time.
    REFERENCE may also be a container image holding the model under models/ (the image-shaped
    variant, a KServe modelcar made by oci-modelcar or docker build): its models/ files are
    written without the prefix (--keep-prefix keeps it); the rest of the image is not written.

    \b
    Examples:
      modelpack pull registry.example.com/models/llama:v1 ./model
      modelpack pull reg.example/m@sha256:… ./model --include '*.json'
      modelpack pull reg.example/m:v2 ./model --force --delete
      modelpack pull quay.example/org/llama-modelcar:v1 ./model
      modelpack pull reg.example/m@sha256:… --cache /var/cache/modelpack --policy policy.yaml --json
      modelpack pull reg.example/m@sha256:… --cache /var/cache/modelpack --hold 10m
      modelpack pull reg.example/m@sha256:… --cache /var/cache/modelpack --with-adapters --hold 10m --json
    """
    with_adapters = kwargs.pop("with_adapters", False)
    adapter_refs = kwargs.pop("adapter_refs", ())
    if with_adapters or adapter_refs:
        if include or exclude or any(kwargs.get(k) for k in ("delete", "max_bytes", "keep_prefix")):
            raise click.UsageError(
                "--with-adapters/--adapter pull whole artifacts: drop --include/--exclude/--delete/"
                "--max-bytes/--keep-prefix"
            )
        hold = kwargs.pop("hold", None)
        for k in ("delete", "max_bytes", "keep_prefix", "max_cache_bytes"):
            kwargs.pop(k, None)
        cache_dir = kwargs.pop("cache_dir", None)
        if (dest_dir is None) == (cache_dir is None):
            raise click.UsageError("give DEST_DIR or --cache DIR")
        if hold is not None and cache_dir is None:
            raise click.UsageError("--hold keeps node-cache snapshots: it needs --cache DIR")
        from modelpack.cli.adapters import pull_with_adapters_cmd

        pull_with_adapters_cmd(
            reference,
            dest_dir,
            cache_dir,
            adapter_refs,
            with_adapters,
            jobs=jobs,
            progress=progress,
            as_json=as_json,
            force=kwargs.pop("force", False),
            hold=_hold_seconds(hold),
            kwargs=kwargs,
        )
        return
    cache_dir = kwargs.pop("cache_dir", None)
    max_cache_bytes = kwargs.pop("max_cache_bytes", None)
    hold = kwargs.pop("hold", None)
    force = kwargs.pop("force", False)
    delete = kwargs.pop("delete", False)
    max_bytes = kwargs.pop("max_bytes", None)
    keep_prefix = kwargs.pop("keep_prefix", False)
    selector = selector_from(kwargs)  # an index of variants: the entry that fits this node
    if cache_dir is not None:
        if dest_dir is not None or include or exclude:
            raise click.UsageError(
                "--cache pulls the whole model into the cache: drop DEST_DIR/--include/--exclude"
            )
        if force or delete or max_bytes is not None or keep_prefix:
            raise click.UsageError(
                "--force/--delete/--max-bytes/--keep-prefix apply to DEST_DIR; the cache never overwrites "
                "(cap it with --max-cache-bytes)"
            )
        pull_into_cache(
            reference,
            cache_dir,
            kwargs,
            jobs=jobs,
            as_json=as_json,
            max_cache_bytes=max_cache_bytes,
            progress=progress,
            hold=hold,
            variant=selector,
        )
        return
    if hold is not None:
        raise click.UsageError("--hold keeps a node-cache snapshot: it needs --cache DIR")
    if dest_dir is None:
        raise click.UsageError("missing DEST_DIR (or give --cache DIR)")
    from modelpack.transfer.pull_options import PullOptions

    options = PullOptions(
        include=include,
        exclude=exclude,
        jobs=jobs,
        progress=progress,
        force=force,
        delete=delete,
        max_bytes=max_bytes,
        keep_prefix=keep_prefix,
    )
    result = pull_into_directory(reference, dest_dir, options, kwargs, selector)
    if as_json:
        emit_json(result.to_json())
        return
    if result.variant:
        fields = " ".join(f"{k}={v}" for k, v in result.variant["variant"].items())
        click.echo(f"variant {for_terminal(fields)} of index {result.variant['index']}", err=True)
    report_pull(result)
    click.echo(result.digest)
