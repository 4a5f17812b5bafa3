"""The model config and manifest of a pack, inferred from config.json and safetensors headers.

One description for every source (a local directory, an S3 prefix): the same files give the same
config and manifest bytes, so the artifact digest does not depend on where the checkpoint lived.
Every inferred field can be overridden through ``PackOptions``.
"""

from __future__ import annotations

import json
import posixpath
from typing import Any

from modelpack.boundedjson import loads
from modelpack.errors import ConfigError, DocumentError, PackError
from modelpack.mediatypes import (
    ANNOTATION_CREATED,
    ANNOTATION_FILE_MEDIATYPE_UNTESTED,
    ANNOTATION_FILE_METADATA,
    ANNOTATION_FILEPATH,
    ANNOTATION_TITLE,
    BlobFormat,
    FileMetadata,
    LayerKind,
    ModelConfig,
    ModelDescriptor,
    ModelFS,
    ModelSpecConfig,
    SpecNames,
    layer_media_type,
)
from modelpack.mediatypes.annotations import ANNOTATION_HF_ARCHITECTURE, ANNOTATION_TRANSFORMER
from modelpack.oci.descriptor import Descriptor, Manifest
from modelpack.oci.digest import Digest
from modelpack.packing.file_metadata import source_date_epoch
from modelpack.packing.packed_artifact import PackedFile, PackOptions
from modelpack.packing.safetensors_format import SafetensorsHeader
from modelpack.packing.sharded_state import describe_sharded_state
from modelpack.timestamps import rfc3339_utc

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
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
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


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def transformer_shape(hf_config: dict[str, Any] | None) -> dict[str, Any]:
    """Layers, heads, sizes, attention type (GQA when fewer KV heads, MLA with ``kv_lora_rank``)
    and MLP type (MoE when an expert count is set) from a Hugging Face ``config.json``; empty when
    it does not describe a transformer. Recorded as an annotation, never in the spec's config."""
    if not hf_config:
        return {}
    shape: dict[str, Any] = {}
    for src, dst in (
        ("num_hidden_layers", "numLayers"),
        ("num_attention_heads", "numAttentionHeads"),
        ("num_key_value_heads", "numKVHeads"),
        ("hidden_size", "hiddenSize"),
        ("intermediate_size", "intermediateSize"),
    ):
        if _positive_int(hf_config.get(src)):
            shape[dst] = hf_config[src]
    if "numAttentionHeads" in shape:
        kv = shape.get("numKVHeads", shape["numAttentionHeads"])
        if hf_config.get("kv_lora_rank"):
            shape["attentionType"] = "mla"
        else:
            shape["attentionType"] = "gqa" if kv < shape["numAttentionHeads"] else "mha"
    if shape:
        moe = any(hf_config.get(k) for k in ("num_local_experts", "num_experts", "n_routed_experts"))
        shape["mlpType"] = "moe" if moe else "dense"
    return shape


_ATTENTION_HEAD_KEYS = ("num_attention_heads", "n_head", "num_heads", "n_heads")


def architecture_kind(hf_config: dict[str, Any] | None) -> str | None:
    """The spec's ``config.architecture`` ("transformer", "cnn", "rnn", …): "transformer" when
    ``config.json`` declares attention heads (also in a multimodal model's ``text_config``);
    None when it cannot be told, rather than a guess."""
    if not hf_config:
        return None
    for doc in (hf_config, hf_config.get("text_config")):
        if isinstance(doc, dict) and any(_positive_int(doc.get(k)) for k in _ATTENTION_HEAD_KEYS):
            return "transformer"
    return None


def hf_class_name(hf_config: dict[str, Any] | None) -> str | None:
    """``architectures[0]`` of ``config.json`` (``LlamaForCausalLM``): what transformers and vLLM
    instantiate; recorded in the ``dev.modelpack.hf.architecture`` annotation."""
    archs = hf_config.get("architectures") if hf_config else None
    if isinstance(archs, list) and archs and isinstance(archs[0], str) and archs[0]:
        return archs[0]
    return None


def model_annotations(hf_config: dict[str, Any] | None) -> dict[str, str]:
    """Manifest annotations under the project's prefix for what the released spec has no field for."""
    out: dict[str, str] = {}
    cls = hf_class_name(hf_config)
    if cls:
        out[ANNOTATION_HF_ARCHITECTURE] = cls
    shape = transformer_shape(hf_config)
    if shape:
        out[ANNOTATION_TRANSFORMER] = json.dumps(shape, sort_keys=True, separators=(",", ":"))
    return out


def infer_config(
    files: list[PackedFile],
    headers: dict[str, SafetensorsHeader],
    hf_config: dict[str, Any] | None,
    opts: PackOptions,
    default_name: str,
) -> ModelSpecConfig:
    fam = precision = quant = None
    if hf_config:
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
        if f.kind is LayerKind.WEIGHT
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
        revision=opts.revision,
        sourceURL=opts.source_url,
    )
    config = ModelConfig(
        architecture=opts.architecture or architecture_kind(hf_config),
        format=opts.model_format or fmt,
        paramSize=opts.param_size or (format_param_size(params) if params else None),
        precision=opts.precision or precision,
        quantization=opts.quantization or quant,
    )
    return ModelSpecConfig(descriptor, config, ModelFS(diffIds=[str(f.digest) for f in files]))


def layer_annotations(f: PackedFile, mtime: str) -> dict[str, str]:
    """A raw layer's annotations: the path (ModelPack's key and OCI's title, which oras and other
    OCI tools name the file by) and the spec's file metadata."""
    annotations = {
        ANNOTATION_FILEPATH: f.relpath,
        ANNOTATION_TITLE: f.relpath,
        ANNOTATION_FILE_METADATA: FileMetadata(
            name=posixpath.basename(f.relpath), mode=f.mode, size=f.size, mtime=mtime
        ).to_json(),
    }
    if f.untested:
        annotations[ANNOTATION_FILE_MEDIATYPE_UNTESTED] = "true"
    return annotations


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
    names = SpecNames(opts.spec_names)
    config_desc = Descriptor(names.config_media_type, Digest.from_bytes(config_bytes), len(config_bytes))
    mtime = rfc3339_utc(opts.mtime if opts.mtime is not None else source_date_epoch())
    # vLLM's per-rank files: the manifest names the layout, each rank file's layer its rank
    sharded = describe_sharded_state([f.relpath for f in packed], headers, where=default_name)
    layers = [
        Descriptor(
            layer_media_type(f.kind, BlobFormat.RAW, names),
            f.digest,
            f.size,
            annotations={
                **layer_annotations(f, mtime),
                **(sharded.layer_annotations(f.relpath) if sharded else {}),
            },
        )
        for f in packed
    ]
    manifest_annotations = model_annotations(hf_config)
    if sharded is not None:
        manifest_annotations.update(sharded.manifest_annotations())
    if opts.created:
        manifest_annotations[ANNOTATION_CREATED] = opts.created
    manifest = Manifest.build(
        config_desc, layers, artifact_type=names.artifact_type, annotations=manifest_annotations or None
    )
    return spec, config_bytes, manifest


__all__ = [
    "MAX_CONFIG_JSON",
    "PRECISION_NAMES",
    "architecture_kind",
    "describe_model",
    "format_param_size",
    "hf_class_name",
    "infer_config",
    "layer_annotations",
    "model_annotations",
    "parse_checkpoint_json",
    "read_json",
    "transformer_shape",
]
