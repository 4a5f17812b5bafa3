"""OCI descriptors, manifests and indexes that keep the exact bytes they came from.

A manifest's digest is what gets signed and pinned, so a manifest we did not build is never
re-serialised: ``Manifest.raw`` is the authority and the parsed fields are a view of it. Parsing
is bounded (size, depth, no duplicate keys: ``modelpack.boundedjson``) and every field a caller
reads later is type-checked here, so a hostile registry's document is a ``ManifestError`` naming
its digest, never a ``RecursionError`` or an ``AttributeError`` three modules further on.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from modelpack.boundedjson import loads_object
from modelpack.errors import DocumentError, ManifestError
from modelpack.mediatypes import (
    MEDIA_TYPE_DOCKER_MANIFEST,
    MEDIA_TYPE_DOCKER_MANIFEST_LIST,
    MEDIA_TYPE_OCI_INDEX,
    MEDIA_TYPE_OCI_MANIFEST,
)
from modelpack.oci.digest import Digest

MAX_MANIFEST_BYTES = 4 * 1024 * 1024
#: Manifests nest 4 levels (manifest → layers → descriptor → annotations/platform); slack for
#: platform features and extensions, far below what could exhaust the parser.
MAX_MANIFEST_DEPTH = 16
MAX_LAYERS = 100_000
MAX_ANNOTATION_BYTES = 1024 * 1024
#: OCI descriptors' size is an int64.
MAX_SIZE = 2**63 - 1


def canonical_json(doc: Any) -> bytes:
    """The byte form we write for documents we build: sorted keys, no spaces, UTF-8."""
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


@dataclass(frozen=True)
class Descriptor:
    media_type: str
    digest: Digest
    size: int
    annotations: Mapping[str, str] | None = None
    artifact_type: str | None = None
    platform: Mapping[str, Any] | None = None
    data: str | None = None
    urls: tuple[str, ...] | None = None

    def reference_only(self) -> Descriptor:
        """Just what names the content (type, digest, size, artifact type): what an index entry
        or a tag should carry, without another entry's annotations."""
        return Descriptor(self.media_type, self.digest, self.size, artifact_type=self.artifact_type)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"mediaType": self.media_type, "digest": str(self.digest), "size": self.size}
        if self.artifact_type:
            d["artifactType"] = self.artifact_type
        if self.annotations:
            d["annotations"] = dict(self.annotations)
        if self.platform:
            d["platform"] = dict(self.platform)
        if self.data is not None:
            d["data"] = self.data
        if self.urls:
            d["urls"] = list(self.urls)
        return d

    @classmethod
    def from_dict(cls, d: Any, *, where: str = "descriptor") -> Descriptor:
        if not isinstance(d, dict):
            raise ManifestError(f"{where}: must be an object")
        try:
            media_type = d["mediaType"]
            digest = Digest(d["digest"])
            size = d["size"]
        except KeyError as exc:
            raise ManifestError(f"{where}: missing {exc.args[0]!r}") from exc
        except ValueError as exc:
            raise ManifestError(f"{where}: {exc}") from exc
        if not isinstance(media_type, str) or not media_type:
            raise ManifestError(f"{where}: mediaType must be a non-empty string")
        if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= MAX_SIZE:
            raise ManifestError(f"{where}: size must be an integer in [0, 2^63), got {_clip(size)}")
        annotations = _annotations(d.get("annotations"), where)
        artifact_type = _optional_str(d, "artifactType", where)
        data = _optional_str(d, "data", where)
        platform = d.get("platform")
        if platform is not None and not isinstance(platform, dict):
            raise ManifestError(f"{where}: platform must be an object")
        urls = d.get("urls")
        if urls is not None and (not isinstance(urls, list) or not all(isinstance(u, str) for u in urls)):
            raise ManifestError(f"{where}: urls must be an array of strings")
        return cls(
            media_type=media_type,
            digest=digest,
            size=size,
            annotations=annotations,
            artifact_type=artifact_type,
            platform=platform,
            data=data,
            urls=tuple(urls) if urls is not None else None,
        )


