"""``pack``, ``inspect``, ``ls``: build an artifact from a checkpoint and look at stored ones.

The flags that describe a pack are shared with ``push`` and live in ``modelpack.cli.pack_options``.
"""

from __future__ import annotations

import os
import stat
from typing import Any

import click

from modelpack import api
from modelpack.cli.options import (
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
)
from modelpack.errors import ManifestError
from modelpack.oci.descriptor import Manifest
from modelpack.packing.packed_artifact import PackedArtifact
from modelpack.targets.options import TargetOptions
from modelpack.terminal import for_terminal


def report_skipped_and_warnings(artifact: PackedArtifact) -> None:
    """On stderr: the hidden entries a pack left out, and its warnings (``--json`` carries both)."""
    if artifact.skipped:
        shown = ", ".join(for_terminal(s) for s in artifact.skipped[:10])
        more = f" (+{len(artifact.skipped) - 10} more)" if len(artifact.skipped) > 10 else ""
        click.echo(f"skipped {len(artifact.skipped)} hidden entries (never packed): {shown}{more}", err=True)
    for warning in artifact.warnings:
        click.echo(f"warning: {for_terminal(warning)}", err=True)


def check_checkpoint_dir(path: str) -> None:
    """Say why CHECKPOINT_DIR cannot be packed: missing, not a directory, or not readable."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise click.BadParameter(f"{path!r} does not exist", param_hint="CHECKPOINT_DIR") from None
    except OSError as exc:
        raise click.BadParameter(f"{path!r}: {exc.strerror}", param_hint="CHECKPOINT_DIR") from None
    if not stat.S_ISDIR(st.st_mode):
        raise click.BadParameter(f"{path!r} is not a directory", param_hint="CHECKPOINT_DIR")
    if not os.access(path, os.R_OK | os.X_OK):
        raise click.BadParameter(f"{path!r}: Permission denied", param_hint="CHECKPOINT_DIR")


def check_reference(text: str, param_hint: str, *, tag: bool = True) -> None:
    """A local path where a reference belongs: say how to write a layout instead of parsing it as
    a registry (``./layout`` is "invalid registry host '.'"; ``layout`` would be Docker Hub)."""
    if text.startswith(("oci:", "s3://")):
        return
    looks_local = text.startswith(("/", "./", "../", "~")) or text in (".", "..")
    name = text.split("@", 1)[0]
    if looks_local or (os.sep not in name and ":" not in name and os.path.isdir(name)):
        layout = f"oci:{text}:TAG (e.g. oci:{text}:v1)" if tag else f"oci:{text}"
        raise click.BadParameter(
            f"{text!r} is a local path; for an OCI layout directory write {layout}, "
            "for a registry host/repo" + (":tag" if tag else ""),
            param_hint=param_hint,
        )


@click.command("pack")
@click.argument("checkpoint_dir")
@click.argument("destination")
@click.option(
    "--link",
    type=click.Choice(["auto", "reflink", "copy"]),
    default="auto",
    show_default=True,
    help="How an oci: destination on the checkpoint's filesystem gets each file: auto reflinks, "
    "else hard-links (the blob then shares the checkpoint file's inode: never edit it in place), "
    "else copies; reflink never hard-links (copies where it cannot clone); copy always copies.",
)
@pack_options
@modelfile_option
@format_options
@click.option(
    "--base",
    metavar="REF",
    default=None,
    help="CHECKPOINT_DIR is a PEFT LoRA adapter: pack it as an adapter of the base REF in DESTINATION "
    "(@sha256:… or a tag, resolved once and pinned; see push --base).",
)
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
    CHECKPOINT_DIR may be hf://ORG/NAME[@REVISION]: huggingface_hub fetches the revision into its
    cache (HF_TOKEN, HF_ENDPOINT, HF_HUB_OFFLINE, HF_HOME as usual) and the files are packed from
    the cache's blobs without a second copy; the commit goes into descriptor.revision.
    --modelfile FILE (modctl's Modelfile) chooses the files of CHECKPOINT_DIR and their kinds.
    A directory vLLM's save_sharded_state wrote (model-rank-R-part-P.safetensors) is recognised by
    its file names and packed as the sharded_state variant: the manifest says layout=sharded_state
    and tp-size=N, each rank file's layer its rank; a missing rank or an ambiguous name is refused.

    The same directory always packs to the same manifest digest (fixed file metadata, sorted
    files, no timestamp unless --created), one digest per --spec-names: cnai writes the
    application/vnd.cnai.model.* media types released Harbor recognises (the annotations and
    blobs are the same).

    \b
    Examples:
      modelpack pack ./llama-8b oci:./layout:v1 --version 1.0 --max-file-size 4GiB
      modelpack pack ./llama-8b oci:./layout:v1-image --format image --compression zstd
      modelpack pack s3://bucket/checkpoints/llama-8b/ registry.example/models/llama:v1
      modelpack pack hf://Qwen/Qwen3-0.6B@main oci:./layout:qwen3
      modelpack pack ./gemma-2b oci:./layout:gemma --modelfile ./gemma-2b/Modelfile
      modelpack pack ./llama-8b-sharded-tp2 oci:./layout:tp2   # vLLM sharded_state files
      modelpack pack ./llama-8b oci:./layout:v1-harbor --spec-names cnai
    """
    if not checkpoint_dir.startswith(("s3://", "hf://")):
        check_checkpoint_dir(checkpoint_dir)
    check_reference(destination, "DESTINATION")
    check_spec_names_format(kwargs.get("spec_names"), artifact_format)
    if kwargs.get("base") is not None:
        if kwargs.pop("modelfile", None):
            raise click.UsageError("--base packs a PEFT adapter directory: drop --modelfile")
        kwargs.pop("link", None)
        from modelpack.cli.adapters import push_adapter_cmd

        kwargs.update(artifact_format=artifact_format, compression=compression)
        push_adapter_cmd(checkpoint_dir, destination, None, jobs, progress, as_json, kwargs)
        return
    kwargs.pop("base", None)
    popts = pack_options_from(kwargs, progress)
    link = kwargs.pop("link", "auto")
    modelfile = kwargs.pop("modelfile", None)
    topts = build_target_options(kwargs)
    topts.link = link
    result = api.pack(
        checkpoint_dir,
        destination,
        popts,
        topts,
        jobs=jobs,
        format=artifact_format,
        compression=compression,
        modelfile=modelfile,
    )
    report_skipped_and_warnings(result.artifact)
    if as_json:
        emit_json(result.to_json())
    else:
        click.echo(
            f"packed {result.artifact.file_count} files ({human_size(result.artifact.manifest.total_size)}) "
            f"→ {result.reference}"
        )
        click.echo(str(result.artifact.digest))


