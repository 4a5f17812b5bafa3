"""Registry audit: what is in a repository (or a whole registry), and is each version signed?

For every tag: digest, artifact type, size, layer count, created (when recorded), model
name/version/precision from the config, signature state in ``verify``'s words (verified /
untrusted / invalid / unsigned, or ``signed`` when no keys were given) with key ids, and referrers by artifact type. Tags that share
a digest are grouped into one version; ``since`` (a previous ``{tag: digest}`` map, or a previous
audit's JSON) flags tags that moved or disappeared.

Only the Target protocol is used, so a registry repository, an OCI layout and an S3 layout audit
the same way; the catalog walk (``audit_registry``) needs a registry.

A listing comes from outside and may never end: tags are consumed as the pages arrive and at
most ``max_tags`` of them (default ``DEFAULT_MAX_TAGS``, ``--max-tags`` to raise it) are
audited; a registry that links to more pages than any listing needs is stopped by the target
(``ListingCutError``). Either way the audit keeps what it listed and says why it stopped in
``cut`` (the text output prints it; ``--json`` carries it), never a silent partial listing.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from modelpack.boundedjson import loads
from modelpack.errors import DocumentError, ListingCutError, ModelpackError
from modelpack.mediatypes import ANNOTATION_CREATED, ModelSpecConfig, is_model_config
from modelpack.oci.descriptor import Descriptor, Manifest, parse_manifest_or_index
from modelpack.oci.digest import verify_bytes
from modelpack.oci.reference import Reference
from modelpack.targets.base import Closable, ReadableTarget

if TYPE_CHECKING:
    from modelpack.signing.keys import PublicKey
    from modelpack.signing.verify import PolicyOrKeys


def format_signed_at(seconds: float | None) -> str | None:
    if not seconds:
        return None
    from modelpack.signing.signing_time import format_signing_time

    return format_signing_time(seconds)


MAX_SINCE_BYTES = 64 * 1024 * 1024
#: tags audited per repository unless the caller raises it (each costs a manifest request)
DEFAULT_MAX_TAGS = 10_000
MAX_CONFIG_BYTES = 4 * 1024 * 1024


@dataclass
class VersionAudit:
    """One manifest digest in a repository and every tag pointing at it."""

    digest: str
    tags: list[str]
    media_type: str
    artifact_type: str | None = None
    total_size: int = 0
    layer_count: int = 0
    created: str | None = None
    model: dict[str, str | None] = field(default_factory=dict)
    signature: str = "unsigned"  # a SignatureState (verified | untrusted | invalid | unsigned | signed)
    key_ids: list[str] = field(default_factory=list)
    signature_reasons: list[str] = field(default_factory=list)
    signed_at: float | None = None  # newest signing time of a verified signature (0: untimed)
    referrers: dict[str, int] = field(default_factory=dict)
    error: str | None = None
    #: an adapter's name and base (``dev.modelpack.adapter``), or a base's verified adapters
    adapter: dict[str, str | None] | None = None
    adapters: list[dict[str, Any]] = field(default_factory=list)
    #: an index of variants: each entry's digest and the fields that select it
    variants: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "digest": self.digest,
            "tags": sorted(self.tags),
            "mediaType": self.media_type,
            "artifactType": self.artifact_type,
            "totalSize": self.total_size,
            "layerCount": self.layer_count,
            "created": self.created,
            "model": dict(self.model),
            "signature": {
                "status": self.signature,
                "keyIds": sorted(self.key_ids),
                "reasons": list(self.signature_reasons),
                "signedAt": format_signed_at(self.signed_at),
            },
            "referrers": dict(sorted(self.referrers.items())),
            "error": self.error,
            "adapter": self.adapter,
            "adapters": list(self.adapters),
            "variants": list(self.variants),
        }


@dataclass
class RepositoryAudit:
    repository: str
    tags: dict[str, str] = field(default_factory=dict)  # tag -> digest
    versions: list[VersionAudit] = field(default_factory=list)
    moved: list[dict[str, str | None]] = field(default_factory=list)
    error: str | None = None
    tag_history: list[dict[str, Any]] = field(default_factory=list)  # inspection.tag_history
    #: why the listing stopped before its end (a bound), None when it was read to the end
    cut: str | None = None

    def to_json(self) -> dict[str, Any]:
        doc = {
            "repository": self.repository,
            "tags": dict(sorted(self.tags.items())),
            "versions": [v.to_json() for v in self.versions],
            "moved": list(self.moved),
            "error": self.error,
            "cut": self.cut,
        }
        if self.tag_history:
            doc["tagHistory"] = list(self.tag_history)
        return doc


def _signature_status(
    target: ReadableTarget,
    desc: Descriptor,
    keys: list[PublicKey] | None,
    version: VersionAudit | None = None,
) -> tuple[str, list[str], list[str]]:
    """(state, key ids, reasons) in the words ``verify`` uses (``signing.signature_state``): a
    valid signature by a key not given is ``untrusted``, never ``invalid``."""
    from modelpack.signing.manifest_signature import check_manifest_signatures
    from modelpack.signing.signature_state import SignatureState, overall

    checks = check_manifest_signatures(target, desc, list(keys or []))
    state = overall((c.status for c in checks), checked=keys is not None)
    if state is SignatureState.VERIFIED:
        verified = [c for c in checks if c.status is SignatureState.VERIFIED]
        if version is not None:  # the signing time only a verified signature vouches for
            version.signed_at = max(c.signed_at or 0.0 for c in verified)
        return state, [c.key_id for c in verified], []
    # no trusted signature: which keys signed (the hints of valid ones) and why each was not taken
    # (with no key given, "not by a trusted key" says nothing: only broken signatures have reasons)
    reasons = [
        c.reason for c in checks if c.reason and (keys is not None or c.status is SignatureState.INVALID)
    ]
    return state, sorted({c.key_id for c in checks if c.key_id}), reasons


def _keys_for(policy_or_keys: PolicyOrKeys | None, repo_ref: Reference | None) -> list[PublicKey] | None:
    if policy_or_keys is None:
        return None
    from modelpack.signing.verify import resolve_policy

    return list(resolve_policy(policy_or_keys, repo_ref).keys)


def audit_version(
    target: ReadableTarget, desc: Descriptor, tags: list[str], keys: list[PublicKey] | None
) -> VersionAudit:
    v = VersionAudit(str(desc.digest), tags, desc.media_type, desc.artifact_type)
    try:
        raw, media_type = target.fetch_manifest(str(desc.digest))
        verify_bytes(raw, desc.digest, None, what="manifest", source=target.name)
        parsed = parse_manifest_or_index(raw, media_type)
        v.media_type = parsed.media_type
        if isinstance(parsed, Manifest):
            v.artifact_type = parsed.artifact_type or parsed.config.media_type
            v.total_size = parsed.total_size
            v.layer_count = len(parsed.layers)
            v.created = (parsed.annotations or {}).get(ANNOTATION_CREATED)
            if is_model_config(parsed.config.media_type) and parsed.config.size <= MAX_CONFIG_BYTES:
                with target.fetch_blob(parsed.config) as f:
                    data = f.read(parsed.config.size + 1)
                verify_bytes(
                    data, parsed.config.digest, parsed.config.size, what="config", source=target.name
                )
                cfg = ModelSpecConfig.from_bytes(data).to_dict()
                d, c = cfg.get("descriptor", {}), cfg.get("config", {})
                v.model = {
                    "name": d.get("name"),
                    "version": d.get("version"),
                    "precision": c.get("precision"),
                }
                v.created = d.get("createdAt") or v.created
        else:
            v.total_size = sum(m.size for m in parsed.manifests)
            v.layer_count = len(parsed.manifests)
            from modelpack.oci.variant_index import variant_index

            v.variants = [e.to_json() for e in variant_index(parsed).entries]  # bounded, values checked
        if isinstance(parsed, Manifest):
            _adapters(target, desc, parsed, v)
        v.signature, v.key_ids, v.signature_reasons = _signature_status(target, desc, keys, v)
        for r in target.referrers(Descriptor(desc.media_type, desc.digest, desc.size)):
            at = r.artifact_type or "unknown"
            v.referrers[at] = v.referrers.get(at, 0) + 1
    except (ModelpackError, ValueError, OSError) as exc:
        v.error = str(exc)
    return v


def _adapters(target: ReadableTarget, desc: Descriptor, manifest: Manifest, v: VersionAudit) -> None:
    """What an adapter is for, or which verified adapters a model has (``packing.adapter_referrers``)."""
    from modelpack.packing.adapter import adapter_name_of
    from modelpack.packing.adapter_referrers import find_adapters, is_model_manifest

    name = adapter_name_of(manifest)
    if name is not None:
        v.adapter = {"name": name, "base": str(manifest.subject.digest) if manifest.subject else None}
    elif is_model_manifest(manifest):
        v.adapters = [a.to_json() for a in find_adapters(target, desc).adapters]


def load_since(path: str) -> dict[str, str]:
    """A ``{tag: digest}`` map, a repository audit JSON (``tags``) or a registry audit JSON
    (``repositories``: keys become ``repo:tag``)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_SINCE_BYTES + 1)
    except OSError as exc:
        raise DocumentError(path, f"cannot read --since file: {exc.strerror or exc}") from exc
    # an audit JSON nests registry → repositories → repository → tags: 4 levels
    doc = loads(raw, what=path, max_bytes=MAX_SINCE_BYTES, max_depth=8)
    out: dict[str, str] = {}
    if isinstance(doc, dict) and isinstance(doc.get("repositories"), list):
        for repo in doc["repositories"]:
            if isinstance(repo, dict) and isinstance(repo.get("tags"), dict):
                for tag, dig in repo["tags"].items():
                    out[f"{repo.get('repository')}:{tag}"] = str(dig)
        return out
    if isinstance(doc, dict) and isinstance(doc.get("tags"), dict):
        doc = doc["tags"]
    if not isinstance(doc, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in doc.items()
    ):
        raise ModelpackError(f"{path}: expected a JSON object mapping tag → digest (or an audit JSON)")
    return dict(doc)


