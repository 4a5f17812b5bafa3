"""``index create|show``: one reference for several variants of a model (an OCI image index).

Thin skins over ``modelpack.api.variants``; selection (``pull``/``load``/``storage-initializer``
``--variant``) is ``modelpack.oci.variant_selection``.
"""

from __future__ import annotations

from typing import Any

import click

from modelpack.cli.options import (
    build_target_options,
    emit_json,
    handle_errors,
    jobs_option,
    json_option,
    node_accelerator,
    progress_option,
    target_options,
)
from modelpack.cli.trust_options import read_passphrase
from modelpack.terminal import for_terminal


def parse_entry_overrides(items: tuple[str, ...], count: int) -> dict[int, dict[str, str]]:
    """``--variant N:KEY=VALUE`` (N counts the VARIANT_REFs from 1) → {N-1: {KEY: VALUE}}."""
    from modelpack.oci.variant_selection import parse_variant_options

    grouped: dict[int, list[str]] = {}
    for item in items:
        pos, sep, rest = item.partition(":")
        if not sep or not pos.isdigit() or not 1 <= int(pos) <= count:
            raise click.UsageError(
                f"--variant {item!r}: write N:KEY=VALUE, N the position of a VARIANT_REF (1..{count})"
            )
        grouped.setdefault(int(pos) - 1, []).append(rest)
    return {i: parse_variant_options(v) for i, v in grouped.items()}


def print_variants(doc: dict[str, Any], *, err: bool = False) -> None:
    """One line per variant: position, digest, fields (all escaped by the terminal layer)."""
    for v in doc["variants"]:
        fields = " ".join(f"{k}={x}" for k, x in v["variant"].items()) or "(no variant fields)"
        click.echo(f"  #{v['position']} {v['digest']}  {for_terminal(fields)}", err=err)


@click.group("index")
def index_group() -> None:
    """Write and show variant indexes: one reference, several layouts of a model.

    \b
    An index lists ModelPack manifests of one model (bf16 and f32, a TP-sharded layout, a
    quantized build), each annotated dev.modelpack.variant.{precision,quantization,tp-size,
    accelerator,engine,layout}. pull, load, the vLLM load format and the KServe initializer
    take the entry that fits the node (or --variant KEY=VALUE) and refuse when none or
    several fit equally.

    \b
    Example:
      modelpack index create reg.example/m/llama:v1 reg.example/m/llama:v1-bf16 reg.example/m/llama:v1-f32 \\
          --variant 2:accelerator=cpu --sign-key env:MODELPACK_SIGNING_KEY
      modelpack pull reg.example/m/llama:v1 /models/llama --variant precision=bf16
    """


@index_group.command("create")
@click.argument("reference")
@click.argument("variant_refs", nargs=-1, required=True)
@click.option(
    "--variant",
    "overrides",
    multiple=True,
    metavar="N:KEY=VALUE",
    help="Set a variant field of the N-th VARIANT_REF (from 1) over what its config and annotations "
    "say; KEY is precision, quantization, tp-size, accelerator, engine or layout. Repeatable.",
)
@click.option(
    "--sign-key", help="Sign every entry this key has not signed, then the index (PEM file or env:VAR)."
)
@click.option("--passphrase-stdin", is_flag=True, help="Read the signing key's passphrase from stdin.")
@target_options
@jobs_option
@progress_option
@json_option
@handle_errors
def create_cmd(
    reference: str,
    variant_refs: tuple[str, ...],
    overrides: tuple[str, ...],
    sign_key: str | None,
    passphrase_stdin: bool,
    jobs: int,
    progress: str,
    as_json: bool,
    **kwargs: Any,
) -> None:
    """Write an OCI image index at REFERENCE whose entries are the VARIANT_REFs' manifests.

    Each variant is copied into REFERENCE's repository if it is elsewhere (blobs mounted or
    skipped when there, signatures copied along; manifest bytes and digests unchanged). Its
    entry carries precision and quantization from its config, the dev.modelpack.variant.*
    annotations of its manifest, then your --variant N:KEY=VALUE. Two entries with the same
    fields are refused (no node could tell them apart). With --sign-key, every entry not yet
    signed by that key is signed, then the index; the tag is written last. Prints the index digest.

    \b
    Examples:
      modelpack index create reg.example/m/llama:v1 reg.example/m/llama:bf16 reg.example/m/llama:f32
      modelpack index create oci:./layout:v1 oci:./layout:bf16 oci:./tp2:v1 --variant 2:engine=vllm
    """
    from modelpack.api.variants import create_index

    topts = build_target_options(kwargs, registry=reference)
    per_entry = parse_entry_overrides(overrides, len(variant_refs))
    key = None
    if sign_key:
        from modelpack.signing import load_private_key

        key = load_private_key(sign_key, read_passphrase(passphrase_stdin))
    result = create_index(
        reference,
        list(variant_refs),
        overrides=per_entry,
        target_options=topts,
        sign_key=key,
        jobs=jobs,
        progress=progress,
    )
    if as_json:
        emit_json(result.to_json())
        return
    click.echo(f"index {result.reference}: {len(result.index.entries)} variants", err=True)
    print_variants(result.index.to_json(), err=True)
    for digest, what in result.signed.items():
        click.echo(f"  {what}: {digest}", err=True)
    click.echo(result.digest)


@index_group.command("show")
@click.argument("reference")
@click.option(
    "--variant",
    "variant",
    multiple=True,
    metavar="KEY=VALUE",
    help="Also say which entry this node would take with these fields (as pull --variant).",
)
@click.option("--tp-size", type=click.IntRange(1, 4096), help="The TP size to select for (default 1).")
@click.option("--engine", help="The engine to select for (vllm, …).")
@click.option(
    "--device", default="auto", show_default=True, help="Device arch from this device (cpu, cuda:0)."
)
@target_options
@json_option
@handle_errors
def show_cmd(
    reference: str,
    variant: tuple[str, ...],
    tp_size: int | None,
    engine: str | None,
    device: str,
    as_json: bool,
    **kwargs: Any,
) -> None:
    """List REFERENCE's variants and say which one this node would take, and why the others not.

    \b
    Example:
      modelpack index show reg.example/m/llama:v1 --variant precision=bf16 --tp-size 2
    """
    from modelpack.api.variants import inspect_index
    from modelpack.errors import ModelpackError, VariantSelectionError
    from modelpack.oci.variant_selection import VariantSelector

    vi = inspect_index(reference, build_target_options(kwargs, registry=reference))
    if vi is None:
        raise ModelpackError(f"{reference}: a model manifest, not an index of variants")
    selector = VariantSelector.from_options(
        variant, accelerator=node_accelerator(device), tp_size=tp_size, engine=engine
    )
    doc: dict[str, Any] = {"reference": reference, **vi.to_json()}
    try:
        doc["selection"] = selector.select(vi).to_json()
    except VariantSelectionError as exc:
        doc["selection"] = {"error": str(exc), "reasons": exc.reasons, "candidates": exc.candidates}
    if as_json:
        emit_json(doc)
        return
    click.echo(f"{for_terminal(reference)}: index {vi.digest}, {len(vi.entries)} variants")
    print_variants(doc)
    sel = doc["selection"]
    click.echo(
        f"this node: {sel['chosen']}" if "chosen" in sel else f"this node: {for_terminal(sel['error'])}"
    )
