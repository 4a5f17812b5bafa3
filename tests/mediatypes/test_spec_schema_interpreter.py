"""The written config is checked without importing jsonschema, and nothing is lost.

``modelpack.mediatypes.spec_schema`` runs the vendored model-spec schema with a small Draft 4
interpreter (importing jsonschema was a fifth of packing 1 GiB). These tests hold it to
jsonschema itself: on generated configs, valid and broken in every way the schema can refuse,
both must report the same errors at the same paths with the same messages, in the same order.
"""

from __future__ import annotations

import copy
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import rfc3339_validator
from modelpack.mediatypes import spec_schema

from modelpack.errors import ConfigError
from tests.paths import REPO_ROOT

DIGEST = "sha256:" + "ab" * 32
VALID: dict[str, Any] = {
    "descriptor": {
        "createdAt": "2026-01-02T03:04:05Z",
        "authors": ["a", "b"],
        "family": "llama",
        "name": "m",
        "docURL": "https://example.com/doc",
        "sourceURL": "https://example.com/src",
        "version": "1.0",
        "revision": "abc",
        "vendor": "Example",
        "licenses": ["Apache-2.0"],
        "title": "T",
        "description": "D",
    },
    "config": {
        "architecture": "transformer",
        "format": "safetensors",
        "paramSize": "8b",
        "precision": "bf16",
        "quantization": "none",
        "capabilities": {
            "inputTypes": ["text", "image"],
            "outputTypes": ["text"],
            "knowledgeCutoff": "2025-06-30T00:00:00+02:00",
            "reasoning": True,
            "toolUsage": False,
        },
    },
    "modelfs": {"type": "layers", "diffIds": [DIGEST, DIGEST]},
}
#: values of every JSON type, to put where the schema expects another
OTHERS: list[Any] = [0, 7, -1, 1.5, 1.0, True, False, None, "", "x", [], ["x"], [1], {}, {"k": "v"}]
DATE_TIMES = [
    "2026-01-02T03:04:05Z",
    "2026-01-02t03:04:05z",
    "2026-01-02 03:04:05Z",
    "2024-02-29T00:00:00Z",
    "2023-02-29T00:00:00Z",
    "1900-02-29T00:00:00Z",
    "2000-02-29T00:00:00Z",
    "0000-01-01T00:00:00Z",
    "2026-13-01T00:00:00Z",
    "2026-04-31T00:00:00Z",
    "2026-01-02T24:00:00Z",
    "2026-01-02T23:60:00Z",
    "2026-01-02T23:59:60Z",
    "2026-01-02T03:04:05.123456789-07:30",
    "2026-01-02T03:04:05+24:00",
    "2026-01-02T03:04:05",
    "2026-01-02",
    "２０２６-01-02T03:04:05Z",
    "2026-01-02T03:04:05Z\n",
    "",
]


def _reference() -> Any:
    schema = spec_schema.spec_schema()
    cls = jsonschema.validators.validator_for(schema)
    assert cls is jsonschema.Draft4Validator
    # the reference must check date-time (it does only when rfc3339-validator is installed)
    assert "date-time" in cls.FORMAT_CHECKER.checkers
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


REFERENCE = _reference()


def _theirs(doc: Any) -> list[tuple[list[Any], str]]:
    errors = sorted(REFERENCE.iter_errors(doc), key=lambda e: list(e.absolute_path))
    return [(list(e.absolute_path), e.message) for e in errors]


def _ours(doc: Any) -> list[tuple[list[Any], str]]:
    schema = spec_schema.spec_schema()
    return [(list(p), m) for p, m in spec_schema.schema_errors(doc, schema)]