def _clip(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _optional_str(doc: dict[str, Any], key: str, where: str) -> str | None:
    value = doc.get(key)
    if value is not None and not isinstance(value, str):
        raise ManifestError(f"{where}: {key} must be a string, got {_clip(value)}")
    return value


def _annotations(value: Any, where: str) -> dict[str, str] | None:
    if value is None:
        return None
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise ManifestError(f"{where}: annotations must map strings to strings")
    return value


def _subject(doc: dict[str, Any], where: str) -> Descriptor | None:
    value = doc.get("subject")
    return Descriptor.from_dict(value, where=f"{where} subject") if value is not None else None


def _parse_json_document(raw: bytes, kind: str) -> tuple[dict[str, Any], str]:
    """The document as a JSON object and its name for messages (``manifest sha256:…``: the digest
    is what was pinned, signed and can be looked up), or a ManifestError with that name."""
    if not isinstance(raw, (bytes, bytearray, memoryview)):
        raise ManifestError(f"{kind}: expected bytes, got {type(raw).__name__}")
    if len(raw) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"{kind} is {len(raw)} bytes; the limit is {MAX_MANIFEST_BYTES} (4 MiB)")
    what = f"{kind} {Digest.from_bytes(bytes(raw))}"
    try:
        return loads_object(raw, what=what, max_depth=MAX_MANIFEST_DEPTH), what
    except DocumentError as exc:
        raise ManifestError(str(exc)) from None


@dataclass(frozen=True)
class Manifest:
    """An image manifest (OCI or Docker schema 2). ``raw`` is the exact bytes; ``digest`` hashes them."""

    raw: bytes
    media_type: str
    config: Descriptor
    layers: tuple[Descriptor, ...]
    artifact_type: str | None = None
    subject: Descriptor | None = None
    annotations: Mapping[str, str] | None = None

    @property
    def digest(self) -> Digest:
        return Digest.from_bytes(self.raw)

    @property
    def size(self) -> int:
        return len(self.raw)

    def descriptor(self, annotations: Mapping[str, str] | None = None) -> Descriptor:
        return Descriptor(
            media_type=self.media_type,
            digest=self.digest,
            size=len(self.raw),
            annotations=annotations,
            artifact_type=self.artifact_type or self.config.media_type,
        )

    @property
    def total_size(self) -> int:
        return self.config.size + sum(layer.size for layer in self.layers)

    @classmethod
    def parse(cls, raw: bytes, *, media_type: str | None = None) -> Manifest:
        doc, what = _parse_json_document(raw, "manifest")
        declared = _optional_str(doc, "mediaType", what)
        mt = declared or media_type or MEDIA_TYPE_OCI_MANIFEST
        if mt not in (MEDIA_TYPE_OCI_MANIFEST, MEDIA_TYPE_DOCKER_MANIFEST):
            raise ManifestError(f"{what}: unsupported manifest media type {_clip(mt)}")
        if doc.get("schemaVersion") != 2:
            raise ManifestError(f"{what}: schemaVersion must be 2, got {_clip(doc.get('schemaVersion'))}")
        if "config" not in doc:
            raise ManifestError(f"{what}: no config descriptor")
        layers_doc = doc.get("layers", [])
        if not isinstance(layers_doc, list):
            raise ManifestError(f"{what}: layers must be an array")
        if len(layers_doc) > MAX_LAYERS:
            raise ManifestError(f"{what}: {len(layers_doc)} layers; the limit is {MAX_LAYERS}")
        config = Descriptor.from_dict(doc["config"], where=f"{what} config")
        layers = tuple(
            Descriptor.from_dict(x, where=f"{what} layer #{i}") for i, x in enumerate(layers_doc, start=1)
        )
        return cls(
            raw=raw,
            media_type=mt,
            config=config,
            layers=layers,
            artifact_type=_optional_str(doc, "artifactType", what),
            subject=_subject(doc, what),
            annotations=_annotations(doc.get("annotations"), what),
        )

    @classmethod
    def build(
        cls,
        config: Descriptor,
        layers: list[Descriptor],
        *,
        artifact_type: str | None = None,
        subject: Descriptor | None = None,
        annotations: Mapping[str, str] | None = None,
    ) -> Manifest:
        """Build an OCI manifest we own; its bytes are canonical JSON, so the digest is reproducible."""
        doc: dict[str, Any] = {
            "schemaVersion": 2,
            "mediaType": MEDIA_TYPE_OCI_MANIFEST,
            "config": config.to_dict(),
            "layers": [layer.to_dict() for layer in layers],
        }
        if artifact_type:
            doc["artifactType"] = artifact_type
        if subject is not None:
            doc["subject"] = subject.to_dict()
        if annotations:
            doc["annotations"] = dict(annotations)
        raw = canonical_json(doc)
        if len(raw) > MAX_MANIFEST_BYTES:
            raise ManifestError(f"manifest would be {len(raw)} bytes; registries accept at most 4 MiB")
        return cls.parse(raw)


