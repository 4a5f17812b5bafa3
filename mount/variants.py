"""Variant indexes in the node cache: which entry of an index this node took, kept offline.

::

    indexes/<hex>.json   {digest, mediaType, index: <the index's exact bytes as text>,
                          chosen: {reference, digest, variant, at}}

An index is not a snapshot: the cache keeps its bytes (checked against the digest on every
read, and only when the cache owner wrote the record, ``mount.modes``) and which entry it chose;
the entry itself is pulled as any manifest is, so each variant is stored once and its blobs are
shared by digest with every other variant and model. A pinned ``REF@sha256:<index>`` pull reads
the index from here, selects again (the same node facts give the same entry) and is a plain
snapshot hit — no network. GC does not sweep these records (a few KiB each); an entry evicted
since is simply a miss again.

``VariantResolver.pull_index`` is the index branch of a cache pull (``mount.pull.Puller`` hands
over on a non-hit whose digest names an index): the index's trust and rollback checks, the
selection, then the entry pulled through the ``Puller`` by digest.

``resolve_variant`` is the same selection for callers that do not use the cache (through
``mount.resolve.resolve_trusted``: ``pull`` into a directory, ``modelpack.pull``, the KServe
initializer, the vLLM load format): the chosen entry, pinned by digest. ``choose_entry`` is its
core, also used by the loader for an index it was pinned to.

Trust: under a policy the INDEX signature is verified (or found in the trust record of an
earlier verification, as for manifests), and then the chosen ENTRY is pulled under the same
policy, so its own signature is verified too: an entry that only the index signature covers is
refused (``index create --sign-key`` signs every entry for that reason).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from modelpack.mediatypes import MEDIA_TYPE_OCI_INDEX
from modelpack.mount.modes import DIR_MODE, FILE_MODE, ensure_dir, read_trusted
from modelpack.mount.refs import RefRecords
from modelpack.mount.reports import PullResult
from modelpack.mount.rollback import PendingAcceptance
from modelpack.mount.store import Store
from modelpack.mount.trust import PolicySource, TrustRecords, load_policy

from modelpack.boundedjson import loads_object
from modelpack.errors import DocumentError, SignatureRefused
from modelpack.events import EventLog
from modelpack.files import atomic_write_bytes
from modelpack.oci.descriptor import MAX_MANIFEST_BYTES, Descriptor, Index, parse_manifest_or_index
from modelpack.oci.digest import Digest, verify_bytes
from modelpack.oci.reference import Reference, parse_reference
from modelpack.oci.variant_index import (
    VariantIndex,
    check_entry_manifest,
    is_index_media_type,
    parse_variant_index,
    variant_index,
)
from modelpack.oci.variant_selection import Selection, VariantSelector
from modelpack.targets.base import ReadableTarget
from modelpack.targets.opener import TargetOptions, open_readable

if TYPE_CHECKING:
    from modelpack.mount.trust import PolicySource
    from modelpack.signing.verify import PolicyOrKeys

#: an index of 256 entries with their annotations stays far below this
MAX_INDEX_RECORD_BYTES = 4 * 1024 * 1024 + 64 * 1024


class IndexRecords:
    """``indexes/``: the variant indexes this node resolved, and the entry each one chose."""

    def __init__(self, cache_root: str, owner: int, *, create: bool = True) -> None:
        self.owner = owner
        self.dir = os.path.join(cache_root, "indexes")
        if create:
            ensure_dir(self.dir, DIR_MODE, owner)

    def path(self, digest: str) -> str:
        return os.path.join(self.dir, Digest(digest).hex + ".json")

    def read(self, digest: str) -> dict[str, Any] | None:
        """The record, its index bytes verified against ``digest``; None when absent or not ours."""
        raw = read_trusted(self.path(digest), self.owner, MAX_INDEX_RECORD_BYTES)
        if raw is None or len(raw) > MAX_INDEX_RECORD_BYTES:
            return None
        try:
            doc = loads_object(raw, what=self.path(digest), max_bytes=MAX_INDEX_RECORD_BYTES)
            body = doc["index"].encode("utf-8")
            if doc.get("digest") != digest or Digest.from_bytes(body) != Digest(digest):
                return None
        except (DocumentError, KeyError, AttributeError, ValueError, UnicodeError):
            return None
        doc["_raw"] = body
        return doc

    def load(self, digest: str) -> VariantIndex | None:
        doc = self.read(digest)
        if doc is None:
            return None
        return parse_variant_index(doc["_raw"], str(doc.get("mediaType") or "") or None)

    def save(self, index: VariantIndex, media_type: str, chosen: dict[str, Any] | None = None) -> None:
        """Keep the index; with ``chosen`` (``{digest, reference, variant, at}``) also remember
        that entry as taken (every entry ever taken here is listed; the last one is ``chosen``)."""
        current = self.read(index.digest) or {}
        recorded = current.get("taken")
        taken: dict[str, Any] = dict(recorded) if isinstance(recorded, dict) else {}
        if chosen is not None:
            taken = {**taken, chosen["digest"]: chosen}
        doc = {
            "digest": index.digest,
            "mediaType": media_type,
            "index": index.index.raw.decode("utf-8"),
            "chosen": chosen if chosen is not None else current.get("chosen"),
            "taken": taken,
        }
        atomic_write_bytes(self.path(index.digest), json.dumps(doc, sort_keys=True).encode(), mode=FILE_MODE)

    def all(self) -> list[dict[str, Any]]:
        """Every readable record (without the index bytes): digest, the last chosen entry and
        every entry taken from it here."""
        out: list[dict[str, Any]] = []
        if not os.path.isdir(self.dir):
            return out
        for entry in os.scandir(self.dir):
            if entry.name.endswith(".json") and len(entry.name) == 64 + len(".json"):
                try:
                    doc = self.read("sha256:" + entry.name[: -len(".json")])
                except ValueError:
                    continue
                if doc:
                    taken = doc.get("taken") if isinstance(doc.get("taken"), dict) else {}
                    out.append({"digest": doc["digest"], "chosen": doc.get("chosen"), "taken": taken})
        return out

    def chosen_entry(self, digest: str) -> str | None:
        """The entry digest this node last took from the index ``digest`` (None: not an index here)."""
        doc = self.read(digest)
        chosen = (doc or {}).get("chosen")
        return str(chosen["digest"]) if isinstance(chosen, dict) and "digest" in chosen else None


def _is_valid_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


class IndexPuller(Protocol):
    """What ``VariantResolver.pull_index`` needs of ``mount.pull.Puller`` (named here, not
    imported: ``mount.pull`` calls into this module)."""

    variants: Any
    refs: RefRecords

    def pull(
        self,
        reference: str | Reference,
        target_options: TargetOptions | None,
        *,
        policy: PolicySource | None,
        jobs: int,
        log: EventLog,
        source: ReadableTarget | None,
        start_id: str | None,
    ) -> PullResult: ...

    def no_rollback(
        self, ref: Reference, digest: str, signed_at: float | None, ev: Callable[..., None]
    ) -> PendingAcceptance: ...


class VariantResolver:
    """Turns an index reference into the entry to pull, and pulls it; ``Puller`` calls it on a
    non-hit."""

    def __init__(
        self, records: IndexRecords, store: Store, trust: TrustRecords, selector: VariantSelector | None
    ) -> None:
        self.records = records
        self.store = store
        self.trust = trust
        self.selector = selector or VariantSelector()

    def index_for(
        self,
        ref: Reference,
        digest: Digest,
        desc: Descriptor | None,
        target: ReadableTarget | None,
        target_options: TargetOptions | None,
    ) -> tuple[VariantIndex, str, ReadableTarget | None] | None:
        """The index ``digest`` names (from the records, offline, else fetched and verified), or
        None when it names a plain manifest. Returns the target it opened, if any."""
        doc = self.records.read(str(digest))
        if doc is not None:  # read once: bytes checked against the digest, then parsed bounded
            media_type = str(doc.get("mediaType") or "")
            return parse_variant_index(doc["_raw"], media_type or None), media_type, target
        if desc is not None and not is_index_media_type(desc.media_type):
            return None  # a tag resolved to a manifest: no extra request
        target = target or open_readable(ref, target_options)
        raw, media_type = target.fetch_manifest(str(digest))
        if len(raw) > MAX_MANIFEST_BYTES:
            return None  # the manifest path refuses it with its own message
        verify_bytes(raw, digest, None, what="manifest", source=target.name)
        if not (is_index_media_type(media_type) or (_is_valid_utf8(raw) and b'"manifests"' in raw)):
            return None
        if not isinstance(parse_manifest_or_index(raw, media_type), Index):
            return None
        vi = parse_variant_index(raw, media_type)
        self.records.save(vi, media_type)
        return vi, media_type, target

    def check_index_trust(
        self,
        vi: VariantIndex,
        media_type: str,
        ref: Reference,
        target: ReadableTarget | None,
        target_options: TargetOptions | None,
        policy: PolicySource | None,
        log: EventLog,
        ev: Callable[..., None],
    ) -> tuple[str, ReadableTarget | None, float | None]:
        """Under a policy the index signature must verify (or have verified here before).
        Returns the status, the target opened (if any) and the index's signing time (for the
        tag's rollback check: a tag of an index moved back to an older signed index is refused)."""
        if policy is None:
            return "not-checked", target, None
        policy = load_policy(policy)
        if self.trust.trusted_locally(vi.digest, ref, policy):
            ev("cache.signature_verified", digest=vi.digest, status="verified", cached=True, kind="index")
            return "verified", target, self.trust.signed_time(vi.digest, ref, policy)
        from modelpack.signing import verify_artifact

        target = target or open_readable(ref, target_options)
        desc = Descriptor(media_type or vi.index.media_type, vi.index.digest, len(vi.index.raw))
        try:
            result = verify_artifact(target, ref, desc, policy, events=log)
        except SignatureRefused as exc:
            ev("cache.signature_refused", digest=vi.digest, reason=exc.reason, kind="index")
            raise
        self.trust.record(vi.digest, result)
        ev("cache.signature_verified", digest=vi.digest, status=result.status, kind="index")
        return str(result.status), target, result.signed_at

    def choose(
        self,
        vi: VariantIndex,
        target: ReadableTarget | None,
        ref: Reference,
        target_options: TargetOptions | None,
    ) -> tuple[Selection, ReadableTarget | None]:
        """The selector's pick; its manifest must be a ModelPack manifest whose bytes hash to the
        entry digest (fetched from the store when there, else from the target)."""
        selection = self.selector.select(vi)
        entry = selection.chosen
        d = str(entry.descriptor.digest)
        try:
            raw = self.store.read_small(d)
            media_type: str | None = entry.descriptor.media_type
        except (FileNotFoundError, OSError):
            target = target or open_readable(ref, target_options)
            raw, media_type = target.fetch_manifest(d)
        check_entry_manifest(entry, raw, media_type, index=vi.digest)
        return selection, target

    def pull_index(
        self,
        puller: IndexPuller,
        found: tuple[VariantIndex, str, ReadableTarget | None],
        ref: Reference,
        target_options: TargetOptions | None,
        policy: PolicySource | None,
        jobs: int,
        log: EventLog,
        sid: str,
        ev: Callable[..., None],
    ) -> PullResult:
        """An index: its signature (under a policy), the entry that fits this node, then that entry
        pulled by digest (``puller.pull``) under the same policy, so each variant is one snapshot."""
        index, media_type, target = found
        index_signature, target, signed_at = self.check_index_trust(
            index, media_type, ref, target, target_options, policy, log, ev
        )
        # a tag of the index under a policy: no index signed before the newest one accepted here
        pending = puller.no_rollback(ref, index.digest, signed_at, ev) if policy is not None else None
        selection, target = self.choose(index, target, ref, target_options)
        ev(
            "cache.variant_selected",
            index=index.digest,
            digest=selection.digest,
            variant=dict(selection.chosen.fields),
        )
        entry_ref = dataclasses.replace(ref, tag=None, digest=Digest(selection.digest))
        puller.variants = None  # the entry is a manifest (checked): no second look for an index
        try:
            result = puller.pull(
                entry_ref, target_options, policy=policy, jobs=jobs, log=log, source=target, start_id=sid
            )
        finally:
            puller.variants = self
        if pending is not None:
            pending.accept()
        self.record(index, media_type, str(ref), selection)
        if not ref.digest:  # the tag stands for the entry this node uses (open_snapshot, load)
            puller.refs.record(ref, Digest(selection.digest))
        result.reference = str(ref)
        result.variant = {**selection.to_json(), "indexSignature": index_signature}
        return result

    def record(self, vi: VariantIndex, media_type: str, reference: str, selection: Selection) -> None:
        """Remember the entry taken; a hit that took the same entry for the same reference as
        last time writes nothing (no fsync on the hit path)."""
        last = (self.records.read(vi.digest) or {}).get("chosen")
        if (
            isinstance(last, dict)
            and last.get("digest") == selection.digest
            and last.get("reference") == reference
        ):
            return
        chosen = {
            "reference": reference,
            "digest": selection.digest,
            "variant": dict(selection.chosen.fields),
            "at": time.time(),
        }
        self.records.save(vi, media_type, chosen)


