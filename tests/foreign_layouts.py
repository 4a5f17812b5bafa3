"""OCI layouts as other model tools write them, built here from their documented formats (not a
test module; the tools themselves are Go binaries that tests cannot fetch).

``write_modctl_layout``: what ``modctl build`` (github.com/modelpack/modctl, pkg/backend/build.go,
pkg/backend/build/builder.go, pkg/archiver) stores for a Modelfile today:

- one layer per file, processors in the order CONFIG, MODEL, CODE, DOC; the media types in the
  ``vnd.cnai`` naming (``application/vnd.cnai.model.weight.v1.tar``; ``….raw`` with ``--raw``);
- a ``tar`` layer is Go's ``archive/tar`` of that one file: a ustar header from
  ``tar.FileInfoHeader`` named by the path relative to the context directory (no directory
  entries; the builder's uid/gid and owner names; mtime in whole seconds), the bytes, and two
  zero blocks (no padding to a 10 KiB record as Python's tarfile adds);
- each layer annotated ``org.cncf.model.filepath`` (the relative path) and
  ``org.cncf.model.file.metadata+json`` (model-spec ``FileMetadata``: name, mode, uid, gid,
  size, mtime with nanoseconds and the builder's zone, typeflag ``'0'``);
- the config (``application/vnd.cnai.model.config.v1+json``) as Go marshals model-spec's
  ``Model``: ``descriptor`` (createdAt from ``time.Now()``, family, name, sourceURL, revision),
  ``modelfs`` (``diffIds`` = the layers' digests) and ``config`` (architecture, format,
  paramSize, precision, quantization, ``capabilities.reasoning``), Go's field order, no spaces;
- the manifest (OCI, ``artifactType`` ``application/vnd.cnai.model.manifest.v1+json``) with the
  Modelfile's text in the ``org.cncf.modctl.modelfile`` annotation.

``write_kitops_layout``: a KitOps ModelKit (github.com/kitops-ml/kitops, pkg/artifact/kitfile.go,
pkg/lib/constants): the Kitfile as the config (``application/vnd.kitops.modelkit.config.v1+json``:
``manifestVersion``, ``package``, ``model``/``code``/``docs`` entries each with the ``digest`` and
``diffId`` of its layer), one ``application/vnd.kitops.modelkit.<model|code|docs>.v1.tar+gzip``
layer per entry holding the entry's path (a file or a directory, members relative to the context
directory), and no ModelPack annotations.
"""

from __future__ import annotations

import fnmatch
import gzip
import hashlib
import io
import json
import os
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
REF_NAME = "org.opencontainers.image.ref.name"

#: the zone and sub-second times a Go program on a builder's machine writes
GO_CREATED_AT = "2025-06-30T18:04:05.123456789+08:00"
GO_MTIME = "2025-06-30T17:59:01.987654321+08:00"
GO_MTIME_SECONDS = 1751277541  # GO_MTIME truncated to the second, as archive/tar writes it
BUILDER_UID, BUILDER_GID = 1000, 1000

#: modctl's Modelfile commands → layer kind, in its processing order
MODCTL_KINDS = (("CONFIG", "weight.config"), ("MODEL", "weight"), ("CODE", "code"), ("DOC", "doc"))


def _go_json(doc: Any) -> bytes:
    """``encoding/json.Marshal``: fields in struct order (dicts here keep theirs), no spaces."""
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def go_tar_of_file(path: Path, name: str, *, mode: int = 0o644) -> bytes:
    """Go ``archive/tar`` of one regular file as modctl's archiver writes it (see module doc)."""
    data = path.read_bytes()
    ti = tarfile.TarInfo(name)
    ti.size, ti.mode, ti.mtime = len(data), mode, GO_MTIME_SECONDS
    ti.uid, ti.gid, ti.uname, ti.gname = BUILDER_UID, BUILDER_GID, "builder", "builder"
    header = ti.tobuf(tarfile.USTAR_FORMAT, "utf-8", "surrogateescape")
    pad = b"\0" * (-len(data) % 512)
    return header + data + pad + b"\0" * 1024


