"""``modelpack diff``: what changed between two artifacts, down to individual tensors.

Config changes (flattened JSON paths; ``modelfs.diffIds`` is left to the file list), files
added/removed/changed (by ``org.cncf.model.filepath``), and for each changed safetensors file
the tensors added/removed/changed with dtype, shape and the sha256 of the tensor's bytes.

Headers come from range reads (``fetch_range`` + ``parse_header_bytes``: dtype/shape changes
need no data). Tensor digests come from one sequential pass over each changed blob through a
``VerifyingReader``: a tensor digest is reported only from bytes whose whole-blob digest was
checked (a range read alone cannot be), and the streamed header must equal the range-read one.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field
from typing import Any

from modelpack.boundedjson import loads
from modelpack.errors import SafetensorsError
from modelpack.mediatypes import is_model_config, layer_filepath, parse_layer_media_type
from modelpack.oci.descriptor import Descriptor, Manifest
from modelpack.oci.digest import VerifyingReader
from modelpack.oci.reference import Reference, parse_reference
from modelpack.packing.safetensors_format import SafetensorsHeader, header_length, parse_header_bytes
from modelpack.targets.base import ReadableTarget
from modelpack.targets.fetch import fetch_config, fetch_manifest
from modelpack.targets.opener import TargetOptions, open_readable

READ_CHUNK = 4 * 1024 * 1024
_SKIP_CONFIG = ("modelfs.diffIds",)


#: Configs are compared field by field (recursively): a bound keeps a hostile one from recursing deep.
MAX_CONFIG_DEPTH = 16


@dataclass
class TensorChange:
    name: str
    change: str  # added | removed | changed
    before: dict[str, Any] | None = None  # {"dtype", "shape", "digest"}
    after: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "change": self.change, "before": self.before, "after": self.after}


@dataclass
class FileChange:
    path: str
    change: str  # added | removed | changed
    before: dict[str, Any] | None = None  # {"digest", "size", "mediaType"}
    after: dict[str, Any] | None = None
    tensors: list[TensorChange] | None = None
    unchanged_tensors: int | None = None

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "path": self.path,
            "change": self.change,
            "before": self.before,
            "after": self.after,
        }
        if self.tensors is not None:
            d["tensors"] = [t.to_json() for t in self.tensors]
            d["unchangedTensors"] = self.unchanged_tensors
        return d


@dataclass
class ArtifactDiff:
    a: str
    b: str
    digest_a: str
    digest_b: str
    config: list[dict[str, Any]] = field(default_factory=list)
    files: list[FileChange] = field(default_factory=list)

    @property
    def identical(self) -> bool:
        return self.digest_a == self.digest_b

    def to_json(self) -> dict[str, Any]:
        return {
            "a": {"reference": self.a, "digest": self.digest_a},
            "b": {"reference": self.b, "digest": self.digest_b},
            "identical": self.identical,
            "config": list(self.config),
            "files": [f.to_json() for f in self.files],
        }


def _flatten(doc: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(doc, dict):
        out: dict[str, Any] = {}
        for k, v in doc.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: doc}


def _config_dict(target: ReadableTarget, manifest: Manifest) -> dict[str, Any]:
    data = fetch_config(target, manifest)
    doc = loads(data, what=f"{target.name}: config {manifest.config.digest}", max_depth=MAX_CONFIG_DEPTH)
    return doc if isinstance(doc, dict) else {"": doc}


def config_changes(before: dict[str, Any], after: dict[str, Any]) -> list[dict[str, Any]]:
    fa, fb = _flatten(before), _flatten(after)
    out = []
    for key in sorted(set(fa) | set(fb)):
        if key.startswith(_SKIP_CONFIG):
            continue
        if fa.get(key, _MISSING) != fb.get(key, _MISSING):
            out.append({"path": key, "before": fa.get(key), "after": fb.get(key)})
    return out


_MISSING = object()


def _files(manifest: Manifest) -> dict[str, Descriptor]:
    out = {}
    for i, layer in enumerate(manifest.layers, start=1):
        out[layer_filepath(layer.annotations) or f"<layer #{i}: {layer.digest}>"] = layer
    return out


def _is_safetensors(path: str, layer: Descriptor) -> bool:
    lt = parse_layer_media_type(layer.media_type)
    return path.endswith(".safetensors") and lt is not None and lt.is_raw


def read_header_range(target: ReadableTarget, layer: Descriptor, path: str) -> SafetensorsHeader:
    where = f"{path} (blob {layer.digest})"
    prefix = target.fetch_range(layer, 0, 8) if layer.size >= 8 else b""
    n = header_length(where, prefix, layer.size)
    header = target.fetch_range(layer, 8, n)
    return parse_header_bytes(path, prefix, header, layer.size)


def tensor_digests(target: ReadableTarget, layer: Descriptor, header: SafetensorsHeader) -> dict[str, str]:
    """sha256 of every tensor's bytes, from one verified sequential pass over the blob."""
    stream = target.fetch_blob(layer)
    out: dict[str, str] = {}
    try:
        reader = VerifyingReader(stream, layer.digest, layer.size, source=target.name)

        def read_exact(n: int, sink: Any) -> None:
            while n:
                data = reader.read(min(n, READ_CHUNK))
                if not data:
                    raise SafetensorsError(header.path, f"blob {layer.digest} ended early")
                sink(data)
                n -= len(data)

        head = bytearray()
        read_exact(header.data_start, head.extend)
        if struct.unpack("<Q", head[:8])[0] != header.header_size:
            raise SafetensorsError(header.path, f"blob {layer.digest}: header changed between reads")
        expected_head = bytes(head)
        for t in header.tensors:
            h = hashlib.sha256()
            read_exact(t.nbytes, h.update)
            out[t.name] = "sha256:" + h.hexdigest()
        if reader.read(1):
            raise SafetensorsError(header.path, f"blob {layer.digest}: bytes after the last tensor")
        # EOF reached: VerifyingReader checked size and digest; compare the header we parsed
        reparsed = parse_header_bytes(header.path, expected_head[:8], expected_head[8:], layer.size)
        if reparsed != header:
            raise SafetensorsError(header.path, f"blob {layer.digest}: header differs from the range read")
    finally:
        stream.close()
    return out


