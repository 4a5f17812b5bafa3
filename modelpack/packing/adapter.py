"""A PEFT LoRA adapter directory → a ModelPack artifact whose ``subject`` is its base model.

PEFT writes an adapter as ``adapter_config.json`` (``peft_type``, ``r``, ``lora_alpha``,
``target_modules``, ``base_model_name_or_path`` …) next to ``adapter_model.safetensors``
(tensors named ``base_model.model.<module>.lora_A.weight`` / ``lora_B.weight``). Packed, it is an
ordinary ModelPack artifact (same manifest, config and layer types as a model: the safetensors
file a ``weight`` layer, ``adapter_config.json`` a ``weight.config`` layer), so every client that
pulls models pulls it. What makes it an adapter is the manifest:

- ``subject`` = the base manifest's descriptor (media type, digest, size), which makes the
  adapter a referrer of its base (OCI 1.1): the registry lists it under the base, and a base
  can find its adapters without any index of names;
- project annotations (the released model-spec has no field for adapters and reserves
  ``org.cncf.model.*`` for its own keys): ``dev.modelpack.adapter`` = ``lora``,
  ``dev.modelpack.adapter.name`` = the adapter's name (the sub-path it is pulled to and the
  name vLLM serves it as), ``dev.modelpack.adapter.base`` = the base digest (the same as the
  subject's, so a copy that drops ``subject`` still says which base it is for).

The config is input from whoever made the adapter: it is parsed bounded (size, depth, duplicate
keys) and only type-checked; ``base_model_name_or_path`` is recorded as data and never opened.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

from modelpack.boundedjson import loads_object
from modelpack.errors import AdapterError, DocumentError
from modelpack.mediatypes import LayerKind
from modelpack.mediatypes.annotations import PROJECT_PREFIX
from modelpack.oci.descriptor import Descriptor, Manifest
from modelpack.packing.model_config import describe_model
from modelpack.packing.packed_artifact import PackedArtifact, PackedFile, PackOptions
from modelpack.packing.packer import build_artifact, checkpoint_headers

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
#: manifest annotations that mark an adapter (project keys, see the module docstring)
ANNOTATION_ADAPTER = PROJECT_PREFIX + "adapter"
ANNOTATION_ADAPTER_NAME = PROJECT_PREFIX + "adapter.name"
ANNOTATION_ADAPTER_BASE = PROJECT_PREFIX + "adapter.base"
ADAPTER_KIND_LORA = "lora"
#: PEFT configs are a few hundred bytes; anything near this is not one
MAX_ADAPTER_CONFIG_BYTES = 256 * 1024
MAX_ADAPTER_CONFIG_DEPTH = 8
#: a LoRA rank beyond this is not low-rank (and no engine's ``max_lora_rank`` goes past it)
MAX_LORA_RANK = 4096
#: an adapter name is a path component and a served model name: letters, digits, ``._-``,
#: starting with a letter or digit (so never ``.``, ``..`` or a hidden name), at most 64 bytes
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """What modelpack reads from ``adapter_config.json``; the file itself is packed unchanged."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    base_model_name_or_path: str | None

    def to_json(self) -> dict[str, Any]:
        return {
            "r": self.rank,
            "lora_alpha": self.alpha,
            "target_modules": list(self.target_modules),
            "base_model_name_or_path": self.base_model_name_or_path,
        }


def check_adapter_name(name: str, *, where: str = "adapter name") -> str:
    """``name`` if it is safe as a directory name and a served model name, else ``AdapterError``:
    an adapter's name comes from whoever pushed it and becomes a path under DEST."""
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        shown = repr(name)[:80]
        raise AdapterError(
            f"{where} {shown} is not a safe name: use 1-64 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return name


def parse_adapter_config(data: bytes, where: str) -> LoraConfig:
    """A PEFT LoRA ``adapter_config.json``, bounded and type-checked; anything else is refused."""
    if len(data) > MAX_ADAPTER_CONFIG_BYTES:
        raise AdapterError(
            f"{where}: larger than {MAX_ADAPTER_CONFIG_BYTES} bytes; not a PEFT adapter config"
        )
    try:
        doc = loads_object(
            data, what=where, max_bytes=MAX_ADAPTER_CONFIG_BYTES, max_depth=MAX_ADAPTER_CONFIG_DEPTH
        )
    except DocumentError as exc:
        raise AdapterError(str(exc)) from None
    peft_type = doc.get("peft_type")
    if peft_type != "LORA":
        raise AdapterError(
            f'{where}: peft_type is {str(peft_type)[:40]!r}; only LoRA adapters ("LORA") are packed'
        )
    rank = doc.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= MAX_LORA_RANK:
        raise AdapterError(f"{where}: r must be an integer in [1, {MAX_LORA_RANK}], got {str(rank)[:40]!r}")
    alpha = doc.get("lora_alpha", rank)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha < 1e6:
        raise AdapterError(f"{where}: lora_alpha must be a positive number, got {str(alpha)[:40]!r}")
    modules = doc.get("target_modules")
    if isinstance(modules, str):
        modules = [modules]
    if not isinstance(modules, list) or not modules or not all(isinstance(m, str) and m for m in modules):
        raise AdapterError(f"{where}: target_modules must be a module name or a list of them")
    if len(modules) > 1024:
        raise AdapterError(f"{where}: {len(modules)} target_modules; the limit is 1024")
    base = doc.get("base_model_name_or_path")
    if base is not None and not isinstance(base, str):
        raise AdapterError(f"{where}: base_model_name_or_path must be a string")
    return LoraConfig(rank, float(alpha), tuple(modules), base)


def read_adapter_config(path: str) -> LoraConfig:
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_ADAPTER_CONFIG_BYTES + 1)
    except OSError as exc:
        raise AdapterError(f"{path}: cannot read: {exc.strerror or exc}") from None
    return parse_adapter_config(data, path)