def audit_repository(
    target: ReadableTarget,
    name: str,
    *,
    policy_or_keys: PolicyOrKeys | None = None,
    since: Mapping[str, str] | None = None,
    reference: Reference | None = None,
    max_tags: int = DEFAULT_MAX_TAGS,
) -> RepositoryAudit:
    """Audit one repository (any Target). ``since`` keys are tags, or ``repo:tag``. At most
    ``max_tags`` tags (counted as listed, repeats included) are read; ``cut`` says when more were
    offered."""
    if max_tags < 1:
        raise ModelpackError(f"max_tags must be at least 1, got {max_tags}")
    audit = RepositoryAudit(name)
    keys = _keys_for(policy_or_keys, reference)
    by_digest: dict[str, tuple[Descriptor, list[str]]] = {}
    try:
        for tag in _listed_tags(target, audit, max_tags):
            desc = target.resolve(tag)
            audit.tags[tag] = str(desc.digest)
            by_digest.setdefault(str(desc.digest), (desc, []))[1].append(tag)
    except ModelpackError as exc:
        audit.error = str(exc)
    for digest in sorted(by_digest, key=lambda d: sorted(by_digest[d][1])[0]):
        desc, tags = by_digest[digest]
        audit.versions.append(audit_version(target, desc, tags, keys))
    if since is not None:
        for key, previous in sorted(since.items()):
            tag = key
            if ":" in key and not key.startswith("sha256"):
                repo, _, tag = key.rpartition(":")
                if repo != name:
                    continue
            current = audit.tags.get(tag)
            if current != previous:
                audit.moved.append({"tag": tag, "previous": previous, "current": current})
    return audit