@dataclass
class ResolvedVariant:
    """An index reference resolved: the entry to use, pinned, and why (``selection``)."""

    reference: str  # the entry, digest-pinned in the index's repository
    selection: Selection
    index_signature: str = "not-checked"
    index_digest: str = ""
    #: the newest signing time of the index's verified signatures (None: not verified), for the
    #: rollback check of a tag that names the index (``mount.resolve``)
    index_signed_at: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            **self.selection.to_json(),
            "reference": self.reference,
            "indexSignature": self.index_signature,
        }


def resolve_variant(
    reference: str | Reference,
    selector: VariantSelector | None = None,
    *,
    target_options: TargetOptions | None = None,
    policy: PolicyOrKeys | None = None,
    events: EventLog | None = None,
    target: ReadableTarget | None = None,
    descriptor: Descriptor | None = None,
) -> ResolvedVariant | None:
    """When ``reference`` names an index of variants: the entry ``selector`` picks, pinned by
    digest (None: a plain manifest, use ``reference`` as it is). Under ``policy`` the index
    signature is verified here; the caller verifies the entry's own signature as for any model
    (``mount.resolve.resolve_trusted``). The entry's manifest is fetched by
    digest and must be a ModelPack manifest whose bytes hash to the entry digest. ``descriptor``
    is what ``reference`` already resolved to (no second request)."""
    ref = parse_reference(reference) if isinstance(reference, str) else reference
    target = target if target is not None else open_readable(ref, target_options)
    desc = descriptor if descriptor is not None else target.resolve(ref.identifier)
    if not is_index_media_type(desc.media_type) and not ref.digest:
        return None
    raw, media_type = target.fetch_manifest(str(desc.digest))
    verify_bytes(raw, desc.digest, None, what="manifest", source=target.name)
    parsed = parse_manifest_or_index(raw, media_type)
    if not isinstance(parsed, Index):
        return None
    return choose_entry(target, ref, variant_index(parsed), selector, policy=policy, events=events).resolved