@click.command("inspect")
@click.argument("reference")
@target_options
@json_option
@handle_errors
def inspect_cmd(reference: str, as_json: bool, **kwargs: Any) -> None:
    """Show an artifact: manifest digest, model config, layers and total size.

    REFERENCE is host/repo:tag, oci:DIR:TAG or s3://BUCKET/PREFIX:TAG (or @sha256:… for any).

    \b
    Examples:
      modelpack inspect oci:./layout:v1
      modelpack inspect registry.example/models/llama:v1 --json
    """
    check_reference(reference, "REFERENCE")
    topts = build_target_options(kwargs)
    try:
        summary = api.inspect(reference, topts)
    except ManifestError:
        if not _inspect_variants(reference, topts, as_json):  # an index of variants: listed
            raise
        return
    from modelpack.cli.adapters import adapters_section, print_adapters

    adapters = adapters_section(summary.manifest, reference, topts)
    variant = _manifest_variant(summary.manifest)
    if as_json:
        emit_json({**summary.to_json(), **({"variant": variant} if variant else {}), **adapters})
        return
    # every value below came from the artifact: each shown as one inert line (for_terminal)
    cfg = summary.config or {}
    desc = cfg.get("descriptor", {})
    mc = cfg.get("config", {})
    click.echo(f"Reference:     {for_terminal(summary.reference)}")
    click.echo(f"Digest:        {summary.digest}")
    click.echo(f"Artifact type: {for_terminal(summary.artifact_type or '-')}")
    if cfg:
        name = f"{desc.get('name', '-')} {desc.get('version', '')}".rstrip()
        click.echo(f"Model:         {for_terminal(name)}")
        for key in ("family", "architecture", "format", "paramSize", "precision", "quantization"):
            value = desc.get(key) if key == "family" else mc.get(key)
            if value:
                click.echo(f"  {key + ':':<15}{for_terminal(value)}")
    if variant:  # what the manifest says it is (the sharded_state packer writes layout and tp-size)
        click.echo(f"Variant:       {for_terminal(', '.join(f'{k}={v}' for k, v in variant.items()))}")
    click.echo(f"Layers:        {len(summary.layers)}, total {human_size(summary.total_size)}")
    paths = [for_terminal(layer.path or "-") for layer in summary.layers]
    width = max((len(p) for p in paths), default=4)
    for layer, path in zip(summary.layers, paths, strict=True):
        click.echo(
            f"  {path:<{width}}  {for_terminal(layer.kind or layer.media_type):<14} "
            f"{human_size(layer.size):>10}  {layer.digest[:19]}…"
        )
    print_adapters(adapters)


def _manifest_variant(manifest: Manifest) -> dict[str, str]:
    """The variant fields on a manifest's own annotations (``dev.modelpack.variant.*``), checked;
    a malformed value is left out here (loading refuses it, naming it)."""
    from modelpack.errors import ModelpackError
    from modelpack.mediatypes.variants import variant_fields

    try:
        return variant_fields(manifest.annotations, where="manifest")
    except ModelpackError:
        return {}


def _inspect_variants(reference: str, topts: TargetOptions, as_json: bool) -> bool:
    """An index of variants: its entries and what selects each (False: not an index)."""
    from modelpack.api.variants import inspect_index
    from modelpack.cli.index import print_variants

    vi = inspect_index(reference, topts)
    if vi is None:
        return False
    doc = {"reference": reference, "mediaType": vi.index.media_type, **vi.to_json()}
    if as_json:
        emit_json(doc)
        return True
    click.echo(f"Reference:     {for_terminal(reference)}")
    click.echo(f"Digest:        {vi.digest} (index of variants)")
    click.echo(f"Variants:      {len(vi.entries)}")
    print_variants(doc)
    return True


@click.command("ls")
@click.argument("reference")
@click.option(
    "--max-tags",
    type=click.IntRange(1),
    default=10_000,
    show_default=True,
    help="List at most this many tags; a longer listing is an error, never a silent part.",
)
@target_options
@json_option
@handle_errors
def ls_cmd(reference: str, max_tags: int, as_json: bool, **kwargs: Any) -> None:
    """List the tags of a layout, repository or bucket, with their digests.

    \b
    Examples:
      modelpack ls oci:./layout
      modelpack ls registry.example/models/llama --json
      modelpack ls s3://bucket/models/llama --s3-endpoint http://127.0.0.1:9000
    """
    check_reference(reference, "REFERENCE", tag=False)
    tags = api.list_tags(reference, build_target_options(kwargs), max_tags=max_tags)
    if as_json:
        emit_json(tags)
        return
    for t in tags:
        kind = for_terminal(t["artifactType"] or t["mediaType"])
        click.echo(f"{for_terminal(t['tag']):<30} {for_terminal(t['digest'])}  {kind}")