def _slots(doc: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every member and array item path in ``doc``."""
    out: list[tuple[Any, ...]] = []
    if isinstance(doc, dict):
        for k, v in doc.items():
            out.append((*path, k))
            out.extend(_slots(v, (*path, k)))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out.append((*path, i))
            out.extend(_slots(v, (*path, i)))
    return out


def _mutate(doc: Any, rng: random.Random) -> Any:
    doc = copy.deepcopy(doc)
    slot = rng.choice(_slots(doc))
    parent = doc
    for part in slot[:-1]:
        parent = parent[part]
    key = slot[-1]
    action = rng.randrange(6)
    if action == 0 and isinstance(parent, dict):
        del parent[key]  # a required member missing (or an optional one: still valid)
    elif action == 1 and isinstance(parent, dict):
        parent[rng.choice(["extra", "datasetsURL", "Name", "", "transformerConfig"])] = "x"
    elif action == 2:
        parent[key] = rng.choice(DATE_TIMES)
    elif action == 3:
        parent[key] = rng.choice(["text", "other", "Text", "layers", "tar", "audio", "video"])
    else:
        parent[key] = copy.deepcopy(rng.choice(OTHERS))
    return doc


def test_the_vendored_schema_is_run_by_the_interpreter_and_its_keyword_list_is_draft4s() -> None:
    assert spec_schema.unsupported_construct(spec_schema.spec_schema()) is None
    assert set(jsonschema.Draft4Validator.VALIDATORS) == spec_schema._DRAFT4_KEYWORDS


def test_the_valid_config_and_every_single_break_agree_with_jsonschema() -> None:
    assert _ours(VALID) == _theirs(VALID) == []
    checked = refused = 0
    for slot in _slots(VALID):
        for value in [*OTHERS, *DATE_TIMES[:6], "text", "Text", "layers", "tar", "<deleted>"]:
            doc = copy.deepcopy(VALID)
            parent = doc
            for part in slot[:-1]:
                parent = parent[part]
            if value == "<deleted>":
                del parent[slot[-1]]
            else:
                parent[slot[-1]] = copy.deepcopy(value)
            assert _ours(doc) == _theirs(doc), (slot, value)
            checked += 1
            refused += bool(_theirs(doc))
    assert checked > 900 and refused > checked // 2


def test_random_multiple_breaks_agree_with_jsonschema_in_order() -> None:
    rng = random.Random(16)
    refused = 0
    for _ in range(3000):
        doc: Any = VALID
        for _ in range(rng.randint(1, 5)):
            doc = _mutate(doc, rng) if _slots(doc) else doc
        theirs = _theirs(doc)
        assert _ours(doc) == theirs, json.dumps(doc)
        refused += bool(theirs)
    assert refused > 2000


@pytest.mark.parametrize("doc", [None, [], "x", 1, {"descriptor": {}}, {"descriptor": {}, "config": {}}])
def test_documents_that_are_not_configs_agree_with_jsonschema(doc: Any) -> None:
    assert _ours(doc) == _theirs(doc) and _theirs(doc)


def test_date_time_is_rfc3339_validators_on_the_upper_cased_text() -> None:
    rng = random.Random(3339)
    samples = list(DATE_TIMES)
    for _ in range(2000):
        y, mo, d = rng.randint(0, 2400), rng.randint(0, 13), rng.randint(0, 32)
        samples.append(f"{y:04d}-{mo:02d}-{d:02d}T{rng.randint(0, 25):02d}:30:00Z")
    for text in samples:
        assert spec_schema.is_date_time(text) == rfc3339_validator.validate_rfc3339(text.upper()), text


def test_a_refusal_names_the_path_and_jsonschemas_message() -> None:
    doc = copy.deepcopy(VALID)
    doc["config"]["capabilities"]["knowledgeCutoff"] = "2026-02-30T00:00:00Z"
    with pytest.raises(ConfigError) as info:
        spec_schema.check_written_config(doc)
    assert info.value.path == "$.config.capabilities.knowledgeCutoff"
    assert "'2026-02-30T00:00:00Z' is not a 'date-time' (model-spec v0.0.7 config schema)" in str(info.value)


@pytest.mark.parametrize(
    "edit, reason",
    [
        (lambda s: s["$defs"]["ModelDescriptor"]["properties"]["name"].update(pattern="^m"), "pattern"),
        (lambda s: s["$defs"]["ModelFS"]["properties"].update(x={"maxItems": 2}), "maxItems"),
        (lambda s: s.update({"$schema": "http://json-schema.org/draft-07/schema#"}), "Draft 4"),
        (lambda s: s["properties"].update(config={"$ref": "#/$defs/Nope"}), "does not resolve"),
        (lambda s: s["$defs"]["Modality"].update(enum=["text", 1]), "enum"),
        (lambda s: s["$defs"]["ModelFS"]["properties"]["type"].update(format="uri"), "format"),
    ],
)
def test_a_schema_with_keywords_the_interpreter_lacks_is_left_to_jsonschema(edit: Any, reason: str) -> None:
    schema = copy.deepcopy(spec_schema.spec_schema())
    edit(schema)
    found = spec_schema.unsupported_construct(schema)
    assert found is not None and reason in found


def test_packing_does_not_import_jsonschema(checkpoint: Path, tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "from modelpack import api\n"
        "api.pack(sys.argv[1], 'oci:' + sys.argv[2] + ':v1')\n"
        "print('jsonschema' in sys.modules, 'attrs' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(checkpoint), str(tmp_path / "l")],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    assert out.stdout.split() == ["False", "False"]
