"""The OpenSSF model_signing v1.0 directory signature (``model_signing verify key`` compatible).

Statement (as written by model_signing 1.x, checked against the installed package):
``subject = [{"name": <model name>, "digest": {"sha256": <root>}}]`` where root is sha256 over the
concatenated RAW file digests in resource order; ``predicateType
https://model_signing/signature/v1.0``; ``predicate = {"serialization": {"method": "files",
"hash_type": "sha256", "allow_symlinks": false}, "resources": [{"name", "algorithm", "digest"}]}``
with resources sorted by path parts (``PurePosixPath`` order). The bundle's key hint is the key id.

A ModelPack raw layer is byte-identical to its file, so the statement is built from the manifest
alone (no download): each raw layer's digest is its file's sha256.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Iterable, Mapping
from pathlib import PurePosixPath
from typing import Any

from modelpack.mediatypes import layer_filepath, parse_layer_media_type
from modelpack.mediatypes.annotations import safe_relative_path
from modelpack.signing.statements import PREDICATE_MODEL_SIGNING, Statement

from modelpack.errors import BundleError, ModelpackError, SigningError
from modelpack.oci.descriptor import Manifest
from modelpack.oci.digest import sha256_file

SERIALIZATION = {"method": "files", "hash_type": "sha256", "allow_symlinks": False}
MAX_RESOURCES = 1_000_000
MAX_IGNORE_PATHS = 4096
#: What ``model_signing verify`` leaves out of a directory by default (``--ignore-git-paths``):
#: a checkout's git metadata is not part of the model, so a directory that verifies there
#: verifies here too.
GIT_PATHS = (".git", ".gitattributes", ".github", ".gitignore")


def _sort_key(path: str) -> tuple[str, ...]:
    return PurePosixPath(path).parts


def directory_statement(files: Mapping[str, str], model_name: str) -> Statement:
    """``files``: relative POSIX path → sha256 hex of the file's bytes."""
    resources = []
    root = hashlib.sha256()
    for path in sorted(files, key=_sort_key):
        hexdigest = files[path]
        root.update(bytes.fromhex(hexdigest))
        resources.append({"name": path, "algorithm": "sha256", "digest": hexdigest})
    return Statement(
        ({"name": model_name, "digest": {"sha256": root.hexdigest()}},),
        PREDICATE_MODEL_SIGNING,
        {"serialization": dict(SERIALIZATION), "resources": resources},
    )


def files_from_manifest(manifest: Manifest) -> dict[str, str]:
    """path → sha256 hex for every layer; only raw layers map 1:1 onto files."""
    out: dict[str, str] = {}
    for i, layer in enumerate(manifest.layers):
        lt = parse_layer_media_type(layer.media_type)
        path = layer_filepath(layer.annotations)
        if lt is None or not lt.is_raw or not path:
            raise SigningError(
                f"manifest {manifest.digest} layer {i} ({layer.media_type}) is not a raw file layer; "
                "a model_signing directory signature needs one raw layer per file"
            )
        path = safe_relative_path(path)
        if path in out:
            raise SigningError(f"manifest {manifest.digest}: file {path!r} appears twice")
        out[path] = layer.digest.hex
    return out


