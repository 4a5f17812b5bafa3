"""Pack an explicit list of files, each with the layer kind already chosen.

``build_artifact`` discovers a directory's files and classifies them by name; a Modelfile names
each file's kind itself (``MODEL``, ``CONFIG``, ``DOC``…) and a Hugging Face snapshot lists files
whose bytes live elsewhere (the cache's ``blobs/``). Both come here with ``SelectedFile`` rows, and
the result is the same ``PackedArtifact`` a directory pack gives: every safetensors header checked
strictly, every file hashed (what is packed is always what was hashed), the config and manifest
described by ``model_config.describe_model``.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from modelpack.errors import PackError
from modelpack.file_selection import matches_pattern
from modelpack.mediatypes import LayerKind
from modelpack.packing.file_metadata import file_identity, file_mode
from modelpack.packing.model_config import describe_model
from modelpack.packing.opened_input import InputFile, close_all, open_beneath
from modelpack.packing.packed_artifact import PackedArtifact, PackedFile, PackOptions
from modelpack.packing.packer import hash_input, read_input_header, read_json_input
from modelpack.packing.safetensors_format import SafetensorsHeader
from modelpack.progress import Progress


@dataclass(frozen=True)
class SelectedFile:
    """One file to pack: its path in the artifact, where its bytes are, and its layer kind."""

    relpath: str
    path: str  # absolute path of the bytes (already checked by the caller to be where it may read)
    kind: LayerKind
    untested: bool = False
    #: permission bits to record; None: the file's own (a Hugging Face blob's depend on the umask
    #: of whoever downloaded it, so that source records 0644 to pack the same digest everywhere)
    mode: int | None = None
    #: the file as the source opened it (``opened_input.open_beneath``); every byte is read from it
    source: InputFile | None = None


def build_selected_artifact(
    selected: list[SelectedFile], opts: PackOptions, *, default_name: str, name: str
) -> PackedArtifact:
    """Validate, hash and describe ``selected`` (sorted here by path parts, as a directory pack)."""
    if not selected:
        raise PackError(f"{name}: no files to pack")
    files = sorted(selected, key=lambda f: f.relpath.split("/"))
    seen: set[str] = set()
    for f in files:
        if f.relpath in seen:
            raise PackError(f"{name}: {f.relpath} is selected twice")
        seen.add(f.relpath)
    sources = {f.relpath: f.source or _open_plain(f) for f in files}
    try:
        headers: dict[str, SafetensorsHeader] = {}
        checked: dict[str, tuple[int, ...]] = {}
        for f in files:
            if f.kind is LayerKind.WEIGHT and f.relpath.endswith(".safetensors"):
                headers[f.relpath], checked[f.relpath] = read_input_header(sources[f.relpath])
        total = sum(src.size for src in sources.values())
        jobs = opts.jobs or (os.cpu_count() or 2)
        with Progress(total, "hash", opts.progress) as prog:

            def hash_one(f: SelectedFile) -> PackedFile:
                source = sources[f.relpath]
                digest, size, st = hash_input(source)
                prog.update(size)
                identity = file_identity(st)
                if f.relpath in checked and checked[f.relpath] != identity:
                    raise PackError(f"{f.path}: changed after its safetensors header was checked; pack again")
                return PackedFile(
                    f.relpath,
                    f.path,
                    f.kind,
                    f.untested,
                    size,
                    digest,
                    file_mode(st.st_mode) if f.mode is None else f.mode,
                    identity=identity,
                    source=source,
                )

            with ThreadPoolExecutor(max_workers=max(1, min(jobs, len(files)))) as pool:
                packed = list(pool.map(hash_one, files))
        hf_config = None
        for p in packed:
            if p.relpath == "config.json":
                doc = read_json_input(sources[p.relpath])
                hf_config = doc if isinstance(doc, dict) else None
    except BaseException:
        close_all(sources)
        raise
    spec, config_bytes, manifest = describe_model(packed, headers, hf_config, opts, default_name)
    return PackedArtifact(manifest, spec, config_bytes, packed, name=name)


def _open_plain(f: SelectedFile) -> InputFile:
    """A selected file that came without a descriptor: opened now, following no link."""
    return open_beneath(os.path.dirname(f.path), os.path.basename(f.path), shown=f.path)


def filter_selected(selected: list[SelectedFile], opts: PackOptions) -> list[SelectedFile]:
    """The files ``opts.include`` / ``opts.exclude`` keep, as a directory pack filters them."""
    include, exclude = list(opts.include), list(opts.exclude)
    return [
        s
        for s in selected
        if (not include or matches_pattern(s.relpath, include))
        and not (exclude and matches_pattern(s.relpath, exclude))
    ]


__all__ = ["SelectedFile", "build_selected_artifact", "filter_selected"]