def _listed_tags(target: ReadableTarget, audit: RepositoryAudit, max_tags: int) -> list[str]:
    """The repository's tags, sorted, at most ``max_tags`` listed (the listing is consumed as it
    streams, and left unread past the bound); ``audit.cut`` records a bound that stopped it."""
    tags: set[str] = set()
    listed = 0
    listing = iter(target.list_tags())
    try:
        for tag in listing:
            if listed == max_tags:
                audit.cut = (
                    f"the tag listing was cut at {max_tags} tags (--max-tags raises the bound); "
                    "tags after those were not audited"
                )
                break
            listed += 1
            if not tag.startswith("sha256-"):  # referrers tag-schema indexes and cosign tags
                tags.add(tag)
    except ListingCutError as exc:
        audit.cut = str(exc)
    finally:
        if isinstance(listing, Closable):
            listing.close()  # a generator: no further page is fetched
    return sorted(tags)


def audit_registry(
    repositories: Iterable[str],
    open_repo: Callable[[str], tuple[ReadableTarget, Reference]],
    *,
    repo_glob: str | None = None,
    policy_or_keys: PolicyOrKeys | None = None,
    since: Mapping[str, str] | None = None,
    max_tags: int = DEFAULT_MAX_TAGS,
) -> list[RepositoryAudit]:
    """Audit every repository from a (paginated, lazily consumed) catalog matching ``repo_glob``
    (matched against the catalog name); results are named ``host/repo`` like a single-repo audit.
    A catalog cut at its page bound ends the walk with an entry named ``CATALOG_ENTRY`` whose
    ``cut`` says so."""
    out = []
    try:
        for repo in repositories:
            if repo_glob and not fnmatch.fnmatchcase(repo, repo_glob):
                continue
            try:
                target, ref = open_repo(repo)
            except ModelpackError as exc:
                out.append(RepositoryAudit(repo, error=str(exc)))
                continue
            out.append(
                audit_repository(
                    target,
                    ref.repo_name,
                    policy_or_keys=policy_or_keys,
                    since=since,
                    reference=ref,
                    max_tags=max_tags,
                )
            )
    except ListingCutError as exc:
        out.append(RepositoryAudit(CATALOG_ENTRY, cut=str(exc)))
    return out


#: the name of the entry that reports a cut catalog (not a repository name: ``_`` cannot start one)
CATALOG_ENTRY = "_catalog"
