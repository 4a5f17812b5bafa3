"""The packer: a safetensors checkpoint directory → a ModelPack OCI artifact.

``build_artifact`` reads each file once (hashing files in parallel threads; hashlib releases the
GIL), validates every safetensors header strictly, infers the model config and builds the
manifest. The result is a ``PackedArtifact``, a read-only Target, so ``pack``/``push`` are just
``copy(packed, destination)``. The steps live in their own modules (``file_discovery``,
``reshard``, ``model_config``, ``packed_artifact``); the names callers use are re-exported here.
"""

from __future__ import annotations

import os
import re
from concurrent.futures import ThreadPoolExecutor

from modelpack.errors import PackError, SafetensorsError
from modelpack.mediatypes import LayerKind
from modelpack.oci.digest import Digest, sha256_fileobj
from modelpack.packing.file_discovery import OTHER_FILE_CHOICES, classify, discover_files, pickle_warning
from modelpack.packing.file_metadata import file_identity, file_mode
from modelpack.packing.model_config import (
    MAX_CONFIG_JSON,
    describe_model,
    format_param_size,
    parse_checkpoint_json,
)
from modelpack.packing.opened_input import InputFile, close_all, open_beneath
from modelpack.packing.packed_artifact import PackedArtifact, PackedFile, PackOptions
from modelpack.packing.reshard import reshard
from modelpack.packing.safetensors_format import SafetensorsHeader, read_header, read_header_from
from modelpack.packing.sharded_state import describe_sharded_state
from modelpack.packing.staging_area import make_staging_dir, remove_staging_dir
from modelpack.progress import Progress

_NAME_RE = re.compile(r"[^A-Za-z0-9._-]+")


def build_artifact(
    checkpoint_dir: str, opts: PackOptions | None = None, *, staging_parent: str | None = None
) -> PackedArtifact:
    """Validate, (re-shard,) hash and describe a checkpoint. Nothing is written except shards.

    Every file is opened once (``opened_input.open_beneath``: no link leaving the checkpoint is
    followed, only regular files) and read only through that descriptor afterwards."""
    opts = opts or PackOptions()
    opts.check(OTHER_FILE_CHOICES)
    root = os.path.realpath(checkpoint_dir)
    skipped: list[str] = []
    files = discover_files(root, opts.include, opts.exclude, skipped=skipped)
    inputs = open_inputs(root, files)
    staging: str | None = None
    try:
        headers, checked = _read_headers(files, inputs)
        if opts.max_file_size:
            if opts.max_file_size < 1024 * 1024:
                raise PackError("--max-file-size must be at least 1 MiB")
            if any(h.file_size > opts.max_file_size for h in headers.values()):
                staging = make_staging_dir("reshard", staging_parent)
        if staging is not None:
            before = dict(inputs)
            files = reshard(
                files, headers, opts.max_file_size or 0, staging, source=lambda rel: before[rel].open()
            )
            kept = {rel for rel, full in files if rel in before and before[rel].shown == full}
            inputs = {rel: before[rel] for rel in kept}
            close_all([f for rel, f in before.items() if rel not in kept])
            for rel, full in files:
                if rel not in inputs:  # a shard or the index this process just wrote
                    inputs[rel] = open_beneath(staging, rel, shown=full)
            headers, checked = _read_headers(files, inputs)
        # a broken sharded_state checkpoint is refused before hours of hashing, not after
        describe_sharded_state([rel for rel, _ in files], headers, where=root)
        kinds: list[tuple[str, str, LayerKind, bool]] = []
        for rel, full in files:
            kind, untested = classify(rel, opts.other_files)
            if kind is None:
                raise PackError(f"{full}: not a recognised model file and --other-files=refuse")
            kinds.append((rel, full, kind, untested))
        total = sum(inputs[rel].size for rel, _, _, _ in kinds)
        jobs = opts.jobs or (os.cpu_count() or 2)
        with Progress(total, "hash", opts.progress) as prog:

            def hash_one(item: tuple[str, str, LayerKind, bool]) -> PackedFile:
                rel, full, kind, untested = item
                source = inputs[rel]
                digest, size, st = hash_input(source)
                prog.update(size)
                identity = file_identity(st)
                if rel in checked and checked[rel] != identity:
                    # the header validated (and described in the config) is not this file's
                    raise PackError(
                        f"{full}: changed after its safetensors header was checked; "
                        "pack again once nothing writes to the checkpoint"
                    )
                return PackedFile(
                    rel,
                    full,
                    kind,
                    untested,
                    size,
                    digest,
                    file_mode(st.st_mode),
                    identity=identity,
                    source=source,
                )

            # Largest files first so the two cores finish together.
            order = sorted(range(len(kinds)), key=lambda i: -inputs[kinds[i][0]].size)
            with ThreadPoolExecutor(max_workers=max(1, min(jobs, len(kinds)))) as pool:
                hashed = dict(zip(order, pool.map(hash_one, [kinds[i] for i in order]), strict=True))
        packed = [hashed[i] for i in range(len(kinds))]
        hf_config = None
        for f in packed:
            if f.relpath == "config.json":
                doc = read_json_input(inputs[f.relpath])
                hf_config = doc if isinstance(doc, dict) else None
        default_name = _NAME_RE.sub("-", os.path.basename(root)) or "model"
        spec, config_bytes, manifest = describe_model(packed, headers, hf_config, opts, default_name)
        return PackedArtifact(
            manifest,
            spec,
            config_bytes,
            packed,
            staging_dir=staging,
            name=f"dir:{root}",
            skipped=skipped,
            warnings=[w for w in map(pickle_warning, (f.relpath for f in packed)) if w],
        )
    except BaseException:
        close_all(inputs)
        remove_staging_dir(staging)
        raise


