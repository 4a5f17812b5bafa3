"""``push``, ``cp``, ``tag``, ``login``, ``logout``: thin skins over ``modelpack.api.transfer``.

Each command parses its options, calls one library function and prints the result, so later
options (signing on push) extend the library call, not the command. ``pull`` has its own module
(``modelpack.cli.pull``): nodes run it on every start and it must not import what these need.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import click

from modelpack import settings
from modelpack.api import transfer
from modelpack.cli.options import (
    SIZE,
    build_target_options,
    emit_json,
    handle_errors,
    human_size,
    jobs_option,
    json_option,
    progress_option,
    target_options,
)
from modelpack.cli.pack_options import (
    check_spec_names_format,
    format_options,
    modelfile_option,
    pack_options,
    pack_options_from,
    spec_names_option,
)
from modelpack.cli.trust_options import push_sign_options, push_signing_key
from modelpack.exit_codes import ExitCode
from modelpack.oci.reference import parse_reference
from modelpack.targets.opener import TargetOptions
from modelpack.targets.registry.hosts import same_registry


def chunk_size_option(fn: Any) -> Any:
    return click.option(
        "--chunk-size",
        type=SIZE,
        default=None,
        help="Upload blobs larger than SIZE in resumable chunks of SIZE (default 64 MiB).",
    )(fn)


def _with_chunk_size(topts: TargetOptions, chunk_size: int | None) -> TargetOptions:
    return dataclasses.replace(topts, chunk_size=chunk_size) if chunk_size else topts


@click.command("push")
@click.argument("source")
@click.argument("destination")
@pack_options
@modelfile_option
@format_options
@target_options
@chunk_size_option
@push_sign_options
@click.option(
    "--mount-from",
    "mount_from",
    multiple=True,
    metavar="REPO",
    help="Mount blobs the registry holds in REPO (same registry, e.g. models/llama) instead of "
    "uploading them (repeatable). Without it, blobs this user pushed before are mounted from "
    "where they went.",
)
@click.option(
    "--base",
    metavar="REF",
    default=None,
    help="SOURCE is a PEFT LoRA adapter directory: push it as an adapter of the base model REF "
    "(same repository: @sha256:…, or a tag, resolved once and pinned); its manifest's subject is the base.",
)
@click.option(
    "--variant",
    "variant",
    multiple=True,
    metavar="KEY=VALUE",
    help="Push SOURCE by digest as a variant and add it to the index of variants at DESTINATION "
    "(created if absent), replacing the entry with the same fields; KEY is precision, quantization, "
    "tp-size, accelerator, engine or layout (over what SOURCE's config says). Repeatable.",
)
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
    nothing; --spec-names cnai writes the media types released Harbor recognises (a stored
    SOURCE is then respelled as by 'cp --spec-names'); into a new repository, blobs this user pushed to another repository of the same
    registry (or that --mount-from REPO holds) are mounted, not uploaded. Prints the manifest
    digest on stdout (pin it in deployments).

    With --sign-key the key is checked before anything is uploaded, and the tag is written only
    after the signatures are stored: a failed signing leaves no tag on an unsigned model.

    \b
    Examples:
      modelpack push ./llama-8b registry.example.com/models/llama:v1
      modelpack push oci:./layout:v1 127.0.0.1:5000/models/llama:v1
      modelpack push hf://Qwen/Qwen3-0.6B@main registry.example.com/models/qwen3:main
      modelpack push ./llama-8b registry.example.com/team-b/llama:v1 --mount-from models/llama
      modelpack push ./llama-8b registry.example.com/models/llama:v1 --sign-key env:MODELPACK_SIGNING_KEY
      echo "$TOKEN" | modelpack push ./ckpt reg.example/m:v1 -u ci --password-stdin
      modelpack push ./my-lora reg.example/models/llama:my-lora --base @sha256:… --name my-lora
      modelpack push ./llama-8b-tp2 reg.example/models/llama:v1 --variant tp-size=2 --variant layout=sharded_state
    """
    if kwargs.get("variant"):
        _push_variant(source, destination, jobs, progress, as_json, kwargs)
        return
    kwargs.pop("variant", None)
    if kwargs.get("base") is not None:
        from modelpack.cli.adapters import push_adapter_cmd

        push_adapter_cmd(source, destination, chunk_size, jobs, progress, as_json, kwargs)
        return
    kwargs.pop("base", None)
    artifact_format = kwargs.pop("artifact_format", "artifact")
    compression = kwargs.pop("compression", None)
    mount_from = kwargs.pop("mount_from", ())
    modelfile = kwargs.pop("modelfile", None)
    spec_names = kwargs.get("spec_names")
    check_spec_names_format(spec_names, artifact_format)
    popts = pack_options_from(kwargs, progress)
    topts = _with_chunk_size(build_target_options(kwargs, registry=destination), chunk_size)
    key = push_signing_key(kwargs)  # after --password-stdin's line, before any upload
    result = transfer.push(
        source,
        destination,
        pack_options=popts,
        target_options=topts,
        jobs=jobs,
        progress=progress,
        format=artifact_format,
        compression=compression,
        sign_key=key,
        mount_from=mount_from,
        modelfile=modelfile,
        spec_names=spec_names,
    )
    signed = result.signed
    if as_json:
        emit_json(result.to_json())
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