@dataclass(frozen=True)
class Index:
    raw: bytes
    media_type: str
    manifests: tuple[Descriptor, ...]
    annotations: Mapping[str, str] | None = None
    artifact_type: str | None = None
    subject: Descriptor | None = None

    @property
    def digest(self) -> Digest:
        return Digest.from_bytes(self.raw)

    @classmethod
    def parse(cls, raw: bytes, *, media_type: str | None = None) -> Index:
        doc, what = _parse_json_document(raw, "index")
        mt = _optional_str(doc, "mediaType", what) or media_type or MEDIA_TYPE_OCI_INDEX
        if mt not in (MEDIA_TYPE_OCI_INDEX, MEDIA_TYPE_DOCKER_MANIFEST_LIST):
            raise ManifestError(f"{what}: unsupported index media type {_clip(mt)}")
        entries = doc.get("manifests", [])
        if not isinstance(entries, list):
            raise ManifestError(f"{what}: manifests must be an array")
        if len(entries) > MAX_LAYERS:
            raise ManifestError(f"{what}: {len(entries)} entries; the limit is {MAX_LAYERS}")
        return cls(
            raw=raw,
            media_type=mt,
            manifests=tuple(
                Descriptor.from_dict(x, where=f"{what} entry #{i}") for i, x in enumerate(entries, start=1)
            ),
            annotations=_annotations(doc.get("annotations"), what),
            artifact_type=_optional_str(doc, "artifactType", what),
            subject=_subject(doc, what),
        )

    @classmethod
    def build(
        cls,
        manifests: list[Descriptor],
        *,
        annotations: Mapping[str, str] | None = None,
        artifact_type: str | None = None,
    ) -> Index:
        doc: dict[str, Any] = {
            "schemaVersion": 2,
            "mediaType": MEDIA_TYPE_OCI_INDEX,
            "manifests": [m.to_dict() for m in manifests],
        }
        if artifact_type:
            doc["artifactType"] = artifact_type
        if annotations:
            doc["annotations"] = dict(annotations)
        return cls.parse(canonical_json(doc))


def parse_manifest_or_index(raw: bytes, media_type: str | None = None) -> Manifest | Index:
    doc, what = _parse_json_document(raw, "manifest")
    mt = _optional_str(doc, "mediaType", what) or media_type
    if mt in (MEDIA_TYPE_OCI_INDEX, MEDIA_TYPE_DOCKER_MANIFEST_LIST) or (mt is None and "manifests" in doc):
        return Index.parse(raw, media_type=mt)
    return Manifest.parse(raw, media_type=mt)


EMPTY_JSON = b"{}"


def empty_config_descriptor() -> Descriptor:
    """The OCI empty descriptor (``{}``) used as config by referrers such as signatures."""
    from modelpack.mediatypes import MEDIA_TYPE_EMPTY

    return Descriptor(media_type=MEDIA_TYPE_EMPTY, digest=Digest.from_bytes(EMPTY_JSON), size=2, data="e30=")
