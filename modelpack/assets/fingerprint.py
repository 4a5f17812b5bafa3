"""The environment fingerprint a runtime asset was built under, and the exact-match rule for reuse.

A compile cache holds machine code and pickled graphs that are valid only for the weights, the
numeric layout, the sharding and the software and hardware that produced them. Reusing one built
elsewhere is either a silent wrong answer (other weights, other dtype), a crash (an instruction
the CPU lacks, a cubin for another GPU architecture) or a wasted download (other versions miss
anyway). So the fingerprint names every one of those, its identity is sha256 over its canonical
JSON, and the comparison FAILS CLOSED: a field that is empty on either side is a mismatch, never
a wildcard; every differing field is named so a refusal can be acted upon.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from modelpack.boundedjson import loads
from modelpack.errors import AssetFingerprintError, DocumentError
from modelpack.files import atomic_write_bytes
from modelpack.oci.descriptor import canonical_json

ASSET_FORMAT_VERSION = "modelpack-assets/1"
MAX_FINGERPRINT_BYTES = 64 * 1024
#: What a field holds when the thing it describes is absent here (no GPU, no Triton, no vLLM):
#: a value, not an empty string, so two CPU machines can match while "unknown" never does.
ABSENT = "none"


@dataclass(frozen=True)
class EnvironmentFingerprint:
    """Why each field is here: docs/assets.md ("The fingerprint")."""

    manifest_digest: str  # the model manifest the cache was compiled for
    device_kind: str  # cpu | cuda | rocm
    device_arch: str  # "sm_90" on CUDA; "x86_64;torch=AVX512;isa=avx,avx2,…" on CPU
    driver_version: str  # NVIDIA kernel driver, e.g. "550.54.15"; "none" on CPU
    cuda_version: str  # CUDA (or HIP) runtime torch was built with; "none" on CPU
    torch_version: str  # torch.__version__ incl. the local build tag ("2.13.0+cpu")
    triton_version: str  # "none" when Triton is not installed
    vllm_version: str  # "none" when vLLM is not installed
    python_version: str  # "cpython-3.11": pickled entries and generated modules are per interpreter
    dtype: str  # safetensors dtype code(s) the engine computes in, e.g. "BF16" or "BF16,F32"
    quantization: str  # from the model config ("none" when it declares none) or the engine's
    tp_size: int
    rank_layout: str  # sha256 over every rank's {tensor: [rule, shard shape]} (loader's layout)
    format_version: str = ASSET_FORMAT_VERSION

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def digest(self) -> str:
        return "sha256:" + hashlib.sha256(canonical_json(self.to_dict())).hexdigest()

    def replace(self, **changes: Any) -> EnvironmentFingerprint:
        doc = self.to_dict()
        doc.update(changes)
        return EnvironmentFingerprint(**doc)

    def write(self, path: str | os.PathLike[str]) -> None:
        """``{"fingerprint": {…}, "digest": …}``, atomically (an init container reads it later)."""
        doc = {"fingerprint": self.to_dict(), "digest": self.digest}
        atomic_write_bytes(path, canonical_json(doc) + b"\n")

    @classmethod
    def from_dict(cls, doc: Any, *, where: str = "fingerprint") -> EnvironmentFingerprint:
        """Strict: unknown fields and wrongly typed values are errors; a missing field becomes empty
        (and then mismatches everything), so a record from an older writer is refused, not guessed."""
        if not isinstance(doc, Mapping):
            raise AssetFingerprintError(f"{where}: a fingerprint is a JSON object")
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(doc) - set(known))
        if unknown:
            raise AssetFingerprintError(f"{where}: unknown fields {unknown}")
        values: dict[str, Any] = {}
        for name in known:
            v = doc.get(name, 0 if name == "tp_size" else "")
            if name == "tp_size":
                if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                    raise AssetFingerprintError(f"{where}: tp_size must be a positive integer, got {v!r}")
            elif not isinstance(v, str):
                raise AssetFingerprintError(f"{where}: {name} must be a string, got {type(v).__name__}")
            values[name] = v
        return cls(**values)

    @classmethod
    def from_document(cls, raw: bytes, *, where: str) -> EnvironmentFingerprint:
        """A written fingerprint (``{"fingerprint": …, "digest": …}``) or a bare field mapping;
        a recorded digest must match the fields."""
        try:
            doc = loads(raw, what=where, max_bytes=MAX_FINGERPRINT_BYTES)
        except DocumentError as exc:
            raise AssetFingerprintError(str(exc)) from exc
        recorded = None
        if isinstance(doc, dict) and "fingerprint" in doc:
            extra = sorted(set(doc) - {"fingerprint", "digest"})
            if extra:
                raise AssetFingerprintError(f"{where}: unknown keys {extra}")
            recorded = doc.get("digest")
            doc = doc["fingerprint"]
        fp = cls.from_dict(doc, where=where)
        if recorded is not None and recorded != fp.digest:
            raise AssetFingerprintError(f"{where}: recorded digest {recorded!r} does not match its fields")
        return fp

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> EnvironmentFingerprint:
        p = os.fspath(path)
        try:
            with open(p, "rb") as f:
                raw = f.read(MAX_FINGERPRINT_BYTES + 1)
        except OSError as exc:
            raise AssetFingerprintError(f"{p}: cannot read the fingerprint: {exc.strerror or exc}") from exc
        return cls.from_document(raw, where=p)


Difference = tuple[str, object, object]


def _empty(v: object) -> bool:
    return v is None or v == "" or v == 0


def differences(recorded: EnvironmentFingerprint, running: EnvironmentFingerprint) -> list[Difference]:
    """(field, recorded, running) for every field that differs or is empty on either side."""
    out: list[Difference] = []
    for f in fields(EnvironmentFingerprint):
        a, b = getattr(recorded, f.name), getattr(running, f.name)
        if _empty(a) or _empty(b) or a != b:
            out.append((f.name, a, b))
    return out


def empty_fields(fp: EnvironmentFingerprint) -> list[str]:
    """Fields that can never match (a fingerprint with any is refused at push time)."""
    return [f.name for f in fields(EnvironmentFingerprint) if _empty(getattr(fp, f.name))]


def describe(diffs: list[Difference], limit: int = 6) -> str:
    """``device_arch: built for 'sm_90', running 'sm_80'; …`` for events and messages."""

    def short(v: object) -> str:
        text = repr(v)
        return text if len(text) <= 80 else text[:77] + "…'"

    parts = []
    for name, recorded, running in diffs[:limit]:
        if _empty(recorded) or _empty(running):
            parts.append(
                f"{name}: empty ({short(recorded)} vs {short(running)}; an empty field never matches)"
            )
        else:
            parts.append(f"{name}: built for {short(recorded)}, running {short(running)}")
    if len(diffs) > limit:
        parts.append(f"and {len(diffs) - limit} more")
    return "; ".join(parts)
