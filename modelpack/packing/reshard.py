"""Re-shard oversized safetensors files at tensor boundaries (``--max-file-size``).

Registries and object stores cap blob sizes; splitting between tensors keeps every shard a valid
safetensors file with the same tensor bytes, so loaders need nothing but the regenerated index.
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Callable
from typing import Any, BinaryIO

from modelpack.errors import PackError
from modelpack.packing.file_metadata import file_mode
from modelpack.packing.safetensors_format import SafetensorsHeader, build_header


def _shard_name(stem: str, i: int, n: int) -> str:
    return f"{stem}-{i:05d}-of-{n:05d}.safetensors"


def _copy_range(src: BinaryIO, dst: BinaryIO, offset: int, length: int) -> None:
    src_fd, dst_fd = src.fileno(), dst.fileno()
    remaining = length
    pos = offset
    try:
        while remaining > 0:
            n = os.copy_file_range(src_fd, dst_fd, remaining, pos)
            if n == 0:
                raise PackError(f"unexpected end of file while re-sharding at offset {pos}")
            pos += n
            remaining -= n
        return
    except OSError:
        pass
    buf = bytearray(8 * 1024 * 1024)
    while remaining > 0:
        n = os.preadv(src_fd, [memoryview(buf)[: min(len(buf), remaining)]], pos)
        if n <= 0:
            raise PackError(f"unexpected end of file while re-sharding at offset {pos}")
        dst.write(memoryview(buf)[:n])
        pos += n
        remaining -= n


def reshard(
    files: list[tuple[str, str]],
    headers: dict[str, SafetensorsHeader],
    max_size: int,
    staging: str,
    source: Callable[[str], BinaryIO] | None = None,
) -> list[tuple[str, str]]:
    """Split safetensors files larger than ``max_size`` at tensor boundaries.

    Writes valid safetensors shards (same tensor bytes, same ``__metadata__``) and a regenerated
    ``model.safetensors.index.json`` mapping every tensor to its new file. A single tensor larger
    than ``max_size`` gets a shard of its own (tensors are never split). ``source(relpath)``
    opens a file's bytes (the pack's open descriptor); None: by its path.
    """
    oversized = [rel for rel, _ in files if rel in headers and headers[rel].file_size > max_size]
    if not oversized:
        return files
    result: list[tuple[str, str]] = []
    weight_map: dict[str, str] = {}
    total_size = 0
    index_rel: str | None = None
    for rel, full in files:
        if rel.endswith(".safetensors.index.json"):
            index_rel = rel
            continue
        hdr = headers.get(rel)
        if hdr is None:
            result.append((rel, full))
            continue
        total_size += sum(t.nbytes for t in hdr.tensors)
        if rel not in oversized:
            result.append((rel, full))
            for t in hdr.tensors:
                weight_map[t.name] = os.path.basename(rel)
            continue
        # A shard's size is its data plus its header; bound each header entry generously
        # (name + dtype/shape/offsets JSON) so every shard stays under max_size.
        meta_bytes = 64 + len(json.dumps(hdr.metadata or {}))
        groups: list[list[Any]] = [[]]
        size = meta_bytes
        for t in hdr.tensors:
            entry = t.nbytes + len(t.name.encode()) + 96 + 24 * len(t.shape)
            if groups[-1] and size + entry > max_size:
                groups.append([])
                size = meta_bytes
            groups[-1].append(t)
            size += entry
        directory = os.path.dirname(rel)
        stem = os.path.basename(rel)[: -len(".safetensors")]
        with source(rel) if source is not None else open(full, "rb") as src:
            for i, group in enumerate(groups, 1):
                shard_rel = (directory + "/" if directory else "") + _shard_name(stem, i, len(groups))
                prefix, _ = build_header(
                    ((t.name, t.dtype, t.shape, t.nbytes) for t in group), hdr.metadata or None
                )
                out_path = os.path.join(staging, shard_rel)
                try:
                    os.makedirs(os.path.dirname(out_path), exist_ok=True)
                    with open(out_path, "wb") as dst:
                        dst.write(prefix)
                        dst.flush()
                        # tensors are contiguous in offset order, so each group is one range
                        first, last = group[0], group[-1]
                        _copy_range(src, dst, hdr.data_start + first.begin, last.end - first.begin)
                    os.chmod(out_path, file_mode(os.fstat(src.fileno()).st_mode))  # a shard keeps the mode
                except OSError as exc:
                    raise staging_write_error(out_path, exc) from exc
                for t in group:
                    weight_map[t.name] = os.path.basename(shard_rel)
                result.append((shard_rel, out_path))
    index_doc = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    index_rel = index_rel or "model.safetensors.index.json"
    index_path = os.path.join(staging, index_rel)
    try:
        os.makedirs(os.path.dirname(index_path), exist_ok=True)
        with open(index_path, "w") as f:
            json.dump(index_doc, f, indent=2, sort_keys=True)
            f.write("\n")
    except OSError as exc:
        raise staging_write_error(index_path, exc) from exc
    result.append((index_rel, index_path))
    result.sort(key=lambda x: x[0].split("/"))
    return result


def staging_write_error(path: str, exc: OSError) -> PackError:
    """A write into the staging directory failed: name the file (a full disk's ``write()`` error
    carries no path) and say where the space is needed."""
    hint = "; free space on that filesystem and pack again" if exc.errno == errno.ENOSPC else ""
    return PackError(f"{path}: cannot write: {exc.strerror or exc}{hint}")


__all__ = ["reshard", "staging_write_error"]
