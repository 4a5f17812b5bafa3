"""``push``, ``cp``, ``tag``, ``login``, ``logout``: thin skins over ``modelpack.api.transfer``.

Each command parses its options, calls one library function and prints the result, so later
options (signing on push) extend the library call, not the command. ``pull`` has its own module
(``modelpack.cli.pull``): nodes run it on every start and it must not import what these need.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import click

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
    read_passphrase,
    target_options,
)
from modelpack.cli.pack_options import format_options, pack_options, pack_options_from
from modelpack.oci.reference import parse_reference
from modelpack.targets.opener import TargetOptions, open_target


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


def push_sign_options(fn: Any) -> Any:
    opts = [
        click.option("--sign-key", help="Sign after pushing: private key PEM file or env:VAR."),
        click.option(
            "--sign-passphrase-stdin",
            is_flag=True,
            help="Read the signing key passphrase from stdin (else MODELPACK_SIGNING_PASSPHRASE).",
        ),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


class _LocalFiles:
    """Read-only view of a checkpoint directory by manifest layer, for hashing chunk tables from
    the files a push just uploaded (no second download). Only ``fetch_blob`` is needed."""

    def __init__(self, directory: str, manifest: Any) -> None:
        from modelpack.mediatypes import layer_filepath
        from modelpack.mediatypes.annotations import safe_relative_path

        self.name = f"dir:{directory}"
        self._paths = {}
        for layer in manifest.layers:
            rel = layer_filepath(layer.annotations)
            if rel:
                self._paths[str(layer.digest)] = os.path.join(directory, safe_relative_path(rel))

    def covers(self, layers: list[Any]) -> bool:
        for layer in layers:
            path = self._paths.get(str(layer.digest))
            if path is None or not os.path.isfile(path) or os.path.getsize(path) != layer.size:
                return False
        return True

    def fetch_blob(self, descriptor: Any, offset: int = 0) -> Any:
        f = open(self._paths[str(descriptor.digest)], "rb")
        if offset:
            f.seek(offset)
        return f


def sign_after_push(
    source: str,
    destination: str,
    digest: str,
    kwargs: dict[str, Any],
    target_options: TargetOptions,
) -> dict[str, Any] | None:
    """Pop the push signing options from ``kwargs``; when ``--sign-key`` was given, sign the
    pushed manifest (chunk table hashed from the local files when SOURCE is a directory; each
    file's whole sha256 is checked against its layer in the same pass)."""
    key_spec = kwargs.pop("sign_key", None)
    from_stdin = kwargs.pop("sign_passphrase_stdin", False)
    if not key_spec:
        return None
    from modelpack.signing import load_private_key, sign_artifact
    from modelpack.signing.chunks import _weight_layers, compute_chunk_table
    from modelpack.targets.fetch import fetch_manifest

    key = load_private_key(key_spec, read_passphrase(from_stdin))
    ref = parse_reference(destination)
    target = open_target(ref, target_options, for_write=True)
    manifest, _ = fetch_manifest(target, digest)
    desc = target.resolve(digest)
    table: Any = True
    weights = _weight_layers(manifest)
    if os.path.isdir(source) and weights:
        local = _LocalFiles(source, manifest)
        # re-sharded files (--max-file-size) are not on disk as layers: then read the blobs back
        if local.covers(weights):
            table = compute_chunk_table(local, manifest)  # type: ignore[arg-type]
    return sign_artifact(target, desc, key, chunk_table=table, reference=ref).to_json()


@click.command("push")
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


@click.command("cp")
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


@click.command("tag")
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
    """Remove stored credentials for REGISTRY."""
    if transfer.logout(registry):
        click.echo(f"removed credentials for {registry}")
    else:
        click.echo(f"no credentials stored for {registry}", err=True)
        sys.exit(1)