def check_adapter_dir(adapter_dir: str) -> LoraConfig:
    """The directory must be a PEFT LoRA adapter as PEFT writes it: both files, a LoRA config."""
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        path = os.path.join(adapter_dir, name)
        if not os.path.isfile(path) or os.path.islink(path):
            raise AdapterError(
                f"{adapter_dir}: no {name} (a PEFT LoRA adapter directory holds {ADAPTER_CONFIG} "
                f"and {ADAPTER_WEIGHTS}, as PeftModel.save_pretrained writes them)"
            )
    return read_adapter_config(os.path.join(adapter_dir, ADAPTER_CONFIG))


def default_adapter_name(adapter_dir: str) -> str:
    base = re.sub(r"[^A-Za-z0-9._-]+", "-", os.path.basename(os.path.realpath(adapter_dir))).lstrip("._-")
    return base[:64] or "adapter"


def adapter_annotations(name: str, base: Descriptor) -> dict[str, str]:
    return {
        ANNOTATION_ADAPTER: ADAPTER_KIND_LORA,
        ANNOTATION_ADAPTER_NAME: name,
        ANNOTATION_ADAPTER_BASE: str(base.digest),
    }


def build_adapter_artifact(
    adapter_dir: str,
    base: Descriptor,
    opts: PackOptions | None = None,
    *,
    name: str | None = None,
    staging_parent: str | None = None,
) -> PackedArtifact:
    """Pack ``adapter_dir`` as an adapter of ``base`` (a verified manifest descriptor).

    The name is ``name``, else ``opts.name``, else the directory's name made safe; it is the
    config's ``descriptor.name`` and the ``dev.modelpack.adapter.name`` annotation.
    """
    opts = opts or PackOptions()
    check_adapter_dir(adapter_dir)
    name = check_adapter_name(name or opts.name or default_adapter_name(adapter_dir))
    opts = dataclasses.replace(opts, name=name, max_file_size=None)  # never re-shard an adapter
    artifact = build_artifact(adapter_dir, opts, staging_parent=staging_parent)
    # adapter_config.json configures the weights: weight.config, not a guessed "doc"
    files: list[PackedFile] = [
        dataclasses.replace(f, kind=LayerKind.WEIGHT_CONFIG, untested=False)
        if f.relpath == ADAPTER_CONFIG
        else f
        for f in artifact.files
    ]
    spec, config_bytes, plain = describe_model(files, checkpoint_headers(artifact), None, opts, name)
    manifest = Manifest.build(
        plain.config,
        list(plain.layers),
        artifact_type=plain.artifact_type,
        subject=Descriptor(base.media_type, base.digest, base.size),
        annotations={**(plain.annotations or {}), **adapter_annotations(name, base)},
    )
    return PackedArtifact(manifest, spec, config_bytes, files, name=f"adapter:{adapter_dir}")


def adapter_name_of(manifest: Manifest) -> str | None:
    """The adapter name a manifest declares, or None when it is not an adapter (no marker)."""
    notes = manifest.annotations or {}
    if notes.get(ANNOTATION_ADAPTER) is None:
        return None
    return notes.get(ANNOTATION_ADAPTER_NAME, "")


__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "ANNOTATION_ADAPTER",
    "ANNOTATION_ADAPTER_BASE",
    "ANNOTATION_ADAPTER_NAME",
    "LoraConfig",
    "adapter_name_of",
    "build_adapter_artifact",
    "check_adapter_dir",
    "check_adapter_name",
    "parse_adapter_config",
]