def tensor_changes(
    target_a: ReadableTarget,
    layer_a: Descriptor,
    target_b: ReadableTarget,
    layer_b: Descriptor,
    path: str,
) -> tuple[list[TensorChange], int]:
    ha = read_header_range(target_a, layer_a, path)
    hb = read_header_range(target_b, layer_b, path)
    da = tensor_digests(target_a, layer_a, ha)
    db = tensor_digests(target_b, layer_b, hb)
    ta, tb = ha.by_name(), hb.by_name()

    def info(t: Any, digests: dict[str, str]) -> dict[str, Any]:
        return {"dtype": t.dtype, "shape": list(t.shape), "digest": digests[t.name]}

    changes = []
    unchanged = 0
    for name in sorted(set(ta) | set(tb)):
        if name not in tb:
            changes.append(TensorChange(name, "removed", before=info(ta[name], da)))
        elif name not in ta:
            changes.append(TensorChange(name, "added", after=info(tb[name], db)))
        else:
            before, after = info(ta[name], da), info(tb[name], db)
            if before != after:
                changes.append(TensorChange(name, "changed", before, after))
            else:
                unchanged += 1
    return changes, unchanged


def _layer_info(layer: Descriptor) -> dict[str, Any]:
    return {"digest": str(layer.digest), "size": layer.size, "mediaType": layer.media_type}


def diff_targets(
    target_a: ReadableTarget,
    ident_a: str,
    target_b: ReadableTarget,
    ident_b: str,
    *,
    name_a: str = "",
    name_b: str = "",
    tensors: bool = True,
) -> ArtifactDiff:
    ma, digest_a = fetch_manifest(target_a, ident_a)
    mb, digest_b = fetch_manifest(target_b, ident_b)
    result = ArtifactDiff(name_a or ident_a, name_b or ident_b, digest_a, digest_b)
    if digest_a == digest_b:
        return result
    if ma.config.digest != mb.config.digest:
        ca = _config_dict(target_a, ma) if is_model_config(ma.config.media_type) else {}
        cb = _config_dict(target_b, mb) if is_model_config(mb.config.media_type) else {}
        result.config = config_changes(ca, cb)
        if ma.config.media_type != mb.config.media_type:
            result.config.insert(
                0, {"path": "<mediaType>", "before": ma.config.media_type, "after": mb.config.media_type}
            )
    fa, fb = _files(ma), _files(mb)
    for path in sorted(set(fa) | set(fb)):
        if path not in fb:
            result.files.append(FileChange(path, "removed", before=_layer_info(fa[path])))
        elif path not in fa:
            result.files.append(FileChange(path, "added", after=_layer_info(fb[path])))
        else:
            la, lb = fa[path], fb[path]
            if la.digest == lb.digest and la.media_type == lb.media_type:
                continue
            fc = FileChange(path, "changed", _layer_info(la), _layer_info(lb))
            if tensors and la.digest != lb.digest and _is_safetensors(path, la) and _is_safetensors(path, lb):
                fc.tensors, fc.unchanged_tensors = tensor_changes(target_a, la, target_b, lb, path)
            result.files.append(fc)
    return result


def diff(
    ref_a: str | Reference,
    ref_b: str | Reference,
    target_options: TargetOptions | None = None,
    *,
    tensors: bool = True,
) -> ArtifactDiff:
    a = parse_reference(ref_a) if isinstance(ref_a, str) else ref_a
    b = parse_reference(ref_b) if isinstance(ref_b, str) else ref_b
    ta = open_readable(a, target_options)
    tb = open_readable(b, target_options)
    return diff_targets(ta, a.identifier, tb, b.identifier, name_a=str(a), name_b=str(b), tensors=tensors)
