"""The model config and manifest of a pack, inferred from config.json and safetensors headers.

One description for every source (a local directory, an S3 prefix): the same files give the same
config and manifest bytes, so the artifact digest does not depend on where the checkpoint lived.
Every inferred field can be overridden through ``PackOptions``.
"""

from __future__ import annotations

from typing import Any

from modelpack.boundedjson import loads
from modelpack.errors import ConfigError, DocumentError, PackError
from modelpack.mediatypes import (
    ANNOTATION_CREATED,
    ANNOTATION_FILE_MEDIATYPE_UNTESTED,
    ANNOTATION_FILE_METADATA,
    ANNOTATION_FILEPATH,
    ANNOTATION_TITLE,
    ARTIFACT_TYPE_MODEL,
    MEDIA_TYPE_CONFIG,
    FileMetadata,
    ModelConfig,
    ModelDescriptor,
    ModelFS,
    ModelSpecConfig,
    layer_media_type,
)
from modelpack.oci.descriptor import Descriptor, Manifest
from modelpack.oci.digest import Digest
from modelpack.packing.packed_artifact import PackedFile, PackOptions
from modelpack.packing.safetensors_format import SafetensorsHeader

#: A Hugging Face config.json: a few KiB in practice, nested a few levels (quantization_config,
#: rope_scaling, text_config of multimodal models).
MAX_CONFIG_JSON = 16 * 1024 * 1024
MAX_CONFIG_JSON_DEPTH = 32

# config fields a pack flag sets: a schema refusal names the flag the person typed
_FLAGS = {
    "$.descriptor.name": "--name",
    "$.descriptor.version": "--version",
    "$.descriptor.family": "--family",
    "$.descriptor.vendor": "--vendor",
    "$.descriptor.description": "--description",
    "$.descriptor.licenses": "--license",
    "$.descriptor.createdAt": "--created",
    "$.config.architecture": "--architecture",
    "$.config.paramSize": "--param-size",
    "$.config.precision": "--precision",
    "$.config.quantization": "--quantization",
}

# safetensors dtype -> precision name used in the config (torch's spelling)
PRECISION_NAMES = {
    "BF16": "bfloat16",
    "F16": "float16",
    "F32": "float32",
    "F64": "float64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E8M0": "float8_e8m0fnu",
    "I8": "int8",
    "U8": "uint8",
    "F4": "float4_e2m1",
}


def format_param_size(n: int) -> str:
    for div, unit in ((10**12, "T"), (10**9, "B"), (10**6, "M"), (10**3, "K")):
        if n >= div:
            value = n / div
            text = f"{value:.1f}".rstrip("0").rstrip(".")
            return f"{text}{unit}"
    return str(n)


def read_json(path: str, limit: int = MAX_CONFIG_JSON) -> Any:
    """A checkpoint's JSON file (config.json), bounded: it is input from whoever made the checkpoint."""
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as exc:
        raise PackError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    return parse_checkpoint_json(data, path, limit)


def parse_checkpoint_json(data: bytes, where: str, limit: int = MAX_CONFIG_JSON) -> Any:
    """config.json's bytes, wherever they were read (a directory, a bucket), bounded and typed."""
    if len(data) > limit:
        raise PackError(f"{where}: larger than {limit} bytes; refusing to parse")
    try:
        return loads(data, what=where, max_bytes=limit, max_depth=MAX_CONFIG_JSON_DEPTH)
    except DocumentError as exc:
        raise PackError(str(exc)) from None


