"""The Python API behind the CLI: every command is a function here (or in its own module)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from modelpack.errors import ListingCutError, PackError
from modelpack.mediatypes import ModelSpecConfig, SpecNames, is_model_config, parse_layer_media_type
from modelpack.mediatypes.annotations import layer_filepath
from modelpack.oci.descriptor import Manifest
from modelpack.oci.reference import Reference, parse_reference
from modelpack.packing.packer import PackedArtifact, PackOptions, build_artifact
from modelpack.targets.base import Closable
from modelpack.targets.fetch import fetch_config, fetch_manifest
from modelpack.targets.opener import TargetOptions, open_readable, open_target
from modelpack.transfer.copy import CopyResult, copy

#: ``--spec-names`` names ModelPack media types; the image-shaped variant is an OCI image
IMAGE_HAS_NO_SPEC_NAMES = (
    "--spec-names applies to the ModelPack artifact: --format image writes an OCI image, whose "
    "media types are the image spec's whatever the naming"
)


@dataclass
class PackResult:
    reference: str
    artifact: PackedArtifact
    copy: CopyResult

    def to_json(self) -> dict[str, Any]:
        return {
            "reference": self.reference,
            "digest": str(self.artifact.digest),
            "mediaType": self.artifact.manifest.media_type,
            "artifactType": self.artifact.manifest.artifact_type,
            "files": self.artifact.file_count,
            "skipped": list(self.artifact.skipped),
            "warnings": list(self.artifact.warnings),
            "totalSize": self.artifact.manifest.total_size,
            "config": self.artifact.config.to_dict(),
            "transfer": self.copy.to_json(),
        }


def pack(
    checkpoint_dir: str,
    destination: str | Reference,
    options: PackOptions | None = None,
    target_options: TargetOptions | None = None,
    *,
    jobs: int = 4,
    format: str = "artifact",
    compression: str | None = None,
    tag: bool = True,
    mount_from: Sequence[str] = (),
    modelfile: str | None = None,
) -> PackResult:
    """Pack ``checkpoint_dir`` and store it at ``destination`` (any target: layout, registry, S3).

    ``tag=False`` stores the manifest by digest only (a signed push tags after signing).

    ``format="image"`` builds the image-shaped variant (``modelpack.packing.image_format``, for containerd
    image volumes); ``compression="zstd"`` compresses its tar layers.

    ``checkpoint_dir`` may be ``s3://BUCKET/PREFIX/``: the checkpoint is then read from the bucket
    by streaming (``modelpack.packing.s3_checkpoint``), never landing on local disk.

    ``checkpoint_dir`` may be ``hf://ORG/NAME[@REVISION]``: a Hugging Face repository, fetched
    (or found) by huggingface_hub and packed from its cache's blobs (``modelpack.packing.hf_source``).
    ``modelfile`` (modctl's Modelfile) names the files of ``checkpoint_dir`` and their layer kinds
    (``modelpack.packing.modelfile``).
    """
    from_s3 = checkpoint_dir.startswith("s3://")
    from_hf = checkpoint_dir.startswith("hf://")
    if (from_hf or from_s3) and modelfile:
        raise PackError(f"{checkpoint_dir}: --modelfile applies to a local context directory")
    if (from_hf or modelfile) and (format != "artifact" or compression):
        raise PackError(f"{checkpoint_dir}: --format image is not supported with hf:// or --modelfile")
    if not from_s3 and not from_hf and not os.path.isdir(checkpoint_dir):
        raise PackError(f"{checkpoint_dir}: not a directory")
    if format == "image" and options is not None and options.spec_names != SpecNames.CNCF:
        raise PackError(IMAGE_HAS_NO_SPEC_NAMES)
    ref = parse_reference(destination) if isinstance(destination, str) else destination
    if ref.digest:
        raise PackError(f"{ref}: a pack destination takes a tag, not a digest (the digest is computed)")
    target = open_target(ref, target_options, for_write=True)
    staging_parent = ref.location if ref.scheme == "oci" else None
    options = options or PackOptions()
    if from_hf:
        from modelpack.packing.hf_source import build_hf_artifact

        artifact = build_hf_artifact(checkpoint_dir, options)
    elif modelfile:
        from modelpack.packing.modelfile import build_modelfile_artifact

        artifact = build_modelfile_artifact(checkpoint_dir, modelfile, options)
    elif from_s3:
        from modelpack.packing.s3_checkpoint import build_s3_artifact

        if format != "artifact" or compression:
            raise PackError(f"{checkpoint_dir}: --format image needs local files; not supported for s3://")
        artifact = build_s3_artifact(checkpoint_dir, options, target_options)
    elif format == "image":
        from modelpack.packing.image_format import build_image_artifact

        artifact = build_image_artifact(checkpoint_dir, options, compression, staging_parent=staging_parent)
    else:
        if format != "artifact" or compression:
            raise PackError(
                f"format {format!r} / compression {compression!r}: compression needs --format image"
            )
        artifact = build_artifact(checkpoint_dir, options, staging_parent=staging_parent)
    try:
        artifact.tag = ref.tag or "latest"
        result = copy(
            artifact,
            target,
            artifact.tag,
            (ref.tag or "latest") if tag else None,
            jobs=jobs,
            progress=options.progress,
            mount_from=mount_from,
        )
    finally:
        artifact.cleanup()
    return PackResult(str(ref.with_tag(ref.tag or "latest")), artifact, result)


@dataclass
class LayerSummary:
    path: str | None
    media_type: str
    kind: str | None
    size: int
    digest: str

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "mediaType": self.media_type,
            "kind": self.kind,
            "size": self.size,
            "digest": self.digest,
        }


@dataclass
class ArtifactSummary:
    reference: str
    digest: str
    media_type: str
    artifact_type: str | None
    config_media_type: str
    config: dict[str, Any] | None
    layers: list[LayerSummary]
    total_size: int
    manifest: Manifest

    def to_json(self) -> dict[str, Any]:
        return {
            "reference": self.reference,
            "digest": self.digest,
            "mediaType": self.media_type,
            "artifactType": self.artifact_type,
            "configMediaType": self.config_media_type,
            "config": self.config,
            "layers": [layer.to_json() for layer in self.layers],
            "totalSize": self.total_size,
        }


def inspect(reference: str | Reference, target_options: TargetOptions | None = None) -> ArtifactSummary:
    ref = parse_reference(reference) if isinstance(reference, str) else reference
    target = open_readable(ref, target_options)
    manifest, digest = fetch_manifest(target, ref.identifier)
    config: dict[str, Any] | None = None
    if is_model_config(manifest.config.media_type):
        config = ModelSpecConfig.from_bytes(fetch_config(target, manifest)).to_dict()
    layers = []
    for layer in manifest.layers:
        lt = parse_layer_media_type(layer.media_type)
        layers.append(
            LayerSummary(
                layer_filepath(layer.annotations),
                layer.media_type,
                lt.kind if lt else None,
                layer.size,
                str(layer.digest),
            )
        )
    return ArtifactSummary(
        reference=str(ref),
        digest=digest,
        media_type=manifest.media_type,
        artifact_type=manifest.artifact_type,
        config_media_type=manifest.config.media_type,
        config=config,
        layers=layers,
        total_size=manifest.total_size,
        manifest=manifest,
    )


#: tags ``list_tags`` lists before it stops (each costs a manifest request)
DEFAULT_MAX_TAGS = 10_000


def list_tags(
    reference: str | Reference,
    target_options: TargetOptions | None = None,
    *,
    max_tags: int = DEFAULT_MAX_TAGS,
) -> list[dict[str, Any]]:
    """Every tag with its digest and types. A listing longer than ``max_tags`` (or one the
    registry keeps paging, ``ListingCutError``) raises rather than returning a part that looks
    whole; the listing is consumed as it streams and left unread past the bound."""
    ref = parse_reference(reference) if isinstance(reference, str) else reference
    target = open_readable(ref, target_options)
    out = []
    listing = iter(target.list_tags())
    for n, tag in enumerate(listing):
        if n == max_tags:
            if isinstance(listing, Closable):
                listing.close()  # a generator: no further page is fetched
            raise ListingCutError(
                f"more than {max_tags} tags; stopped (--max-tags raises the bound)", target=str(ref), listed=n
            )
        desc = target.resolve(tag)
        out.append(
            {
                "tag": tag,
                "digest": str(desc.digest),
                "mediaType": desc.media_type,
                "artifactType": desc.artifact_type,
            }
        )
    return out