@dataclass(frozen=True)
class ChosenEntry:
    """An index's entry, chosen and checked: why (``resolved``) and its manifest's exact bytes."""

    resolved: ResolvedVariant
    manifest_raw: bytes
    media_type: str


def choose_entry(
    target: ReadableTarget,
    ref: Reference | None,
    vi: VariantIndex,
    selector: VariantSelector | None,
    *,
    policy: PolicyOrKeys | None,
    events: EventLog | None = None,
) -> ChosenEntry:
    """The one selection of an index's entry (``resolve_variant``, the loader's pinned index):
    under ``policy`` the index signature verified first (``SignatureRefused``), then the entry
    ``selector`` picks (no node facts without one), whose manifest is fetched by digest and
    must be a ModelPack manifest hashing to the entry digest (``VariantIndexError``).
    ``ref`` (None: named by ``target`` alone) is what the policy matches and the pinned entry's
    repository."""
    signature = "not-checked"
    signed_at = None
    if policy is not None:
        from modelpack.signing import verify_artifact

        index_desc = Descriptor(
            vi.index.media_type or MEDIA_TYPE_OCI_INDEX, vi.index.digest, len(vi.index.raw)
        )
        result = verify_artifact(target, ref, index_desc, policy, events=events)
        signature = str(result.status)
        signed_at = result.signed_at
    selection = (selector or VariantSelector()).select(vi)
    entry = selection.chosen
    entry_raw, entry_type = target.fetch_manifest(str(entry.descriptor.digest))
    check_entry_manifest(entry, entry_raw, entry_type, index=vi.digest)
    pinned = (
        str(dataclasses.replace(ref, tag=None, digest=entry.descriptor.digest))
        if ref is not None
        else f"{target.name}@{entry.descriptor.digest}"
    )
    resolved = ResolvedVariant(pinned, selection, signature, str(vi.digest), signed_at)
    return ChosenEntry(resolved, entry_raw, entry_type or entry.descriptor.media_type)
