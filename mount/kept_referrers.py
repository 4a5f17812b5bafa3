"""Signature referrers the node cache keeps beside a verified model, so its peers can serve them.

Why: a pinned start under a policy (``pull --cache REF@sha256:… --key K``, ``modelpack load
--trusted-key``) must read the model's signature referrers (the manifest signature, the
directory signature, the signed chunk table). With the origin down, a peer's node cache is the
only place left that has them, so a cache that verified a model keeps what it verified with.

Recording: the cache verifies against ``RecordingTarget`` (the pull's own target, unchanged),
which remembers the referrer manifests it fetched by a digest a referrers listing named, and the
bundle blobs of their layers (bounded by the bundle limit, hashed). After the snapshot is ready
and its trust recorded, ``keep`` commits, for each referrer whose manifest names the model as
its ``subject``, has exactly one layer of an accepted bundle media type whose bytes hash to its
digest, and whose bundle is signed by a key the policy trusts (or, keyless, names an identity it
trusts): the OCI empty config, the bundle
and the manifest into the store (content addressed, read-only like every committed blob), and
the manifest's entry into ``index.json`` with ``artifactType`` and the annotation
``io.modelpack.cache.subject`` (the OCI layout's place for manifests; GC keeps their blobs while
the entry is there, and drops the entries with the model's own). A referrer signed by no key
this node trusts is not kept: a peer passes on only what it verified.

Serving: ``referrers_index`` is the OCI image index ``cache serve`` answers for
``GET /v2/<name>/referrers/<digest>`` (with the ``artifactType`` filter), built from those
entries only. Whatever it lists, the client fetches by digest, verifies, and checks the
signature with its own keys: a peer can withhold a signature, never forge one.
"""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from modelpack.mediatypes import MEDIA_TYPE_OCI_INDEX, MEDIA_TYPE_OCI_MANIFEST
from modelpack.mount.store import Store

from modelpack.errors import ModelpackError
from modelpack.oci.descriptor import EMPTY_JSON, MAX_MANIFEST_BYTES, Descriptor, Manifest
from modelpack.oci.digest import Digest
from modelpack.targets.base import ReadableTarget

#: the index.json annotation that ties a kept referrer to the model it signs
SUBJECT_ANNOTATION = "io.modelpack.cache.subject"
#: referrers kept per model (each signing adds a few); more are not kept
MAX_KEPT_PER_SUBJECT = 64
#: referrer listings a verification may make (signature, directory signature, chunk table, …)
MAX_LISTED = 4096


@dataclass
class _Seen:
    listed: set[str] = field(default_factory=set)
    manifests: dict[str, tuple[bytes, str]] = field(default_factory=dict)
    wanted_blobs: dict[str, int] = field(default_factory=dict)
    blobs: dict[str, bytes] = field(default_factory=dict)


class RecordingTarget:
    """A read-only target that remembers the referrers a verification read through it.

    Everything is delegated to ``inner``; only the referrer manifests a listing named and their
    bundle layers are copied aside (verified by digest before they are remembered)."""

    def __init__(self, inner: ReadableTarget) -> None:
        self._inner = inner
        self._seen = _Seen()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def referrers(self, subject: Descriptor, artifact_type: str | None = None) -> list[Descriptor]:
        got: list[Descriptor] = self._inner.referrers(subject, artifact_type)
        for d in got:
            if len(self._seen.listed) < MAX_LISTED:
                self._seen.listed.add(str(d.digest))
        return got

    def fetch_manifest(self, reference: str) -> tuple[bytes, str]:
        raw, media_type = self._inner.fetch_manifest(reference)
        if reference in self._seen.listed and len(raw) <= MAX_MANIFEST_BYTES:
            if Digest.from_bytes(raw) == reference:
                self._seen.manifests[reference] = (raw, media_type)
                try:
                    layers = Manifest.parse(raw, media_type=media_type).layers
                except (ModelpackError, ValueError):
                    layers = ()
                if len(layers) == 1:
                    self._seen.wanted_blobs[str(layers[0].digest)] = layers[0].size
        return raw, media_type

    def fetch_blob(self, descriptor: Descriptor, offset: int = 0) -> BinaryIO:
        from modelpack.signing.bundle import MAX_BUNDLE_BYTES

        digest = str(descriptor.digest)
        if (
            offset
            or self._seen.wanted_blobs.get(digest) != descriptor.size
            or descriptor.size > MAX_BUNDLE_BYTES
        ):
            stream: BinaryIO = self._inner.fetch_blob(descriptor, offset)
            return stream
        with self._inner.fetch_blob(descriptor) as f:
            data = f.read(descriptor.size + 1)
        if len(data) == descriptor.size and Digest.from_bytes(data) == digest:
            self._seen.blobs[digest] = data
        return io.BytesIO(data)  # the caller verifies it as it always does

    def kept_candidates(self, subject: str) -> list[tuple[str, bytes, str, bytes]]:
        """(referrer digest, manifest bytes, media type, bundle bytes) of each referrer of
        ``subject`` read whole and intact through this target."""
        out = []
        for digest, (raw, media_type) in sorted(self._seen.manifests.items()):
            try:
                manifest = Manifest.parse(raw, media_type=media_type)
            except (ModelpackError, ValueError):
                continue
            if (
                manifest.subject is None
                or str(manifest.subject.digest) != subject
                or len(manifest.layers) != 1
            ):
                continue
            data = self._seen.blobs.get(str(manifest.layers[0].digest))
            if data is not None:
                out.append((digest, raw, media_type, data))
        return out