def open_inputs(root: str, files: list[tuple[str, str]]) -> dict[str, InputFile]:
    """Each discovered file opened once beneath ``root`` (links followed only inside it)."""
    inputs: dict[str, InputFile] = {}
    try:
        for rel, _ in files:
            inputs[rel] = open_beneath(root, rel, link_roots=[root], shown=os.path.join(root, rel))
    except BaseException:
        close_all(inputs)
        raise
    return inputs


def read_json_input(source: InputFile, limit: int = MAX_CONFIG_JSON) -> object:
    """config.json read from its open descriptor, bounded."""
    return parse_checkpoint_json(source.read_all(limit + 1), source.shown, limit)


def _read_headers(
    files: list[tuple[str, str]], inputs: dict[str, InputFile]
) -> tuple[dict[str, SafetensorsHeader], dict[str, tuple[int, ...]]]:
    """Every safetensors header, strictly parsed from the open file, with the identity of that
    file (taken first: a file rewritten before the read is then a mismatch at hashing too)."""
    headers: dict[str, SafetensorsHeader] = {}
    checked: dict[str, tuple[int, ...]] = {}
    for rel, _ in files:
        if rel.endswith(".safetensors"):
            headers[rel], checked[rel] = read_input_header(inputs[rel])
    return headers, checked


def read_input_header(source: InputFile) -> tuple[SafetensorsHeader, tuple[int, ...]]:
    """The strictly parsed safetensors header of an open input, and its identity before the read."""
    identity = source.now()
    with source.open() as f:
        return read_header_from(f, source.shown, identity[2]), identity


def hash_input(source: InputFile) -> tuple[Digest, int, os.stat_result]:
    """Digest, size and stat of an open input, refused if it changed while it was read: its stat
    before the first byte must still hold after the last, be the file that was opened, and the
    bytes read must be its size."""
    before = os.fstat(source.fd)
    with source.raw() as f:
        digest, size = sha256_fileobj(f)
    after = os.fstat(source.fd)
    if not (
        file_identity(before) == file_identity(after)
        and file_identity(before)[:2] == source.identity[:2]
        and size == before.st_size
    ):
        raise PackError(
            f"{source.shown}: changed while it was hashed (read {size} bytes of a {before.st_size}-byte "
            f"file, now {after.st_size} bytes); pack again once nothing writes to the checkpoint"
        )
    return digest, size, before


def hash_file(path: str) -> tuple[Digest, int, os.stat_result]:
    """Digest, size and stat of one file, refused if it changed while it was read: the stat taken
    before the first byte must still hold after the last, and the bytes read must be its size."""
    try:
        with open(path, "rb", buffering=0) as f:
            before = os.fstat(f.fileno())
            digest, size = sha256_fileobj(f)
            after = os.fstat(f.fileno())
            now = os.stat(path)  # the path may have been given to another file meanwhile
    except OSError as exc:
        if exc.filename is None:
            raise OSError(exc.errno, exc.strerror or str(exc), path) from exc
        raise
    if not (file_identity(before) == file_identity(after) == file_identity(now) and size == before.st_size):
        raise PackError(
            f"{path}: changed while it was hashed (read {size} bytes of a {before.st_size}-byte file, "
            f"now {now.st_size} bytes); pack again once nothing writes to the checkpoint"
        )
    return digest, size, before


def checkpoint_headers(artifact: PackedArtifact) -> dict[str, SafetensorsHeader]:
    return {
        f.relpath: read_input_header(f.source)[0] if f.source is not None else read_header(f.path)
        for f in artifact.files
        if f.relpath.endswith(".safetensors")
    }


__all__ = [
    "OTHER_FILE_CHOICES",
    "PackOptions",
    "PackedArtifact",
    "PackedFile",
    "SafetensorsError",
    "build_artifact",
    "checkpoint_headers",
    "classify",
    "describe_model",
    "discover_files",
    "format_param_size",
    "hash_file",
    "hash_input",
    "open_inputs",
    "read_input_header",
    "reshard",
]
