"""Annotation keys on ModelPack layers, and the per-file metadata they carry."""

from __future__ import annotations

import json
import posixpath
from collections.abc import Mapping
from dataclasses import asdict, dataclass

from modelpack.boundedjson import loads
from modelpack.errors import DocumentError, ModelpackError, UnsafePathError
from modelpack.terminal import has_control_characters

ANNOTATION_FILEPATH = "org.cncf.model.filepath"
ANNOTATION_FILE_METADATA = "org.cncf.model.file.metadata+json"
ANNOTATION_FILE_MEDIATYPE_UNTESTED = "org.cncf.model.file.mediatype.untested"
ANNOTATION_TITLE = "org.opencontainers.image.title"
ANNOTATION_CREATED = "org.opencontainers.image.created"

#: modelpack's own keys. The spec reserves ``org.cncf.model.*`` for the keys it defines; anything
#: else modelpack records goes under the project's reverse-DNS prefix (as runtime assets do).
PROJECT_PREFIX = "dev.modelpack."
#: the Hugging Face class name (``config.json`` ``architectures[0]``, e.g. ``LlamaForCausalLM``):
#: the spec's ``config.architecture`` is the kind of network ("transformer").
ANNOTATION_HF_ARCHITECTURE = PROJECT_PREFIX + "hf.architecture"
#: the transformer shape (layers, heads, attention and MLP type) as canonical JSON
ANNOTATION_TRANSFORMER = PROJECT_PREFIX + "model.transformer+json"
#: the image-shaped variant's config labels (model metadata, the ModelPack artifact it mirrors)
LABEL_MODEL_PREFIX = PROJECT_PREFIX + "model."
LABEL_ARTIFACT_DIGEST = PROJECT_PREFIX + "artifact.digest"

_LEGACY_FILEPATH = "org.cnai.model.filepath"

#: Linux's NAME_MAX and PATH_MAX: a longer name fails at write time, deep inside a pull.
MAX_NAME_BYTES = 255
MAX_PATH_BYTES = 4096
_LEGACY_FILE_METADATA = "org.cnai.model.file.metadata+json"


@dataclass(frozen=True)
class FileMetadata:
    """The ``org.cncf.model.file.metadata+json`` value (model-spec annotations.md, ``FileMetadata``).

    ``name`` is the file name (the path is ``org.cncf.model.filepath``), ``mode`` the file's
    permission bits. Clients that restore metadata (modctl, kit, modelpack-client) apply mode and
    mtime, so the packer records the real mode; the owner (0:0) and the mtime (``SOURCE_DATE_EPOCH``,
    else the epoch) are fixed so that the same directory always packs to the same digest.
    """

    name: str
    mode: int = 0o644
    uid: int = 0
    gid: int = 0
    size: int = 0
    mtime: str = "1970-01-01T00:00:00Z"
    typeflag: int = 0

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))


def safe_relative_path(path: str, *, what: str = "layer path") -> str:
    """Return ``path`` normalised if it is a safe relative POSIX path, else raise.

    Fails closed: absolute paths, ``..`` components, backslashes, NUL and empty names are refused,
    because annotations come from untrusted manifests and name files we create. So are control
    characters (C0, DEL, C1, bidirectional overrides: ``modelpack.terminal``): a file name is
    printed by ``ls``, shells and progress bars, where ``ESC [2J`` or a newline is obeyed.
    """
    shown = repr(path if len(path) <= 200 else path[:200] + "…")
    if not path or "\x00" in path or "\\" in path:
        raise UnsafePathError(f"{what} {shown} is empty or contains NUL/backslash")
    if has_control_characters(path):
        raise UnsafePathError(
            f"{what} {shown} contains a control character (terminal escapes, newlines and "
            "bidirectional overrides are refused in file names)"
        )
    if path.startswith("/"):
        raise UnsafePathError(f"{what} {shown} is absolute")
    parts = path.split("/")
    if any(p in ("..",) for p in parts):
        raise UnsafePathError(f"{what} {shown} escapes the destination with '..'")
    if len(path.encode("utf-8", "surrogatepass")) > MAX_PATH_BYTES or any(
        len(p.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES for p in parts
    ):
        raise UnsafePathError(
            f"{what} {shown} is longer than a file system allows "
            f"({MAX_NAME_BYTES} bytes a name, {MAX_PATH_BYTES} a path)"
        )
    norm = posixpath.normpath(path)
    if norm in (".", "") or norm.startswith("../"):
        raise UnsafePathError(f"{what} {shown} does not name a file")
    return norm


def layer_filepath(annotations: Mapping[str, str] | None) -> str | None:
    """The relative file path a layer declares (CNCF, legacy CNAI, or the OCI title), validated."""
    if not annotations:
        return None
    for key in (ANNOTATION_FILEPATH, _LEGACY_FILEPATH, ANNOTATION_TITLE):
        if key in annotations:
            return safe_relative_path(annotations[key], what=f"annotation {key}")
    return None


def restored_mode(annotations: Mapping[str, str] | None) -> int:
    """The mode a pulled file gets from its layer's recorded metadata: ``0o755`` when the
    recorded mode lets its owner execute it (a script), else ``0o644``. Only the exec bit is
    carried over (as podman and containerd keep it): a manifest is the publisher's word, and a
    pull never creates a setuid, setgid, sticky or world-writable file from it. Metadata that is
    missing or unreadable means ``0o644``."""
    try:
        meta = layer_file_metadata(annotations)
    except ModelpackError:
        return 0o644
    mode = meta.get("mode") if meta else None
    if isinstance(mode, int) and not isinstance(mode, bool) and mode & 0o100:
        return 0o755
    return 0o644


def layer_file_metadata(annotations: Mapping[str, str] | None) -> dict[str, object] | None:
    if not annotations:
        return None
    for key in (ANNOTATION_FILE_METADATA, _LEGACY_FILE_METADATA):
        value = annotations.get(key)
        if value:
            if len(value) > 64 * 1024:
                raise DocumentError(f"annotation {key}", "larger than 64 KiB")
            parsed = loads(value, what=f"annotation {key}", max_bytes=64 * 1024, max_depth=4)
            return parsed if isinstance(parsed, dict) else None
    return None
