"""Compatibility fingerprint: refuse weights a compiled cache (or the caller) was not built for.

A compiled engine cache (CUDA graphs, TensorRT plans, torch.compile artefacts) is only valid for
the exact weights, dtype/quantization, tensor-parallel layout, device architecture and loader
format it was built from. The fingerprint records those fields; its identity is sha256 over the
canonical JSON. Comparison FAILS CLOSED: a field that is empty or missing on either side is a
mismatch, never a wildcard (ModelExpress treats an empty field as "matches anything", which
quietly serves a cache built for other weights). Every differing field is named in the error.
"""

from __future__ import annotations

import hashlib
import os
import platform
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from modelpack import boundedjson
from modelpack.errors import DocumentError, FingerprintFileError, FingerprintMismatchError
from modelpack.files import atomic_write_bytes
from modelpack.oci.descriptor import canonical_json

LOADER_FORMAT_VERSION = "modelpack-loader/1"
FINGERPRINT_FILE = "modelpack.fingerprint.json"
MAX_FINGERPRINT_BYTES = 64 * 1024


@dataclass(frozen=True)
class Fingerprint:
    manifest_digest: str
    dtype: str  # sorted safetensors dtypes of the tensors loaded, e.g. "BF16" or "BF16,F32"
    quantization: str  # from the model config; "none" when the model declares none
    tp_size: int
    tp_rank: int
    rank_layout: str  # sha256 of {tensor: [rule, shard shape]} for this rank
    device_arch: str  # "cpu-x86_64", "cuda-sm_90-NVIDIA H200", …
    loader_format_version: str = LOADER_FORMAT_VERSION

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def digest(self) -> str:
        return "sha256:" + hashlib.sha256(canonical_json(self.to_dict())).hexdigest()

    def write(self, path: str) -> None:
        """Record next to a compiled cache (atomic: never a half-written fingerprint)."""
        doc = {"fingerprint": self.to_dict(), "digest": self.digest}
        atomic_write_bytes(path, canonical_json(doc) + b"\n")

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any], *, where: str = "fingerprint") -> Fingerprint:
        """Build from a mapping; missing fields become empty and will fail the comparison."""
        if not isinstance(doc, Mapping):
            raise FingerprintFileError(f"{where}: must be a JSON object")
        unknown = set(doc) - {f.name for f in fields(cls)}
        if unknown:
            raise FingerprintFileError(f"{where}: unknown fields {sorted(unknown)}")
        values: dict[str, Any] = {}
        for f in fields(cls):
            v = doc.get(f.name, "")
            values[f.name] = v
        return cls(**values)

    @classmethod
    def read(cls, path: str) -> Fingerprint:
        try:
            with open(path, "rb") as f:
                raw = f.read(MAX_FINGERPRINT_BYTES + 1)
        except OSError as exc:
            raise FingerprintFileError(
                f"{path}: cannot read the recorded fingerprint: {exc.strerror}"
            ) from exc
        if len(raw) > MAX_FINGERPRINT_BYTES:
            raise FingerprintFileError(f"{path}: larger than {MAX_FINGERPRINT_BYTES} bytes")
        try:
            doc = boundedjson.loads(raw, what=path, max_bytes=MAX_FINGERPRINT_BYTES)
        except DocumentError as exc:
            raise FingerprintFileError(f"{path}: not valid JSON: {exc.reason}") from exc
        if not isinstance(doc, dict) or not isinstance(doc.get("fingerprint"), dict):
            raise FingerprintFileError(f"{path}: expected {{'fingerprint': {{…}}, 'digest': …}}")
        fp = cls.from_dict(doc["fingerprint"], where=path)
        if doc.get("digest") != fp.digest:
            raise FingerprintFileError(
                f"{path}: recorded digest {doc.get('digest')!r} does not match its fields"
            )
        return fp


def _empty(v: object) -> bool:
    return v is None or v == "" or (isinstance(v, (list, dict, tuple)) and not v)


def compare(expected: Fingerprint, actual: Fingerprint) -> list[tuple[str, object, object]]:
    """Every field that differs — or is empty on either side (fail closed)."""
    out = []
    for f in fields(Fingerprint):
        e, a = getattr(expected, f.name), getattr(actual, f.name)
        if _empty(e) or _empty(a) or e != a:
            out.append((f.name, e, a))
    return out


FingerprintLike = Fingerprint | Mapping[str, Any] | str | os.PathLike[str]


def check_fingerprint(expected: FingerprintLike, actual: Fingerprint) -> None:
    """Raise ``FingerprintMismatchError`` naming each differing field.

    ``expected`` is a Fingerprint, a mapping of its fields, a ``sha256:`` digest of one (then the
    fields cannot be named, only the digest), or the path of a recorded fingerprint file.
    """
    where = ""
    if isinstance(expected, str) and expected.startswith("sha256:"):
        if expected != actual.digest:
            raise FingerprintMismatchError([("digest", expected, actual.digest)])
        return
    if isinstance(expected, (str, os.PathLike)):
        where = os.fspath(expected)
        expected = Fingerprint.read(where)
    elif isinstance(expected, Mapping):
        expected = Fingerprint.from_dict(expected)
    diffs = compare(expected, actual)
    if diffs:
        raise FingerprintMismatchError(diffs, where=where)


def device_arch(device: Any) -> str:
    """``cuda-sm_<major><minor>-<name>`` for a GPU, ``cpu-<machine>`` otherwise."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        return f"cuda-sm_{major}{minor}-{torch.cuda.get_device_name(index)}"
    return f"{dev.type}-{platform.machine() or 'unknown'}"


def rank_layout_digest(layout: Mapping[str, tuple[str, tuple[int, ...]]]) -> str:
    doc = {name: [rule, list(shape)] for name, (rule, shape) in sorted(layout.items())}
    return "sha256:" + hashlib.sha256(canonical_json(doc)).hexdigest()
