"""The ModelPack model config (``application/vnd.cncf.model.config.v1+json``) as typed objects.

Two rule sets, because reading and writing owe different things. Reading (``from_bytes``, a
config from any tool) follows the spec's schema rules without a JSON-schema engine, so a pull or
a cache hit does not import one: required members, closed objects, ``modelfs.type == "layers"``,
non-empty sha256 ``diffIds``; it also accepts what the spec's branch head added since the release
(``datasetsURL``, ``reward``, ``languages``) and the ``transformerConfig`` that modelpack 0.1
wrote, so artifacts already in registries stay readable. Writing (``to_bytes``) must produce what
every reader accepts: the same rules plus the vendored release schema itself
(``spec_schema.check_written_config``), which refuses any member the release does not define.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from modelpack.mediatypes.spec_schema import check_written_config

from modelpack.boundedjson import loads
from modelpack.errors import ConfigError, DocumentError

_DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")
MAX_CONFIG_BYTES = 4 * 1024 * 1024
#: The schema nests 4 levels ($.config.capabilities.inputTypes); deeper is refused before parsing.
MAX_CONFIG_DEPTH = 8


_DESCRIPTOR_FIELDS: dict[str, type] = {
    "createdAt": str,
    "authors": list,
    "family": str,
    "name": str,
    "docURL": str,
    "sourceURL": str,
    "datasetsURL": list,
    "version": str,
    "revision": str,
    "vendor": str,
    "licenses": list,
    "title": str,
    "description": str,
}
_CONFIG_FIELDS: dict[str, type] = {
    "architecture": str,
    "format": str,
    "paramSize": str,
    "precision": str,
    "quantization": str,
    "capabilities": dict,
    # written by modelpack 0.1 from an unmerged spec proposal; read so its artifacts stay readable,
    # never written (the vendored release schema refuses it)
    "transformerConfig": dict,
}
_TRANSFORMER_FIELDS = {
    "attentionType": ("mha", "gqa", "mla"),
    "mlpType": ("dense", "moe"),
    "numLayers": int,
    "numAttentionHeads": int,
    "numKVHeads": int,
    "hiddenSize": int,
    "intermediateSize": int,
}
_MODALITIES = ("text", "image", "audio", "video", "embedding", "other")
_CAPABILITY_FIELDS = {
    "inputTypes": list,
    "outputTypes": list,
    "knowledgeCutoff": str,
    "reasoning": bool,
    "toolUsage": bool,
    "embedding": bool,
    "reward": bool,
    "languages": list,
}
_RFC3339 = re.compile(r"^\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})$")


def _clip(value: Any, limit: int = 80) -> str:
    """A config value as it appears in a refusal: one line, however large the value."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def is_rfc3339(text: str) -> bool:
    """Whether ``text`` is the date-time form ``createdAt`` takes (``2025-01-02T00:00:00Z``)."""
    return bool(_RFC3339.match(text))


