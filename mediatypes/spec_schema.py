"""Every model config modelpack writes is checked against the vendored upstream schema.

``config-schema.json`` is the released spec's file, byte for byte (``config-schema.PROVENANCE.md``
says which release and why): a config that passes here is what ``modelpack-client``, modctl and
any other reader that validates against the spec accepts. The check is the spec's own schema,
run by ``jsonschema`` with the draft the schema declares, plus one rule the schema leaves to
writers: a member the released schema does not list is never written, even where the schema
leaves ``additionalProperties`` open (``capabilities`` in v0.0.7, closed in later drafts).

Importing ``jsonschema`` costs a pack 75-150 ms (attrs, referencing and every optional format
library it probes), a fifth of packing a 1 GiB checkpoint. So the check is run by a small
Draft 4 interpreter of the keywords the vendored schema uses (``type``, ``properties``,
``additionalProperties``, ``required``, ``items``, ``enum``, ``minItems``, ``minLength``, ``format:
date-time`` and local ``$ref``), with jsonschema's semantics and messages; it reads the vendored
schema itself, never a hand copy of its rules. A schema with any other validation keyword (a future
vendored release) is run by ``jsonschema`` as before. ``tests/mediatypes/test_spec_schema_interpreter.py``
checks the interpreter against ``jsonschema`` on generated valid and broken configs.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterator
from functools import lru_cache
from typing import Any

from modelpack.errors import ConfigError

SCHEMA_FILE = "config-schema.json"
#: the upstream release the vendored schema comes from (see config-schema.PROVENANCE.md)
SPEC_RELEASE = "v0.0.7"
SPEC_COMMIT = "6440437b4932ef6cdd134d24a410f73181303ce7"
SCHEMA_SHA256 = "c755da7f78371519c09df7d92e74c7997184f5c73472be20d9dfb840d0ebbe0a"


def schema_bytes() -> bytes:
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), SCHEMA_FILE)
    try:
        with open(here, "rb") as f:  # an installed or editable package: a file beside this module
            return f.read()
    except FileNotFoundError:
        from importlib import resources  # a zipped install; 8 ms of imports a pack rarely needs

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


# --- the Draft 4 interpreter --------------------------------------------------------------------------

DRAFT4 = "http://json-schema.org/draft-04/schema#"
#: Draft 4's validation keywords (jsonschema's ``Draft4Validator.VALIDATORS``); any other member
#: of a schema object (``$schema``, ``$defs``, ``description`` …) validates nothing
_DRAFT4_KEYWORDS = frozenset(
    [
        "$ref",
        "additionalItems",
        "additionalProperties",
        "allOf",
        "anyOf",
        "dependencies",
        "enum",
        "format",
        "items",
        "maxItems",
        "maxLength",
        "maxProperties",
        "maximum",
        "minItems",
        "minLength",
        "minProperties",
        "minimum",
        "multipleOf",
        "not",
        "oneOf",
        "pattern",
        "patternProperties",
        "properties",
        "required",
        "type",
        "uniqueItems",
    ]
)
#: Draft 4 types (jsonschema's draft-4 type checker: a bool is not a number, 1.0 not an integer)
_TYPES: dict[str, Any] = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
}
# rfc3339-validator's date-time (what jsonschema's format checker runs, on the upper-cased text)
_DATE_TIME = re.compile(
    r"^(\d{4})-(0[1-9]|1[0-2])-(\d{2})T(?:[01]\d|2[0123]):(?:[0-5]\d):(?:[0-5]\d)(?:\.\d+)?"
    r"(?:Z|[+-](?:[01]\d|2[0123]):[0-5]\d)$",
    re.ASCII,
)
_MONTH_DAYS = (31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31)


def is_date_time(text: str) -> bool:
    """RFC 3339 ``date-time`` as JSON Schema's ``format`` means it: a real calendar day."""
    m = _DATE_TIME.match(text.upper())
    if m is None:
        return False
    year, month, day = (int(g) for g in m.groups())
    leap = month == 2 and year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)
    return year != 0 and 1 <= day <= _MONTH_DAYS[month - 1] + leap


def _resolve_ref(ref: Any, root: dict[str, Any]) -> Any:
    if not (isinstance(ref, str) and ref.startswith("#/")):
        raise LookupError(f"$ref {ref!r} is not a local JSON pointer")
    target: Any = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(target, dict) or part not in target:
            raise LookupError(f"$ref {ref!r} does not resolve")
        target = target[part]
    return target