def _push_variant(
    source: str, destination: str, jobs: int, progress: str, as_json: bool, kwargs: dict[str, Any]
) -> None:
    """``push SRC REF --variant K=V…``: SRC by digest, then the index at REF with it (api.variants)."""
    from modelpack.api.variants import push_variant
    from modelpack.cli.index import print_variants

    if kwargs.get("base") is not None or kwargs.get("modelfile") or kwargs.get("artifact_format") == "image":
        raise click.UsageError("--variant pushes a model artifact: drop --base/--modelfile/--format image")
    variant = kwargs.pop("variant")
    popts = pack_options_from(kwargs, progress)
    topts = build_target_options(kwargs, registry=destination)
    key = push_signing_key(kwargs)
    result = push_variant(
        source,
        destination,
        variant,
        target_options=topts,
        sign_key=key,
        jobs=jobs,
        progress=progress,
        pack_options=popts,
    )
    if as_json:
        emit_json(result.to_json())
        return
    click.echo(f"index {result.reference}: {len(result.index.entries)} variants", err=True)
    print_variants(result.index.to_json(), err=True)
    click.echo(result.digest)


def cp_credentials_options(fn: Any) -> Any:
    """skopeo's ``--src-creds``/``--dest-creds``: each set of credentials for one side only."""
    opts = [
        click.option(
            "--src-creds",
            metavar="USER[:PASSWORD]",
            envvar=settings.SRC_CREDS.name,
            help="Credentials for the SOURCE registry only (no PASSWORD: read a line of stdin).",
        ),
        click.option(
            "--dest-creds",
            metavar="USER[:PASSWORD]",
            envvar=settings.DEST_CREDS.name,
            help="Credentials for the DESTINATION registry only (same as -u/--password-stdin).",
        ),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


def _registry_location(reference: str, flag: str) -> str:
    ref = parse_reference(reference)
    if ref.scheme != "registry":
        raise click.UsageError(f"{flag} applies to a registry, and {reference} is not one")
    return ref.location


def _split_creds(value: str, flag: str) -> tuple[str, str]:
    user, sep, password = value.partition(":")
    if not user:
        raise click.UsageError(f"{flag} needs USER[:PASSWORD]")
    if not sep:
        password = sys.stdin.readline().rstrip("\n")
        if not password:
            raise click.UsageError(f"{flag} {user}: no password on stdin")
    return user, password


def cp_target_options(
    kwargs: dict[str, Any], source: str, destination: str, src_creds: str | None, dest_creds: str | None
) -> TargetOptions:
    """Connection options for ``cp``: -u/--password-stdin and the environment's credentials
    belong to DESTINATION; ``--src-creds`` to SOURCE alone; nothing is shared between them."""
    if dest_creds and kwargs.get("username"):
        raise click.UsageError("give --dest-creds or -u/--password-stdin, not both")
    topts = build_target_options(kwargs, registry=destination)
    creds: dict[str, tuple[str, str]] = {}
    if src_creds:
        src_host = _registry_location(source, "--src-creds")
        creds[src_host] = _split_creds(src_creds, "--src-creds")
    if dest_creds:
        dst_host = _registry_location(destination, "--dest-creds")
        pair = _split_creds(dest_creds, "--dest-creds")
        if any(same_registry(h, dst_host) and c != pair for h, c in creds.items()):
            raise click.UsageError(
                f"SOURCE and DESTINATION are both on {dst_host}: one set of credentials serves both"
            )
        creds[dst_host] = pair
    topts.registry_credentials = creds
    return topts


@click.command("cp")
@click.argument("source")
@click.argument("destination")
@click.option("--referrers", is_flag=True, help="Also copy manifests that refer to it (signatures…).")
@spec_names_option(
    "Write the model manifest with its ModelPack media types in this naming (cnai: released "
    "Harbor; cncf: the spec): the same blobs under a new manifest digest, whose signatures do not "
    "carry over (refused with --referrers; sign the copy). Default: the manifest as it is."
)
@target_options
@cp_credentials_options
@chunk_size_option
@jobs_option
@progress_option
@json_option
@handle_errors
def cp_cmd(
    source: str,
    destination: str,
    referrers: bool,
    spec_names: str | None,
    src_creds: str | None,
    dest_creds: str | None,
    chunk_size: int | None,
    jobs: int,
    progress: str,
    as_json: bool,
    **kwargs: Any,
) -> None:
    """Copy an artifact between any two places (registry, oci:DIR, s3://…), digests unchanged.

    Within one registry, blobs are mounted across repositories instead of re-uploaded.
    Credentials belong to one side: -u/--password-stdin (and MODELPACK_REGISTRY_USERNAME/PASSWORD)
    to DESTINATION, --src-creds to SOURCE; each registry also gets its own 'modelpack login' entry.
    --spec-names cnai|cncf respells a model manifest's media types (a new digest, same blobs).

    \b
    Examples:
      modelpack cp reg-a.example/models/llama:v1 reg-b.example/models/llama:v1 --referrers
      echo "$CI_TOKEN" | modelpack cp mirror.example/m:v1 reg.example/m:v1 -u ci --password-stdin
      modelpack cp 127.0.0.1:5000/models/llama:v1 oci:./layout:v1 --retry-for 5m
      modelpack cp reg.example/models/llama:v1 harbor.example/models/llama:v1 --spec-names cnai
    """
    if spec_names is not None and referrers:
        raise click.UsageError(
            "--spec-names writes a new manifest digest and the referrers (signatures) name the old "
            "one: copy without --referrers, then sign the copy"
        )
    result = transfer.cp(
        source,
        destination,
        target_options=_with_chunk_size(
            cp_target_options(kwargs, source, destination, src_creds, dest_creds), chunk_size
        ),
        jobs=jobs,
        referrers=referrers,
        progress=progress,
        spec_names=spec_names,
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


@click.command("tag")
@click.argument("reference")
@click.argument("new_tag")
@target_options
@json_option
@handle_errors
def tag_cmd(reference: str, new_tag: str, as_json: bool, **kwargs: Any) -> None:
    """Point NEW_TAG (same repository) at the manifest REFERENCE names.

    \b
    Examples:
      modelpack tag registry.example.com/models/llama:v1 stable
      modelpack tag registry.example.com/models/llama@sha256:<digest> v1.1
    """
    digest = transfer.tag(reference, new_tag, target_options=build_target_options(kwargs, registry=reference))
    if as_json:
        emit_json({"tag": new_tag, "digest": digest})
        return
    click.echo(digest)


@click.command("login")
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
    The entry is keyed by REGISTRY and used for that host only.

    \b
    Examples:
      echo "$TOKEN" | modelpack login registry.example.com -u ci-bot --password-stdin
      modelpack login 127.0.0.1:5000 -u admin --password-stdin < password.txt
    """
    if not password_stdin:
        raise click.UsageError("pass the password on stdin with --password-stdin")
    password = sys.stdin.readline().rstrip("\n")
    if not password:
        raise click.UsageError("empty password on stdin")
    topts = build_target_options({"plain_http": plain_http, "ca_file": ca_file})
    where = transfer.login(registry, username, password, target_options=topts)
    click.echo(f"login succeeded; credentials stored in {where}")


@click.command("logout")
@click.argument("registry")
@handle_errors
def logout_cmd(registry: str) -> None:
    """Remove stored credentials for REGISTRY.

    \b
    Examples:
      modelpack logout registry.example.com
    """
    if transfer.logout(registry):
        click.echo(f"removed credentials for {registry}")
    else:
        click.echo(f"no credentials stored for {registry}", err=True)
        sys.exit(ExitCode.FAILURE)