def statement_files(statement: Statement) -> dict[str, str]:
    """Check a parsed model_signing statement (root digest included) and return its file map."""
    if statement.predicate_type != PREDICATE_MODEL_SIGNING:
        raise BundleError(f"predicateType {statement.predicate_type!r}, expected {PREDICATE_MODEL_SIGNING}")
    pred: dict[str, Any] = statement.predicate
    ser = pred.get("serialization")
    if not isinstance(ser, dict) or ser.get("method") != "files" or ser.get("hash_type") != "sha256":
        raise BundleError(f"unsupported model_signing serialization {ser!r} (want files/sha256)")
    resources = pred.get("resources")
    if not isinstance(resources, list) or len(resources) > MAX_RESOURCES:
        raise BundleError("model_signing predicate has no resources list")
    root = hashlib.sha256()
    files: dict[str, str] = {}
    for r in resources:
        if not isinstance(r, dict) or r.get("algorithm") != "sha256":
            raise BundleError(f"model_signing resource {r!r}: want a sha256 resource")
        name, digest = r.get("name"), r.get("digest")
        if not isinstance(name, str) or not isinstance(digest, str) or len(digest) != 64:
            raise BundleError(f"model_signing resource {r!r}: bad name or digest")
        try:
            root.update(bytes.fromhex(digest))
        except ValueError as exc:
            raise BundleError(f"model_signing resource {name!r}: digest is not hex") from exc
        files[safe_relative_path(name)] = digest.lower()
    if len(statement.subjects) != 1 or statement.subject_sha256 != [root.hexdigest()]:
        raise BundleError(
            f"model_signing root digest {statement.subject_sha256} does not match its resources ({root.hexdigest()})"
        )
    return files


def statement_ignore_paths(statement: Statement) -> tuple[str, ...]:
    """The paths a model_signing statement records as left out of the directory
    (``serialization.ignore_paths``: the signature file, git metadata, ``--ignore-paths``),
    relative to the directory. The list is signed, yet still bounded and checked: a path
    outside the directory (absolute, ``..``) or a malformed entry refuses the statement."""
    ser = statement.predicate.get("serialization")
    raw = ser.get("ignore_paths", []) if isinstance(ser, dict) else []
    if not isinstance(raw, list) or len(raw) > MAX_IGNORE_PATHS:
        raise BundleError(f"model_signing ignore_paths must be a list of at most {MAX_IGNORE_PATHS} paths")
    out: list[str] = []
    for entry in raw:
        if not isinstance(entry, str):
            raise BundleError(f"model_signing ignore_paths entry {entry!r} is not a path")
        try:
            out.append(
                safe_relative_path(entry.rstrip("/") or entry, what="model_signing ignore_paths entry")
            )
        except ModelpackError as exc:
            raise BundleError(str(exc)) from exc
    return tuple(out)


def hash_directory(
    path: str, ignore: Iterable[str] = (), ignore_relative: Iterable[str] = ()
) -> dict[str, str]:
    """Every regular file under ``path`` (relative POSIX path → sha256 hex). Symlinks and other
    non-regular entries are refused: the signature format says ``allow_symlinks: false``.
    ``ignore`` (paths) and ``ignore_relative`` (paths relative to ``path``) are left out, a
    directory with everything under it, as model_signing leaves out its ``ignore_paths``."""
    root = os.path.abspath(path)
    ignored = {os.path.abspath(p) for p in ignore}
    ignored |= {os.path.join(root, *rel.split("/")) for rel in ignore_relative}
    out: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if os.path.join(dirpath, d) not in ignored)
        for name in sorted(filenames) + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            full = os.path.join(dirpath, name)
            if full in ignored:
                continue
            rel = os.path.relpath(full, root).replace(os.sep, "/")
            st = os.lstat(full)
            if not stat.S_ISREG(st.st_mode):
                out[rel] = "<not a regular file>"
                continue
            digest, _ = sha256_file(full)
            out[rel] = digest.hex
    return out


def compare_files(signed: Mapping[str, str], actual: Mapping[str, str]) -> list[str]:
    """Human-readable differences; empty when the directory is exactly the signed file set."""
    problems = []
    for p in sorted(set(signed) - set(actual), key=_sort_key):
        problems.append(f"missing file {p}")
    for p in sorted(set(actual) - set(signed), key=_sort_key):
        problems.append(f"unsigned extra file {p}")
    for p in sorted(set(signed) & set(actual), key=_sort_key):
        if signed[p] != actual[p]:
            problems.append(f"file {p} has sha256 {actual[p]}, signed {signed[p]}")
    return problems
