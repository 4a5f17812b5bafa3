"""A CycloneDX 1.5 SBOM (JSON) of a modelpack wheel, from its own dependency metadata.

    sbom.py WHEEL > modelpack_oci-V.cdx.json

The subject (``metadata.component``) is the wheel: name, version, purl and its SHA-256. The
components are the closure of its requirements (``Requires-Dist`` without extras, markers
evaluated for this interpreter) as installed in the environment that runs this script, the one
the release was built and tested with: name, version, purl, licence and the dependency graph. No
network. A requirement that is not installed, or installed at a version outside its specifier,
fails the script (the SBOM names only what was resolved). Reproducible: the timestamp is
SOURCE_DATE_EPOCH and the serial number is derived from the wheel's digest.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import uuid
import zipfile
from datetime import datetime, timezone
from email.parser import Parser
from importlib.metadata import PackageNotFoundError, distribution
from typing import Any

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


def purl(name: str, version: str) -> str:
    return f"pkg:pypi/{canonicalize_name(name)}@{version}"


def _requirements(lines: list[str]) -> list[Requirement]:
    found = []
    for line in lines:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            found.append(req)
    return found


def _licence(meta: Any) -> list[dict[str, Any]]:
    expression = meta.get("License-Expression")
    if expression:
        return [{"expression": expression}]
    text = (meta.get("License") or "").strip()
    if text and "\n" not in text and len(text) < 100:
        return [{"license": {"name": text}}]
    return []


def build(wheel_path: str) -> dict[str, Any]:
    data = open(wheel_path, "rb").read()
    digest = hashlib.sha256(data).hexdigest()
    with zipfile.ZipFile(wheel_path) as zf:
        (name,) = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        meta = Parser().parsestr(zf.read(name).decode())
    subject = purl(meta["Name"], meta["Version"])
    components: dict[str, dict[str, Any]] = {}
    graph: dict[str, list[str]] = {subject: []}
    todo = [(subject, r) for r in _requirements(meta.get_all("Requires-Dist") or [])]
    while todo:
        parent, req = todo.pop(0)
        try:
            dist = distribution(req.name)
        except PackageNotFoundError:
            raise SystemExit(f"sbom: {req} (required by {parent}) is not installed in {sys.prefix}") from None
        if dist.version not in req.specifier:
            raise SystemExit(f"sbom: {req} (required by {parent}): {sys.prefix} has {dist.version}")
        ref = purl(dist.metadata["Name"], dist.version)
        if ref not in graph[parent]:
            graph[parent].append(ref)
        if ref in components:
            continue
        component: dict[str, Any] = {
            "type": "library",
            "bom-ref": ref,
            "name": canonicalize_name(dist.metadata["Name"]),
            "version": dist.version,
            "purl": ref,
        }
        licences = _licence(dist.metadata)
        if licences:
            component["licenses"] = licences
        components[ref] = component
        graph[ref] = []
        todo.extend((ref, r) for r in _requirements(dist.requires or []))
    epoch = int(os.environ.get("SOURCE_DATE_EPOCH", "0"))
    return {
        "bomFormat": "CycloneDX",
        "specVersion": "1.5",
        "serialNumber": f"urn:uuid:{uuid.uuid5(uuid.NAMESPACE_URL, subject + '#sha256:' + digest)}",
        "version": 1,
        "metadata": {
            "timestamp": datetime.fromtimestamp(epoch, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "tools": {"components": [{"type": "application", "name": "modelpack .ci/sbom.py"}]},
            "component": {
                "type": "library",
                "bom-ref": subject,
                "name": meta["Name"],
                "version": meta["Version"],
                "purl": subject,
                "hashes": [{"alg": "SHA-256", "content": digest}],
                "licenses": _licence(meta),
                "externalReferences": [
                    {
                        "type": "distribution",
                        "url": os.path.basename(wheel_path),
                        "hashes": [{"alg": "SHA-256", "content": digest}],
                    }
                ],
            },
        },
        "components": sorted(components.values(), key=lambda c: c["bom-ref"]),
        "dependencies": [{"ref": ref, "dependsOn": sorted(deps)} for ref, deps in sorted(graph.items())],
    }


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: sbom.py WHEEL")
    json.dump(build(sys.argv[1]), sys.stdout, indent=2, sort_keys=True)
    sys.stdout.write("\n")