def infer_config(
    files: list[PackedFile],
    headers: dict[str, SafetensorsHeader],
    hf_config: dict[str, Any] | None,
    opts: PackOptions,
    default_name: str,
) -> ModelSpecConfig:
    arch = fam = precision = quant = None
    transformer: dict[str, Any] = {}
    if hf_config:
        archs = hf_config.get("architectures")
        if isinstance(archs, list) and archs and isinstance(archs[0], str):
            arch = archs[0]
        if isinstance(hf_config.get("model_type"), str):
            fam = hf_config["model_type"]
        dtype = hf_config.get("torch_dtype") or hf_config.get("dtype")
        if isinstance(dtype, str):
            precision = dtype
        qc = hf_config.get("quantization_config")
        if isinstance(qc, dict):
            method = qc.get("quant_method") or qc.get("quantization_method")
            quant = str(method) if method else "unknown"
            if qc.get("bits"):
                quant += f"-{qc['bits']}bit"
        for src, dst in (
            ("num_hidden_layers", "numLayers"),
            ("num_attention_heads", "numAttentionHeads"),
            ("num_key_value_heads", "numKVHeads"),
            ("hidden_size", "hiddenSize"),
            ("intermediate_size", "intermediateSize"),
        ):
            v = hf_config.get(src)
            if isinstance(v, int) and not isinstance(v, bool) and v >= 1:
                transformer[dst] = v
        if "numAttentionHeads" in transformer:
            kv = transformer.get("numKVHeads", transformer["numAttentionHeads"])
            if hf_config.get("kv_lora_rank"):
                transformer["attentionType"] = "mla"
            else:
                transformer["attentionType"] = "gqa" if kv < transformer["numAttentionHeads"] else "mha"
        if transformer:
            moe = any(hf_config.get(k) for k in ("num_local_experts", "num_experts", "n_routed_experts"))
            transformer["mlpType"] = "moe" if moe else "dense"
    params = sum(h.param_count for h in headers.values())
    if precision is None and headers:
        by_dtype: dict[str, int] = {}
        for h in headers.values():
            for t in h.tensors:
                by_dtype[t.dtype] = by_dtype.get(t.dtype, 0) + t.nbytes
        top = max(by_dtype.items(), key=lambda kv: (kv[1], kv[0]))[0] if by_dtype else None
        precision = PRECISION_NAMES.get(top, top.lower()) if top else None
    weight_formats = {
        ("safetensors" if f.relpath.endswith(".safetensors") else "other")
        for f in files
        if f.kind == "weight"
    }
    fmt = "safetensors" if weight_formats == {"safetensors"} else None
    descriptor = ModelDescriptor(
        name=opts.name or default_name,
        version=opts.version,
        family=opts.family or fam,
        vendor=opts.vendor,
        description=opts.description,
        licenses=list(opts.licenses) or None,
        createdAt=opts.created,
    )
    config = ModelConfig(
        architecture=opts.architecture or arch,
        format=fmt,
        paramSize=opts.param_size or (format_param_size(params) if params else None),
        precision=opts.precision or precision,
        quantization=opts.quantization or quant,
        transformerConfig=transformer or None,
    )
    return ModelSpecConfig(descriptor, config, ModelFS(diffIds=[str(f.digest) for f in files]))


def describe_model(
    packed: list[PackedFile],
    headers: dict[str, SafetensorsHeader],
    hf_config: dict[str, Any] | None,
    opts: PackOptions,
    default_name: str,
) -> tuple[ModelSpecConfig, bytes, Manifest]:
    """Config and manifest for hashed files, wherever they live (local directory or S3)."""
    spec = infer_config(packed, headers, hf_config, opts, default_name)
    try:
        config_bytes = spec.to_bytes()
    except ConfigError as exc:
        flag = _FLAGS.get(exc.path)
        raise PackError(f"{flag}: {exc}" if flag else str(exc)) from None
    config_desc = Descriptor(MEDIA_TYPE_CONFIG, Digest.from_bytes(config_bytes), len(config_bytes))
    layers = []
    for f in packed:
        annotations = {
            ANNOTATION_FILEPATH: f.relpath,
            ANNOTATION_TITLE: f.relpath,
            ANNOTATION_FILE_METADATA: FileMetadata(name=f.relpath, size=f.size).to_json(),
        }
        if f.untested:
            annotations[ANNOTATION_FILE_MEDIATYPE_UNTESTED] = "true"
        layers.append(Descriptor(layer_media_type(f.kind, "raw"), f.digest, f.size, annotations=annotations))
    manifest_annotations = {ANNOTATION_CREATED: opts.created} if opts.created else None
    manifest = Manifest.build(
        config_desc, layers, artifact_type=ARTIFACT_TYPE_MODEL, annotations=manifest_annotations
    )
    return spec, config_bytes, manifest


__all__ = [
    "MAX_CONFIG_JSON",
    "PRECISION_NAMES",
    "describe_model",
    "format_param_size",
    "infer_config",
    "parse_checkpoint_json",
    "read_json",
]
