"""Variant annotations: the keys on an OCI image index's entries that say which node each entry fits.

A ModelPack *index* (``application/vnd.oci.image.index.v1+json``) lists several ModelPack manifests
of one model — bf16 and f32, a TP-sharded layout, a quantized build — and each entry's descriptor
carries the annotations below. A node resolves the index to exactly one entry by comparing these
values with what it is (its device arch, its tensor-parallel size, its engine) or with what the
caller asks for (``--variant KEY=VALUE``). The same keys may appear on a variant manifest's own
``annotations`` (the TP-sharded packer writes ``layout`` and ``tp-size`` there); ``index create``
copies them onto the entry's descriptor.

Values (all strings, as OCI annotations are):

``dev.modelpack.variant.precision``
    the weights' dtype as the model config declares it (``config.precision``), in its short
    lower-case name (:func:`normalize_precision`: ``bfloat16`` → ``bf16``): ``bf16``, ``f16``,
    ``f32``, ``fp8``…
``dev.modelpack.variant.quantization``
    ``config.quantization`` (``awq``, ``gptq``…) or ``none``.
``dev.modelpack.variant.tp-size``
    a positive decimal integer (``"1"``, ``"8"``): the tensor-parallel size the layout is for.
``dev.modelpack.variant.accelerator``
    what ``loader/fingerprint.py``'s ``device_arch`` computes — ``cpu-x86_64``, ``cpu-aarch64``,
    ``cuda-sm_90-NVIDIA H200`` — or a PREFIX of it that ends at a ``-`` boundary: ``cuda`` fits every
    CUDA device, ``cuda-sm_90`` every sm_90 device whatever its name, ``cpu`` every CPU. The match is
    on whole ``-``-separated parts (``cuda-sm_9`` does NOT fit ``cuda-sm_90``), compared exactly
    (case matters). See :func:`accelerator_fits`.
``dev.modelpack.variant.engine``
    the serving engine the entry is built for (``vllm``, ``sglang``, ``transformers``…), or absent
    for "any engine".
``dev.modelpack.variant.layout``
    ``canonical`` (whole tensors, any TP size can slice them at load) or ``sharded_state``
    (pre-split per rank; ``tp-size`` is then required).

This module is the contract only (keys, value rules, the accelerator prefix rule): no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from modelpack.mediatypes.annotations import PROJECT_PREFIX

from modelpack.errors import VariantIndexError

VARIANT_PREFIX = PROJECT_PREFIX + "variant."

ANNOTATION_VARIANT_PRECISION = VARIANT_PREFIX + "precision"
ANNOTATION_VARIANT_QUANTIZATION = VARIANT_PREFIX + "quantization"
ANNOTATION_VARIANT_TP_SIZE = VARIANT_PREFIX + "tp-size"
ANNOTATION_VARIANT_ACCELERATOR = VARIANT_PREFIX + "accelerator"
ANNOTATION_VARIANT_ENGINE = VARIANT_PREFIX + "engine"
ANNOTATION_VARIANT_LAYOUT = VARIANT_PREFIX + "layout"

#: short name (what ``--variant KEY=VALUE`` takes) → annotation key, in display order
VARIANT_KEYS: dict[str, str] = {
    "precision": ANNOTATION_VARIANT_PRECISION,
    "quantization": ANNOTATION_VARIANT_QUANTIZATION,
    "tp-size": ANNOTATION_VARIANT_TP_SIZE,
    "accelerator": ANNOTATION_VARIANT_ACCELERATOR,
    "engine": ANNOTATION_VARIANT_ENGINE,
    "layout": ANNOTATION_VARIANT_LAYOUT,
}

LAYOUT_CANONICAL = "canonical"
LAYOUT_SHARDED_STATE = "sharded_state"
LAYOUTS = (LAYOUT_CANONICAL, LAYOUT_SHARDED_STATE)

QUANTIZATION_NONE = "none"

#: a pusher controls these values: bounded and printable before anything compares or prints them
MAX_VARIANT_VALUE_BYTES = 128
_VALUE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+ -]*\Z")
_TP_SIZE = re.compile(r"[1-9][0-9]{0,5}\Z")


def annotation_key(short: str) -> str:
    """``precision`` → ``dev.modelpack.variant.precision``; a full key is returned as is."""
    if short in VARIANT_KEYS:
        return VARIANT_KEYS[short]
    if short in VARIANT_KEYS.values():
        return short
    raise VariantIndexError(f"unknown variant field {short!r}: known are {', '.join(VARIANT_KEYS)}")


def short_name(key: str) -> str:
    """``dev.modelpack.variant.precision`` → ``precision``."""
    return key[len(VARIANT_PREFIX) :] if key.startswith(VARIANT_PREFIX) else key


def check_variant_value(short: str, value: str, *, where: str = "variant") -> str:
    """The value if it is well formed for field ``short``, else VariantIndexError naming it.

    Every value is 1–128 bytes of letters, digits, ``. _ + -`` and spaces (the accelerator's device
    name has spaces); ``tp-size`` is a positive integer; ``layout`` is one of :data:`LAYOUTS`.
    """
    if not isinstance(value, str) or not value:
        raise VariantIndexError(f"{where}: {short} must be a non-empty string")
    if len(value.encode("utf-8")) > MAX_VARIANT_VALUE_BYTES:
        raise VariantIndexError(f"{where}: {short} is longer than {MAX_VARIANT_VALUE_BYTES} bytes")
    if not _VALUE.match(value):
        raise VariantIndexError(f"{where}: {short} value {value!r} has characters outside [A-Za-z0-9._+ -]")
    if short == "tp-size" and not _TP_SIZE.match(value):
        raise VariantIndexError(f"{where}: tp-size must be a positive integer, not {value!r}")
    if short == "layout" and value not in LAYOUTS:
        raise VariantIndexError(f"{where}: layout must be one of {', '.join(LAYOUTS)}, not {value!r}")
    return value


def variant_fields(annotations: Mapping[str, str] | None, *, where: str = "variant") -> dict[str, str]:
    """The variant fields (short name → value) of a descriptor's or manifest's annotations, checked."""
    out: dict[str, str] = {}
    for short, key in VARIANT_KEYS.items():
        if annotations and key in annotations:
            value = check_variant_value(short, annotations[key], where=where)
            out[short] = normalize_precision(value) if short == "precision" else value
    return out


def accelerator_fits(declared: str, device: str) -> bool:
    """Whether an entry declaring accelerator ``declared`` fits a node whose device arch is ``device``.

    ``declared`` fits when it equals ``device`` or is a prefix of it ending at a ``-`` boundary
    (``cuda-sm_90`` fits ``cuda-sm_90-NVIDIA H200``; ``cuda-sm_9`` does not).
    """
    if not declared or not device:
        return False
    return device == declared or device.startswith(declared + "-")


def accelerator_specificity(declared: str) -> int:
    """How many ``-``-separated parts ``declared`` names: the longer match is the more specific."""
    return len(declared.split("-")) if declared else 0


#: the dtype names configs and people write → the short name the precision field carries
_PRECISION_ALIASES = {
    "bfloat16": "bf16",
    "float16": "f16",
    "fp16": "f16",
    "half": "f16",
    "float32": "f32",
    "fp32": "f32",
    "float": "f32",
    "float64": "f64",
    "fp64": "f64",
    "float8": "fp8",
    "f8": "fp8",
    "float8_e4m3fn": "fp8",
    "int8": "i8",
    "int4": "i4",
}


def normalize_precision(value: str) -> str:
    """``bfloat16``/``BF16`` → ``bf16``, ``float32`` → ``f32``…: the config's spelling and the
    caller's ``--variant precision=`` compare equal whichever they use."""
    low = value.strip().lower()
    return _PRECISION_ALIASES.get(low, low)