def keep(
    store: Store, subject: str, recorder: RecordingTarget, keys: Sequence[Any], keyless: Any = None
) -> list[str]:
    """Commit the referrers of ``subject`` that ``recorder`` saw and that a key in ``keys``
    signed, or (``keyless``: the policy's ``KeylessTrust``) whose Sigstore certificate names an
    identity the policy trusts (see the module docstring); returns their digests. Blobs first, the index.json entry
    last, so an interrupted keep leaves at most unreferenced blobs for GC, never an entry whose
    blobs are missing."""
    from modelpack.signing.bundle import ACCEPTED_BUNDLE_MEDIA_TYPES, Bundle

    kept: list[str] = []
    for digest, raw, media_type, data in recorder.kept_candidates(subject)[:MAX_KEPT_PER_SUBJECT]:
        manifest = Manifest.parse(raw, media_type=media_type)
        layer = manifest.layers[0]
        if layer.media_type not in ACCEPTED_BUNDLE_MEDIA_TYPES:
            continue
        try:
            bundle = Bundle.from_bytes(data, source=f"referrer {digest}")
        except ModelpackError:
            continue
        if bundle.keyless:
            if keyless is None or keyless.check(data, source=f"referrer {digest}").identity is None:
                continue
        elif bundle.verify(list(keys)) is None:
            continue
        config = manifest.config
        if config.digest == Digest.from_bytes(EMPTY_JSON) and config.size == len(EMPTY_JSON):
            store.put_bytes(Descriptor(config.media_type, config.digest, config.size), EMPTY_JSON)
        elif not store.has(config):
            continue  # only the empty config is known here; a referrer without its config is not kept
        store.put_bytes(Descriptor(layer.media_type, layer.digest, layer.size), data)
        annotations = {**dict(manifest.annotations or {}), SUBJECT_ANNOTATION: subject}
        store.add_manifest(
            raw,
            media_type or MEDIA_TYPE_OCI_MANIFEST,
            annotations=annotations,
            artifact_type=manifest.artifact_type or config.media_type,
        )
        kept.append(digest)
    return kept


def kept_referrers(store: Store, subject: str, artifact_type: str | None = None) -> list[Descriptor]:
    """The referrers of ``subject`` this cache kept (``artifact_type``: only those), from
    ``index.json`` as the cache owner wrote it, each still a committed blob."""
    out: list[Descriptor] = []
    for entry in store.index_entries():
        annotations = entry.get("annotations")
        if not isinstance(annotations, dict) or annotations.get(SUBJECT_ANNOTATION) != subject:
            continue
        try:
            desc = Descriptor.from_dict(entry, where=f"{store.index_path} entry")
        except (ModelpackError, ValueError):
            continue
        if artifact_type and desc.artifact_type != artifact_type:
            continue
        if not store.has(desc):
            continue
        shown = {k: str(v) for k, v in annotations.items() if k != SUBJECT_ANNOTATION}
        out.append(
            Descriptor(
                desc.media_type,
                desc.digest,
                desc.size,
                annotations=shown or None,
                artifact_type=desc.artifact_type,
            )
        )
        if len(out) >= MAX_KEPT_PER_SUBJECT * 4:
            break
    return out


def referrers_index(store: Store, subject: str, artifact_type: str | None = None) -> bytes:
    """The OCI image index answering the referrers API for ``subject`` (empty when none is kept:
    the API's answer for a digest without referrers)."""
    doc = {
        "schemaVersion": 2,
        "mediaType": MEDIA_TYPE_OCI_INDEX,
        "manifests": [d.to_dict() for d in kept_referrers(store, subject, artifact_type)],
    }
    return json.dumps(doc, separators=(",", ":")).encode()


__all__ = ["SUBJECT_ANNOTATION", "RecordingTarget", "keep", "kept_referrers", "referrers_index"]
