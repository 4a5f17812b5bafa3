"""``push``, ``pull``, ``cp``, ``tag``, ``login``, ``logout``: thin skins over ``modelpack.api.transfer``.

Each command parses its options, calls one library function and prints the result, so later
options (signing on push, cache/policy on pull) extend the library call, not the command.
"""

from __future__ import annotations

import sys
from typing import Any

import click

from modelpack.api import transfer
from modelpack.cli import (
    SIZE,
    build_target_options,
    emit_json,
    handle_errors,
    human_size,
    jobs_option,
    json_option,
    main,
    progress_option,
    target_options,
)
from modelpack.cli.pack import format_options, pack_options, pack_options_from
from modelpack.cli.trust import (
    after_pull,
    pull_trust_options,
    push_sign_options,
    sign_after_push,
    verify_before_pull,
)
from modelpack.targets.opener import TargetOptions


def chunk_size_option(fn: Any) -> Any:
    return click.option(
        "--chunk-size",
        type=SIZE,
        default=None,
        help="Upload blobs larger than SIZE in resumable chunks of SIZE (default 64 MiB).",
    )(fn)


def _with_chunk_size(topts: TargetOptions, chunk_size: int | None) -> TargetOptions:
    if chunk_size:
        topts.extra["chunk_size"] = chunk_size
    return topts


@main.command("push")
@click.argument("source")
@click.argument("destination")
@pack_options
@format_options
@target_options
@chunk_size_option
@push_sign_options
@jobs_option
@progress_option
@json_option
@handle_errors
def push_cmd(
    source: str,
    destination: str,
    chunk_size: int | None,
    jobs: int,
    progress: str,
    as_json: bool,
    **kwargs: Any,
) -> None:
    """Push SOURCE (a checkpoint directory, or oci:LAYOUT:TAG / s3://…) to DESTINATION.

    A directory is packed on the fly and uploaded straight from its files (no copy on disk).
    Blobs the registry already has are skipped, so pushing the same checkpoint twice uploads
    nothing. Prints the manifest digest on stdout (pin it in deployments).

    \b
    Examples:
      modelpack push ./llama-8b registry.example.com/models/llama:v1
      modelpack push oci:./layout:v1 127.0.0.1:5000/models/llama:v1
      echo "$TOKEN" | modelpack push ./ckpt reg.example/m:v1 -u ci --password-stdin
    """
    artifact_format = kwargs.pop("artifact_format", "artifact")
    compression = kwargs.pop("compression", None)
    popts = pack_options_from(kwargs, progress)
    topts = _with_chunk_size(build_target_options(kwargs), chunk_size)
    result = transfer.push(
        source,
        destination,
        pack_options=popts,
        target_options=topts,
        jobs=jobs,
        progress=progress,
        format=artifact_format,
        compression=compression,
    )
    signed = sign_after_push(source, destination, result.digest, kwargs, topts)
    if as_json:
        emit_json({**result.to_json(), **({"signed": signed} if signed else {})})
        return
    if signed:
        click.echo(f"signed {result.digest} with key {signed['keyId'][:16]}", err=True)
    c = result.copy
    click.echo(
        f"pushed {result.reference}: {c.blobs_copied} uploaded ({human_size(c.bytes_copied)}), "
        f"{c.blobs_skipped} already there, {c.blobs_mounted} mounted",
        err=True,
    )
    click.echo(result.digest)


