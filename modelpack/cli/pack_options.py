"""The flags that describe a pack (files, model metadata, format), shared by ``pack`` and ``push``.

One definition keeps both commands building the same artifact from the same command line.
"""

from __future__ import annotations

from typing import Any

import click

from modelpack.cli.options import SIZE
from modelpack.mediatypes import LayerKind, SpecNames
from modelpack.packing.image_format import WRITTEN_FORMATS
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
            default=str(LayerKind.DOC),
            show_default=True,
            help="Layer kind for files that are not weights, configs/tokenizers, docs or code; "
            "marked org.cncf.model.file.mediatype.untested. 'refuse' fails instead.",
        ),
        click.option("--name", help="Model name (default: the directory name)."),
        click.option("--version", "model_version", help="Model version."),
        click.option("--family", help="Model family (default: config.json model_type)."),
        click.option(
            "--architecture",
            help="The spec's architecture kind: transformer, cnn, rnn, … (default: transformer when "
            "config.json declares attention heads). The Hugging Face class (architectures[0]) is "
            "recorded in the dev.modelpack.hf.architecture annotation.",
        ),
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
        spec_names_option(
            "Which ModelPack media type names to write: cncf (the spec, Docker Hub, KServe) or cnai "
            "(released Harbor, modctl). The same files give one digest per choice. [default: cncf]"
        ),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


def spec_names_option(help: str) -> Any:
    """``--spec-names cncf|cnai``: the naming of the ModelPack media types written (default: none
    given, which pack and push take as ``cncf`` and ``cp`` as "copy the manifest as it is")."""
    return click.option(
        "--spec-names",
        "spec_names",
        type=click.Choice([str(n) for n in SpecNames]),
        default=None,
        help=help,
    )


def check_spec_names_format(spec_names: str | None, artifact_format: str | None) -> None:
    """``--spec-names cnai --format image`` is a usage error: an image has no ModelPack names."""
    from modelpack.api.artifacts import IMAGE_HAS_NO_SPEC_NAMES

    if spec_names not in (None, SpecNames.CNCF) and artifact_format == "image":
        raise click.UsageError(IMAGE_HAS_NO_SPEC_NAMES)


def modelfile_option(fn: Any) -> Any:
    """``--modelfile FILE``: modctl's Modelfile names the files to pack and their layer kinds."""
    return click.option(
        "--modelfile",
        "modelfile",
        type=click.Path(dir_okay=False),
        default=None,
        metavar="FILE",
        help="modctl's Modelfile: its CONFIG/MODEL/CODE/DOC/DATASET globs (relative to the "
        "checkpoint directory) choose the files and their layer kinds; NAME, ARCH, FAMILY, FORMAT, "
        "PARAMSIZE, PRECISION, QUANTIZATION fill the config (flags given here win).",
    )(fn)


def format_options(fn: Any) -> Any:
    """``--format artifact|image`` and ``--compression zstd`` (image-shaped variant, docs/node.md#the-image-shaped-variant)."""
    fn = click.option(
        "--compression",
        type=click.Choice([str(f.compression) for f in WRITTEN_FORMATS if f.compression]),
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
        other_files=kwargs.pop("other_files", LayerKind.DOC),
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
        spec_names=kwargs.pop("spec_names", None) or SpecNames.CNCF,
        progress=progress,
    )