@dataclass
class Layout:
    """An OCI image layout being written: blobs by digest, then ``index.json`` naming the tag."""

    root: Path

    def __post_init__(self) -> None:
        (self.root / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
        (self.root / "oci-layout").write_text('{"imageLayoutVersion":"1.0.0"}')

    def blob(self, data: bytes) -> str:
        digest = _digest(data)
        (self.root / "blobs" / "sha256" / digest[7:]).write_bytes(data)
        return digest

    def tag(self, manifest: bytes, tag: str) -> str:
        digest = self.blob(manifest)
        index = {
            "schemaVersion": 2,
            "mediaType": OCI_INDEX,
            "manifests": [
                {
                    "mediaType": OCI_MANIFEST,
                    "digest": digest,
                    "size": len(manifest),
                    "annotations": {REF_NAME: tag},
                }
            ],
        }
        (self.root / "index.json").write_bytes(_go_json(index))
        return digest


def modctl_modelfile(name: str = "tiny-llama") -> str:
    """A Modelfile in modctl's documented syntax for a synthetic checkpoint."""
    return (
        f"NAME {name}\nARCH transformer\nFAMILY llama\nFORMAT safetensors\nPARAMSIZE 1M\n"
        "PRECISION bf16\nCONFIG *.json\nMODEL *.safetensors\nCODE *.py\nDOC *.md\n"
    )


def _modelfile_globs(text: str) -> dict[str, list[str]]:
    globs: dict[str, list[str]] = {}
    for line in text.splitlines():
        cmd, _, arg = line.strip().partition(" ")
        globs.setdefault(cmd, []).append(arg.strip())
    return globs


def write_modctl_layout(
    context: Path,
    root: Path,
    tag: str = "v1",
    *,
    raw: bool = False,
    modelfile: str | None = None,
    reasoning: bool = True,
) -> str:
    """``modctl build -f Modelfile CONTEXT`` (``--raw``: raw layers) as an OCI layout at ``root``;
    returns the manifest digest."""
    modelfile = modelfile or modctl_modelfile()
    globs = _modelfile_globs(modelfile)
    layout = Layout(root)
    files = sorted(p.relative_to(context).as_posix() for p in context.rglob("*") if p.is_file())
    layers: list[dict[str, Any]] = []
    taken: set[str] = set()
    for command, kind in MODCTL_KINDS:
        for rel in files:
            if rel in taken or not any(fnmatch.fnmatch(rel, g) for g in globs.get(command, [])):
                continue
            taken.add(rel)
            src = context / rel
            mode = src.stat().st_mode & 0o777
            blob = src.read_bytes() if raw else go_tar_of_file(src, rel, mode=mode)
            meta = {
                "name": src.name,
                "mode": mode,
                "uid": BUILDER_UID,
                "gid": BUILDER_GID,
                "size": src.stat().st_size,
                "mtime": GO_MTIME,
                "typeflag": ord("0"),
            }
            layers.append(
                {
                    "mediaType": f"application/vnd.cnai.model.{kind}.v1.{'raw' if raw else 'tar'}",
                    "digest": layout.blob(blob),
                    "size": len(blob),
                    "annotations": {
                        "org.cncf.model.file.metadata+json": json.dumps(meta, separators=(",", ":")),
                        "org.cncf.model.filepath": rel,
                    },
                }
            )
    fields = {
        key: value
        for key, value in (
            (cmd, globs.get(cmd.upper(), [""])[0])
            for cmd in ("name", "arch", "family", "format", "paramsize", "precision", "quantization")
        )
        if value
    }
    config_section: dict[str, Any] = {
        k: fields[f]
        for k, f in (
            ("architecture", "arch"),
            ("format", "format"),
            ("paramSize", "paramsize"),
            ("precision", "precision"),
            ("quantization", "quantization"),
        )
        if f in fields
    }
    if reasoning:
        config_section["capabilities"] = {"reasoning": True}
    config = _go_json(
        {
            "descriptor": {
                "createdAt": GO_CREATED_AT,
                "family": fields.get("family", ""),
                "name": fields.get("name", ""),
                "sourceURL": "https://example.invalid/models/tiny-llama.git",
                "revision": "0123456789abcdef0123456789abcdef01234567",
            },
            "modelfs": {"type": "layers", "diffIds": [layer["digest"] for layer in layers]},
            "config": config_section,
        }
    )
    manifest = _go_json(
        {
            "schemaVersion": 2,
            "mediaType": OCI_MANIFEST,
            "artifactType": "application/vnd.cnai.model.manifest.v1+json",
            "config": {
                "mediaType": "application/vnd.cnai.model.config.v1+json",
                "digest": layout.blob(config),
                "size": len(config),
            },
            "layers": layers,
            "annotations": {"org.cncf.modctl.modelfile": modelfile},
        }
    )
    return layout.tag(manifest, tag)


# --------------------------------------------------------------------------- KitOps
KIT_CONFIG = "application/vnd.kitops.modelkit.config.v1+json"
KIT_MANIFEST_ARTIFACT_TYPE = "application/vnd.kitops.modelkit.manifest.v1+json"


def _tar_of_paths(context: Path, paths: list[str]) -> bytes:
    """KitOps' layer tar: each path (a file or a directory, walked) with members relative to the
    context directory, directories included, modes kept."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for rel in paths:
            src = context / rel
            walk = [src, *sorted(src.rglob("*"))] if src.is_dir() else [src]
            for p in walk:
                ti = tar.gettarinfo(str(p), arcname=p.relative_to(context).as_posix())
                ti.uid = ti.gid = 0
                ti.uname = ti.gname = ""
                ti.mtime = GO_MTIME_SECONDS
                if p.is_file():
                    with open(p, "rb") as f:
                        tar.addfile(ti, f)
                else:
                    tar.addfile(ti)
    return buf.getvalue()


def write_kitops_layout(context: Path, root: Path, entries: dict[str, list[str]], tag: str = "v1") -> str:
    """``kit pack CONTEXT`` for a Kitfile whose ``model`` / ``code`` / ``docs`` entries name
    ``entries[kind]`` paths (the first model path is ``model.path``, the others its ``parts``);
    returns the manifest digest."""
    layout = Layout(root)
    kitfile: dict[str, Any] = {
        "manifestVersion": "1.0.0",
        "package": {"name": "tiny-llama", "version": "1.0"},
    }
    layers: list[dict[str, Any]] = []
    model_paths = entries.get("model", [])
    plan = [("model", p) for p in model_paths[:1]] + [("modelpart", p) for p in model_paths[1:]]
    plan += [(kind, p) for kind in ("code", "docs") for p in entries.get(kind, [])]
    for kind, rel in plan:
        raw = _tar_of_paths(context, [rel])
        blob = gzip.compress(raw, mtime=0)
        info = {"path": rel, "digest": layout.blob(blob), "diffId": _digest(raw)}
        layers.append(
            {
                "mediaType": f"application/vnd.kitops.modelkit.{kind}.v1.tar+gzip",
                "digest": info["digest"],
                "size": len(blob),
            }
        )
        if kind == "model":
            kitfile["model"] = {"name": "tiny-llama", "format": "safetensors", **info, "parts": []}
        elif kind == "modelpart":
            kitfile["model"]["parts"].append(info)
        else:
            kitfile.setdefault(kind, []).append(info)
    config = _go_json(kitfile)
    manifest = _go_json(
        {
            "schemaVersion": 2,
            "mediaType": OCI_MANIFEST,
            "config": {"mediaType": KIT_CONFIG, "digest": layout.blob(config), "size": len(config)},
            "layers": layers,
            "annotations": {"ml.kitops.modelkit.cli-version": "1.4.0"},
        }
    )
    return layout.tag(manifest, tag)


def files_of(root: Path) -> dict[str, str]:
    """Relative path → sha256 of every regular file below ``root`` (hidden files left out)."""
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts)
    }


def modes_of(root: Path) -> dict[str, int]:
    return {
        p.relative_to(root).as_posix(): os.stat(p).st_mode & 0o777
        for p in sorted(root.rglob("*"))
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts)
    }
