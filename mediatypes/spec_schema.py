"""Every model config modelpack writes is checked against the vendored upstream schema.

``config-schema.json`` is the released spec's file, byte for byte (``config-schema.PROVENANCE.md``
says which release and why): a config that passes here is what ``modelpack-client``, modctl and
any other reader that validates against the spec accepts. The check is the spec's own schema,
run by ``jsonschema`` with the draft the schema declares, plus one rule the schema leaves to
writers: a member the released schema does not list is never written, even where the schema
leaves ``additionalProperties`` open (``capabilities`` in v0.0.7, closed in later drafts).
"""

from __future__ import annotations

import hashlib
import json
from functools import lru_cache
from importlib import resources
from typing import Any

from modelpack.errors import ConfigError

SCHEMA_FILE = "config-schema.json"
#: the upstream release the vendored schema comes from (see config-schema.PROVENANCE.md)
SPEC_RELEASE = "v0.0.7"
SPEC_COMMIT = "6440437b4932ef6cdd134d24a410f73181303ce7"
SCHEMA_SHA256 = "c755da7f78371519c09df7d92e74c7997184f5c73472be20d9dfb840d0ebbe0a"


def schema_bytes() -> bytes:
    return resources.files("modelpack.mediatypes").joinpath(SCHEMA_FILE).read_bytes()


@lru_cache(maxsize=1)
def spec_schema() -> dict[str, Any]:
    """The vendored schema, refused if its bytes are not the release's (an edited copy would
    silently stop being the spec)."""
    raw = schema_bytes()
    actual = hashlib.sha256(raw).hexdigest()
    if actual != SCHEMA_SHA256:
        raise ConfigError(
            "$",
            f"the vendored {SCHEMA_FILE} is not model-spec {SPEC_RELEASE}'s (sha256 {actual}, "
            f"expected {SCHEMA_SHA256}); reinstall modelpack",
        )
    doc: dict[str, Any] = json.loads(raw)
    return doc


@lru_cache(maxsize=1)
def _validator() -> Any:
    import jsonschema  # only a pack pays for it: pull, the cache and the loader never write configs

    schema = spec_schema()
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def _json_path(parts: Any) -> str:
    out = "$"
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else f".{p}"
    return out


def _resolve(node: dict[str, Any], root: dict[str, Any]) -> dict[str, Any]:
    for _ in range(16):  # the schema's own refs are one level deep; a loop would be a broken schema
        ref = node.get("$ref")
        if not (isinstance(ref, str) and ref.startswith("#/")):
            return node
        target: Any = root
        for part in ref[2:].split("/"):
            target = target[part]
        node = target
    return node


def _undefined_members(doc: Any, node: dict[str, Any], root: dict[str, Any], path: str) -> None:
    node = _resolve(node, root)
    if isinstance(doc, dict) and "properties" in node:
        props: dict[str, Any] = node["properties"]
        for key, value in doc.items():
            if key not in props:
                raise ConfigError(
                    path,
                    f"member {key!r} is not defined by model-spec {SPEC_RELEASE}; "
                    "modelpack writes only what the released spec defines",
                )
            _undefined_members(value, props[key], root, f"{path}.{key}")
    elif isinstance(doc, list) and isinstance(node.get("items"), dict):
        for i, item in enumerate(doc):
            _undefined_members(item, node["items"], root, f"{path}[{i}]")


def check_written_config(doc: Any) -> None:
    """Raise ``ConfigError`` (with the JSON path) unless ``doc`` is valid under the released
    spec's schema and uses only members it defines."""
    schema = spec_schema()
    errors = sorted(_validator().iter_errors(doc), key=lambda e: list(e.absolute_path))
    if errors:
        first = errors[0]
        raise ConfigError(
            _json_path(first.absolute_path),
            f"{first.message} (model-spec {SPEC_RELEASE} config schema)",
        )
    _undefined_members(doc, schema, schema, "$")


__all__ = ["SCHEMA_SHA256", "SPEC_COMMIT", "SPEC_RELEASE", "check_written_config", "spec_schema"]
