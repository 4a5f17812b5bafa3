"""``pack``, ``inspect``, ``ls``."""

from __future__ import annotations

import os
from typing import Any

import click

from modelpack import api
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
from modelpack.packing.packer import OTHER_FILE_CHOICES, PackOptions


def pack_options(fn: Any) -> Any:
    opts = [
        click.option(
            "--include",
            multiple=True,
            metavar="GLOB",
            help="Only pack files matching GLOB (path or name; repeatable).",
        ),
        click.option(
            "--exclude", multiple=True, metavar="GLOB", help="Skip files matching GLOB (repeatable)."
        ),
        click.option(
            "--other-files",
            type=click.Choice(OTHER_FILE_CHOICES),
            default="doc",
            show_default=True,
            help="Layer kind for files that are not weights, configs/tokenizers, docs or code; "
            "marked org.cncf.model.file.mediatype.untested. 'refuse' fails instead.",
        ),
        click.option("--name", help="Model name (default: the directory name)."),
        click.option("--version", "model_version", help="Model version."),
        click.option("--family", help="Model family (default: config.json model_type)."),
        click.option("--architecture", help="Architecture (default: config.json architectures[0])."),
        click.option("--param-size", help="Parameter count, e.g. 8B (default: counted from the headers)."),
        click.option(
            "--precision", help="Precision (default: config.json torch_dtype, else the dominant dtype)."
        ),
        click.option("--quantization", help="Quantization (default: config.json quantization_config)."),
        click.option("--vendor", help="Vendor."),
        click.option("--description", help="Description."),
        click.option("--license", "licenses", multiple=True, help="SPDX license id (repeatable)."),
        click.option(
            "--created", help="RFC 3339 timestamp to record; omitted by default so packs are reproducible."
        ),
        click.option(
            "--max-file-size",
            type=SIZE,
            help="Re-shard safetensors files larger than SIZE at tensor boundaries.",
        ),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


def format_options(fn: Any) -> Any:
    """``--format artifact|image`` and ``--compression zstd`` (image-shaped variant, DESIGN §2)."""
    fn = click.option(
        "--compression",
        type=click.Choice(["zstd"]),
        default=None,
        help="Compress the tar layers of --format image with zstd (+zstd layer media type).",
    )(fn)
    return click.option(
        "--format",
        "artifact_format",
        type=click.Choice(["artifact", "image"]),
        default="artifact",
        show_default=True,
        help="artifact: ModelPack, one raw layer per file (CRI-O image volumes, our pull). image: an OCI "
        "image with files under models/ (containerd >= 2.1 image volumes).",
    )(fn)


def pack_options_from(kwargs: dict[str, Any], progress: str) -> PackOptions:
    return PackOptions(
        include=kwargs.pop("include", ()),
        exclude=kwargs.pop("exclude", ()),
        other_files=kwargs.pop("other_files", "doc"),
        name=kwargs.pop("name", None),
        version=kwargs.pop("model_version", None),
        family=kwargs.pop("family", None),
        architecture=kwargs.pop("architecture", None),
        param_size=kwargs.pop("param_size", None),
        precision=kwargs.pop("precision", None),
        quantization=kwargs.pop("quantization", None),
        vendor=kwargs.pop("vendor", None),
        description=kwargs.pop("description", None),
        licenses=kwargs.pop("licenses", ()),
        created=kwargs.pop("created", None),
        max_file_size=kwargs.pop("max_file_size", None),
        progress=progress,
    )


@main.command("pack")
@click.argument("checkpoint_dir")
@click.argument("destination")
@pack_options
@format_options
@target_options
@jobs_option
@progress_option
@json_option
@handle_errors
def pack_cmd(
    checkpoint_dir: str,
    destination: str,
    jobs: int,
    progress: str,
    as_json: bool,
    artifact_format: str = "artifact",
    compression: str | None = None,
    **kwargs: Any,
) -> None:
    """Pack CHECKPOINT_DIR into a ModelPack artifact at DESTINATION.

    \b
    Layers: one .raw layer per file, byte-identical to the file (its digest is the file's sha256):
      *.safetensors                                    weight      (headers validated strictly)
      config.json, generation_config.json, tokenizer*,
      vocab/merges, *.index.json                       weight.config
      README*, LICENSE*, NOTICE*, *.md                 doc
      *.py                                             code
      *.bin, *.pt, *.gguf, *.onnx …                    weight      (marked untested)
      anything else                                    --other-files (default doc, marked untested)
    Hidden files (.git, .cache) are skipped; symlinks leaving the directory are refused.
    CHECKPOINT_DIR may be s3://BUCKET/PREFIX/: the objects are hashed and uploaded by streaming,
    nothing is written to local disk (--max-file-size is not supported there).

    The same directory always packs to the same manifest digest (fixed file metadata, sorted
    files, no timestamp unless --created).

    \b
    Example:
      modelpack pack ./llama-8b oci:./layout:v1 --version 1.0 --max-file-size 4GiB
    """
    if not checkpoint_dir.startswith("s3://") and not os.path.isdir(checkpoint_dir):
        raise click.BadParameter(f"{checkpoint_dir!r} is not a directory", param_hint="CHECKPOINT_DIR")
    popts = pack_options_from(kwargs, progress)
    link = kwargs.pop("link", "auto")
    topts = build_target_options(kwargs)
    topts.link = link
    result = api.pack(
        checkpoint_dir, destination, popts, topts, jobs=jobs, format=artifact_format, compression=compression
    )
    if as_json:
        emit_json(result.to_json())
    else:
        click.echo(
            f"packed {len(result.artifact.files)} files ({human_size(result.artifact.manifest.total_size)}) "
            f"→ {result.reference}"
        )
        click.echo(str(result.artifact.digest))


@main.command("inspect")
@click.argument("reference")
@target_options
@json_option
@handle_errors
def inspect_cmd(reference: str, as_json: bool, **kwargs: Any) -> None:
    """Show an artifact: manifest digest, model config, layers and total size.

    REFERENCE is host/repo:tag, oci:DIR:TAG or s3://BUCKET/PREFIX:TAG (or @sha256:… for any).
    """
    summary = api.inspect(reference, build_target_options(kwargs))
    if as_json:
        emit_json(summary.to_json())
        return
    cfg = summary.config or {}
    desc = cfg.get("descriptor", {})
    mc = cfg.get("config", {})
    click.echo(f"Reference:     {summary.reference}")
    click.echo(f"Digest:        {summary.digest}")
    click.echo(f"Artifact type: {summary.artifact_type or '-'}")
    if cfg:
        click.echo(f"Model:         {desc.get('name', '-')} {desc.get('version', '')}".rstrip())
        for key in ("family", "architecture", "format", "paramSize", "precision", "quantization"):
            value = desc.get(key) if key == "family" else mc.get(key)
            if value:
                click.echo(f"  {key + ':':<15}{value}")
    click.echo(f"Layers:        {len(summary.layers)}, total {human_size(summary.total_size)}")
    width = max((len(layer.path or "-") for layer in summary.layers), default=4)
    for layer in summary.layers:
        click.echo(
            f"  {layer.path or '-':<{width}}  {layer.kind or layer.media_type:<14} "
            f"{human_size(layer.size):>10}  {layer.digest[:19]}…"
        )


@main.command("ls")
@click.argument("reference")
@target_options
@json_option
@handle_errors
def ls_cmd(reference: str, as_json: bool, **kwargs: Any) -> None:
    """List the tags of a layout, repository or bucket, with their digests."""
    tags = api.list_tags(reference, build_target_options(kwargs))
    if as_json:
        emit_json(tags)
        return
    for t in tags:
        click.echo(f"{t['tag']:<30} {t['digest']}  {t['artifactType'] or t['mediaType']}")