def _check_object(obj: Any, path: str, fields: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise ConfigError(path, f"must be an object, got {type(obj).__name__}")
    extra = sorted(set(obj) - set(fields))
    if extra:
        raise ConfigError(path, f"unknown member(s) {', '.join(extra)} (additionalProperties is false)")
    return obj


def _check_type(value: Any, expected: Any, path: str) -> None:
    if isinstance(expected, tuple):
        if value not in expected:
            raise ConfigError(path, f"must be one of {', '.join(expected)}, got {_clip(value)}")
        return
    if expected is int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(path, f"must be an integer >= 1, got {_clip(value)}")
        return
    if expected is bool:
        if not isinstance(value, bool):
            raise ConfigError(path, f"must be a boolean, got {_clip(value)}")
        return
    if not isinstance(value, expected):
        raise ConfigError(path, f"must be {expected.__name__}, got {type(value).__name__}")
    if expected is list and not all(isinstance(v, str) for v in value):
        raise ConfigError(path, "must be an array of strings")


def validate_config_dict(doc: Any) -> None:
    """Raise ConfigError if ``doc`` breaks the ModelPack config schema."""
    _check_object(doc, "$", {"descriptor": 0, "config": 0, "modelfs": 0})
    for required in ("descriptor", "config", "modelfs"):
        if required not in doc:
            raise ConfigError("$", f"missing required member {required!r}")
    desc = _check_object(doc["descriptor"], "$.descriptor", _DESCRIPTOR_FIELDS)
    for key, value in desc.items():
        _check_type(value, _DESCRIPTOR_FIELDS[key], f"$.descriptor.{key}")
    if "name" in desc and not desc["name"]:
        raise ConfigError("$.descriptor.name", "must not be empty")
    if "createdAt" in desc and not _RFC3339.match(desc["createdAt"]):
        raise ConfigError(
            "$.descriptor.createdAt", f"must be an RFC 3339 date-time, got {_clip(desc['createdAt'])}"
        )
    cfg = _check_object(doc["config"], "$.config", _CONFIG_FIELDS)
    for key, value in cfg.items():
        _check_type(value, _CONFIG_FIELDS[key], f"$.config.{key}")
    if "transformerConfig" in cfg:
        tc = _check_object(cfg["transformerConfig"], "$.config.transformerConfig", _TRANSFORMER_FIELDS)
        for key, value in tc.items():
            _check_type(value, _TRANSFORMER_FIELDS[key], f"$.config.transformerConfig.{key}")
    if "capabilities" in cfg:
        caps = _check_object(cfg["capabilities"], "$.config.capabilities", _CAPABILITY_FIELDS)
        for key, value in caps.items():
            _check_type(value, _CAPABILITY_FIELDS[key], f"$.config.capabilities.{key}")
            if key in ("inputTypes", "outputTypes"):
                for item in value:
                    _check_type(item, _MODALITIES, f"$.config.capabilities.{key}[]")
            if key == "languages":
                for item in value:
                    if not re.fullmatch(r"[a-z]{2}", item):
                        raise ConfigError(
                            f"$.config.capabilities.{key}[]", f"{_clip(item)} is not an ISO 639-1 code"
                        )
    fs = _check_object(doc["modelfs"], "$.modelfs", {"type": 0, "diffIds": 0})
    if fs.get("type") != "layers":
        raise ConfigError("$.modelfs.type", f"must be 'layers', got {_clip(fs.get('type'))}")
    diff_ids = fs.get("diffIds")
    if not isinstance(diff_ids, list) or not diff_ids:
        raise ConfigError("$.modelfs.diffIds", "must be a non-empty array")
    for i, d in enumerate(diff_ids):
        if not isinstance(d, str) or not _DIGEST_RE.match(d):
            raise ConfigError(f"$.modelfs.diffIds[{i}]", f"{_clip(d)} is not a sha256 digest")


def _drop_none(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None}


@dataclass
class ModelDescriptor:
    name: str | None = None
    version: str | None = None
    family: str | None = None
    vendor: str | None = None
    title: str | None = None
    description: str | None = None
    revision: str | None = None
    createdAt: str | None = None
    authors: list[str] | None = None
    licenses: list[str] | None = None
    docURL: str | None = None
    sourceURL: str | None = None
    datasetsURL: list[str] | None = None

    def to_dict(self) -> dict[str, Any]:
        return _drop_none(dict(self.__dict__))


@dataclass
class ModelConfig:
    architecture: str | None = None
    format: str | None = None
    paramSize: str | None = None
    precision: str | None = None
    quantization: str | None = None
    transformerConfig: dict[str, Any] | None = None
    capabilities: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return _drop_none(dict(self.__dict__))


@dataclass
class ModelFS:
    diffIds: list[str] = field(default_factory=list)
    type: str = "layers"

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type, "diffIds": list(self.diffIds)}


@dataclass
class ModelSpecConfig:
    """The whole config blob. ``to_bytes`` is canonical (sorted keys, compact) for reproducibility."""

    descriptor: ModelDescriptor
    config: ModelConfig
    modelfs: ModelFS

    def to_dict(self) -> dict[str, Any]:
        return {
            "descriptor": self.descriptor.to_dict(),
            "config": self.config.to_dict(),
            "modelfs": self.modelfs.to_dict(),
        }

    def to_bytes(self) -> bytes:
        """The config as written: valid under the released spec's schema, or ``ConfigError``."""
        doc = self.to_dict()
        validate_config_dict(doc)
        check_written_config(doc)
        return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_dict(cls, doc: Any) -> ModelSpecConfig:
        validate_config_dict(doc)
        return cls(
            descriptor=ModelDescriptor(**doc["descriptor"]),
            config=ModelConfig(**doc["config"]),
            modelfs=ModelFS(type=doc["modelfs"]["type"], diffIds=list(doc["modelfs"]["diffIds"])),
        )

    @classmethod
    def from_bytes(cls, data: bytes) -> ModelSpecConfig:
        """Parse a config blob from a registry or layout: bounded like every document from outside."""
        if len(data) > MAX_CONFIG_BYTES:
            raise ConfigError("$", f"config is {len(data)} bytes; refusing more than 4 MiB")
        try:
            doc = loads(data, what="config", max_bytes=MAX_CONFIG_BYTES, max_depth=MAX_CONFIG_DEPTH)
        except DocumentError as exc:
            raise ConfigError("$", exc.reason) from None
        return cls.from_dict(doc)