@main.command("pull")
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
@click.option("--include", multiple=True, metavar="GLOB", help="Only files matching GLOB (repeatable).")
@click.option("--exclude", multiple=True, metavar="GLOB", help="Skip files matching GLOB (repeatable).")
@target_options
@pull_trust_options
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
    manifest; a failure leaves no partial file. Files already present and correct are kept.

    \b
    Examples:
      modelpack pull registry.example.com/models/llama:v1 ./model
      modelpack pull reg.example/m@sha256:… ./model --include '*.json'
      modelpack pull reg.example/m@sha256:… --cache /var/cache/modelpack --policy policy.yaml --json
    """
    cache_dir = kwargs.pop("cache_dir", None)
    max_cache_bytes = kwargs.pop("max_cache_bytes", None)
    if cache_dir is not None:  # node cache (modelpack.cli.node / modelpack.mount)
        from modelpack.cli.node import cache_pull_from_cli

        if dest_dir is not None or include or exclude:
            raise click.UsageError(
                "--cache pulls the whole model into the cache: drop DEST_DIR/--include/--exclude"
            )
        cache_pull_from_cli(
            reference, cache_dir, kwargs, jobs=jobs, as_json=as_json, max_cache_bytes=max_cache_bytes
        )
        return
    if dest_dir is None:
        raise click.UsageError("missing DEST_DIR (or give --cache DIR)")
    topts = build_target_options(kwargs)
    reference, trust = verify_before_pull(reference, kwargs, topts)
    result = transfer.pull(
        reference,
        dest_dir,
        target_options=topts,
        include=include,
        exclude=exclude,
        jobs=jobs,
        progress=progress,
    )
    after_pull(reference, result.digest, trust, topts)
    if as_json:
        emit_json(result.to_json())
        return
    click.echo(
        f"pulled {len(result.files)} files to {result.dest_dir}: {result.downloaded} downloaded "
        f"({human_size(result.bytes_downloaded)}), {result.present} already present",
        err=True,
    )
    click.echo(result.digest)


@main.command("cp")
@click.argument("source")
@click.argument("destination")
@click.option("--referrers", is_flag=True, help="Also copy manifests that refer to it (signatures…).")
@target_options
@chunk_size_option
@jobs_option
@progress_option
@json_option
@handle_errors
def cp_cmd(
    source: str,
    destination: str,
    referrers: bool,
    chunk_size: int | None,
    jobs: int,
    progress: str,
    as_json: bool,
    **kwargs: Any,
) -> None:
    """Copy an artifact between any two places (registry, oci:DIR, s3://…), digests unchanged.

    Within one registry, blobs are mounted across repositories instead of re-uploaded.
    """
    result = transfer.cp(
        source,
        destination,
        target_options=_with_chunk_size(build_target_options(kwargs), chunk_size),
        jobs=jobs,
        referrers=referrers,
        progress=progress,
    )
    if as_json:
        emit_json(result.to_json())
        return
    click.echo(
        f"copied {result.blobs_copied} blobs ({human_size(result.bytes_copied)}), "
        f"{result.blobs_skipped} already there, {result.blobs_mounted} mounted",
        err=True,
    )
    click.echo(str(result.descriptor.digest))


@main.command("tag")
@click.argument("reference")
@click.argument("new_tag")
@target_options
@json_option
@handle_errors
def tag_cmd(reference: str, new_tag: str, as_json: bool, **kwargs: Any) -> None:
    """Point NEW_TAG (same repository) at the manifest REFERENCE names."""
    digest = transfer.tag(reference, new_tag, target_options=build_target_options(kwargs))
    if as_json:
        emit_json({"tag": new_tag, "digest": digest})
        return
    click.echo(digest)


@main.command("login")
@click.argument("registry")
@click.option("--username", "-u", required=True, help="User name.")
@click.option("--password-stdin", is_flag=True, help="Read the password from stdin (the only way).")
@click.option("--plain-http", is_flag=True, help="Use HTTP (always allowed for loopback).")
@click.option("--ca-file", type=click.Path(exists=True, dir_okay=False), help="PEM CA bundle.")
@handle_errors
def login_cmd(
    registry: str, username: str, password_stdin: bool, plain_http: bool, ca_file: str | None
) -> None:
    """Check credentials against REGISTRY and store them in Docker's config.json.

    Passwords are read from stdin only, never from the command line (it ends up in shell
    history and process lists). A credsStore/credHelpers entry in config.json is honoured.
    """
    if not password_stdin:
        raise click.UsageError("pass the password on stdin with --password-stdin")
    password = sys.stdin.readline().rstrip("\n")
    if not password:
        raise click.UsageError("empty password on stdin")
    topts = build_target_options({"plain_http": plain_http, "ca_file": ca_file})
    where = transfer.login(registry, username, password, target_options=topts)
    click.echo(f"login succeeded; credentials stored in {where}")


@main.command("logout")
@click.argument("registry")
@handle_errors
def logout_cmd(registry: str) -> None:
    """Remove stored credentials for REGISTRY."""
    if transfer.logout(registry):
        click.echo(f"removed credentials for {registry}")
    else:
        click.echo(f"no credentials stored for {registry}", err=True)
        sys.exit(1)