def unsupported_construct(schema: Any) -> str | None:
    """Why the interpreter cannot run ``schema`` (``None``: it runs every keyword the schema has)."""
    if not isinstance(schema, dict) or schema.get("$schema") != DRAFT4:
        return "not a Draft 4 schema object"
    seen: set[int] = set()
    todo: list[tuple[Any, str]] = [(schema, "#")]
    while todo:
        node, where = todo.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if not isinstance(node, dict):
            return f"{where}: a schema that is not an object"
        if "$ref" in node:  # Draft 4: the siblings of $ref are ignored
            try:
                todo.append((_resolve_ref(node["$ref"], schema), node["$ref"]))
            except LookupError as exc:
                return f"{where}: {exc}"
            continue
        for key, value in node.items():
            if key not in _DRAFT4_KEYWORDS:
                continue
            ok = True
            if key == "type":
                names = value if isinstance(value, list) else [value]
                ok = bool(names) and all(isinstance(n, str) and n in _TYPES for n in names)
            elif key == "properties":
                ok = isinstance(value, dict) and all(isinstance(v, dict) for v in value.values())
                if ok:
                    todo.extend((v, f"{where}/properties/{k}") for k, v in value.items())
            elif key == "additionalProperties":
                ok = isinstance(value, bool)
            elif key == "required":
                ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
            elif key == "items":
                ok = isinstance(value, dict)
                if ok:
                    todo.append((value, f"{where}/items"))
            elif key == "enum":
                ok = isinstance(value, list) and bool(value) and all(isinstance(v, str) for v in value)
            elif key in ("minItems", "minLength"):
                ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
            elif key == "format":
                ok = value == "date-time"
            else:
                ok = False
            if not ok:
                return f"{where}: {key} {value!r}"[:200]
    return None


def _errors(
    doc: Any, node: dict[str, Any], root: dict[str, Any], path: tuple[Any, ...]
) -> Iterator[tuple[tuple[Any, ...], str]]:
    """jsonschema's ``iter_errors`` for the keywords ``unsupported_construct`` accepts: the same
    order (schema keyword order, depth first), paths and messages."""
    if "$ref" in node:
        yield from _errors(doc, _resolve_ref(node["$ref"], root), root, path)
        return
    for key, value in node.items():
        if key == "type":
            names = value if isinstance(value, list) else [value]
            if not any(_TYPES[n](doc) for n in names):
                yield path, f"{doc!r} is not of type {', '.join(repr(n) for n in names)}"
        elif key == "properties" and isinstance(doc, dict):
            for name, sub in value.items():
                if name in doc:
                    yield from _errors(doc[name], sub, root, (*path, name))
        elif key == "additionalProperties" and isinstance(doc, dict) and value is False:
            props = node.get("properties", {})
            extras = sorted({k for k in doc if k not in props}, key=str)
            if extras:
                verb = "was" if len(extras) == 1 else "were"
                listed = ", ".join(repr(k) for k in extras)
                yield path, f"Additional properties are not allowed ({listed} {verb} unexpected)"
        elif key == "required" and isinstance(doc, dict):
            for name in value:
                if name not in doc:
                    yield path, f"{name!r} is a required property"
        elif key == "items" and isinstance(doc, list):
            for i, item in enumerate(doc):
                yield from _errors(item, value, root, (*path, i))
        elif key == "enum" and not (isinstance(doc, str) and doc in value):
            yield path, f"{doc!r} is not one of {value!r}"
        elif key in ("minItems", "minLength"):
            sized = isinstance(doc, list) if key == "minItems" else isinstance(doc, str)
            if sized and len(doc) < value:
                yield path, f"{doc!r} {'should be non-empty' if value == 1 else 'is too short'}"
        elif key == "format" and isinstance(doc, str) and not is_date_time(doc):
            yield path, f"{doc!r} is not a {value!r}"


@lru_cache(maxsize=1)
def _interpretable() -> bool:
    return unsupported_construct(spec_schema()) is None


def schema_errors(doc: Any, schema: dict[str, Any]) -> list[tuple[tuple[Any, ...], str]]:
    """Every (path, message) the interpreter finds, in the order ``check_written_config`` ranks them."""
    return sorted(_errors(doc, schema, schema, ()), key=lambda e: list(e[0]))


def check_written_config(doc: Any) -> None:
    """Raise ``ConfigError`` (with the JSON path) unless ``doc`` is valid under the released
    spec's schema and uses only members it defines."""
    schema = spec_schema()
    if _interpretable():
        errors = schema_errors(doc, schema)
        if errors:
            where, message = errors[0]
            raise ConfigError(_json_path(where), f"{message} (model-spec {SPEC_RELEASE} config schema)")
    else:
        found = sorted(_validator().iter_errors(doc), key=lambda e: list(e.absolute_path))
        if found:
            first = found[0]
            raise ConfigError(
                _json_path(first.absolute_path),
                f"{first.message} (model-spec {SPEC_RELEASE} config schema)",
            )
    _undefined_members(doc, schema, schema, "$")


__all__ = [
    "SCHEMA_SHA256",
    "SPEC_COMMIT",
    "SPEC_RELEASE",
    "check_written_config",
    "is_date_time",
    "schema_errors",
    "spec_schema",
    "unsupported_construct",
]
