"""Where the contract of every ``--json`` output is kept: one JSON Schema per command.

``modelpack/cli/schemas/<command path, '-'-joined>.json`` (``pull.json``, ``cache-gc.json``,
``k8s-kserve-inferenceservice.json``) ships in the wheel, so a script can validate what it reads.
The rules the schemas hold (tests/cli/test_json_outputs.py checks each against the real command):
keys modelpack chooses are camelCase, as in the OCI and Kubernetes documents it prints; those
documents (manifests, model configs, pod specs) and stored fingerprints keep their own spelling
(``x-document`` in a schema); times are RFC 3339 UTC strings (``modelpack.timestamps``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SCHEMAS = Path(__file__).with_name("schemas")


def schema_path(command: str) -> Path:
    """The schema file of ``command`` (``"cache gc"`` → ``schemas/cache-gc.json``)."""
    return SCHEMAS / (command.replace(" ", "-") + ".json")


def load_schema(command: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(schema_path(command).read_text())
    return doc
