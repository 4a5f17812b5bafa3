"""LoRA adapters as artifacts whose ``subject`` is their base: push one, pull a base with its adapters.

``push_adapter`` packs a PEFT adapter directory (``modelpack.packing.adapter``) against a base
that is fetched from the destination repository and verified first, so the subject is the
exact descriptor (digest, size, media type) of a manifest that is there. A ``--base`` given by
tag is resolved once and pinned: the adapter names that digest for good, whatever the tag does
later (``AdapterPushResult.base`` says which).

``pull_with_adapters`` pulls a base and its adapters: every adapter the registry lists for the
base (``with_adapters``) and/or adapters named by their own references (``adapters``). Each is
checked against the base (its subject must be the base's digest: ``AdapterBaseMismatchError``
names both otherwise), verified against the trust policy when one is given (a listed adapter
that fails it is left out and reported; a named one refuses the pull), and written to
``DEST/adapters/<name>/`` (a directory pull) or into its own node-cache snapshot (``cache``).
Everything is checked before the first file is written.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from modelpack.errors import (
    AdapterError,
    AdapterSubjectError,
    InvalidReferenceError,
    NotFoundError,
    PullError,
)
from modelpack.oci.descriptor import Descriptor, Manifest
from modelpack.oci.digest import Digest
from modelpack.oci.reference import Reference, parse_reference
from modelpack.packing.adapter import adapter_name_of, build_adapter_artifact
from modelpack.packing.adapter_referrers import (
    FoundAdapter,
    check_adapter_for_base,
    check_subject_resolves,
    fetch_verified_manifest,
    find_adapters,
    is_model_manifest,
)
from modelpack.packing.packer import PackOptions
from modelpack.targets.base import ReadableTarget
from modelpack.targets.opener import TargetOptions, open_readable, open_target
from modelpack.transfer.copy import CopyResult, copy

if TYPE_CHECKING:
    from modelpack.mount.cache import NodeCache
    from modelpack.signing.keys import PrivateKey
    from modelpack.signing.verify import PolicyOrKeys

#: where a directory pull puts each adapter, below DEST
ADAPTERS_SUBDIR = "adapters"


@dataclass
class AdapterPushResult:
    reference: str
    digest: str
    name: str
    base: str  # the base manifest digest the adapter's subject names
    base_resolved_from_tag: str | None
    copy: CopyResult
    signed: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "reference": self.reference,
            "digest": self.digest,
            "adapter": self.name,
            "base": self.base,
            "transfer": self.copy.to_json(),
        }
        if self.base_resolved_from_tag:
            doc["baseTag"] = self.base_resolved_from_tag
        if self.signed is not None:
            doc["signed"] = self.signed
        return doc


def base_reference(base: str, destination: Reference) -> Reference:
    """``--base`` as a reference in the destination's repository: ``sha256:…``, ``@sha256:…``,
    ``:TAG``, or a full reference that must name the same repository (referrers are listed
    per repository, so an adapter in another repository would be invisible from its base)."""
    if base.startswith("sha256:"):
        return dataclasses.replace(destination, tag=None, digest=Digest(base))
    if base.startswith("@") or base.startswith(":"):
        base = f"{_repo_text(destination)}{base}"
    ref = parse_reference(base)
    if _repo_text(ref) != _repo_text(destination):
        raise InvalidReferenceError(
            f"--base {base}: the base must be in the adapter's repository {_repo_text(destination)} "
            "(adapters are listed as referrers of their base, per repository); copy it there first"
        )
    if not ref.digest and not ref.tag:
        raise InvalidReferenceError(f"--base {base}: name the base by digest (@sha256:…) or tag")
    return ref


def _repo_text(ref: Reference) -> str:
    return str(dataclasses.replace(ref, tag=None, digest=None))


def resolve_base(target: ReadableTarget, ref: Reference) -> tuple[Descriptor, Manifest]:
    """The base's manifest, fetched and verified against the digest it resolves to (a tag is
    resolved here, once); it must be a ModelPack model and not itself an adapter."""
    try:
        desc = target.resolve(ref.identifier)
        manifest = fetch_verified_manifest(target, desc, "base manifest")
    except NotFoundError:
        raise AdapterSubjectError(f"--base {ref}: not found in {target.name}") from None
    if not is_model_manifest(manifest):
        raise AdapterSubjectError(f"--base {ref} ({desc.digest}): not a ModelPack model manifest")
    if adapter_name_of(manifest) is not None:
        raise AdapterSubjectError(f"--base {ref} ({desc.digest}): is itself an adapter; name the base model")
    return Descriptor(manifest.media_type, desc.digest, len(manifest.raw)), manifest


def push_adapter(
    adapter_dir: str,
    destination: str | Reference,
    base: str,
    *,
    name: str | None = None,
    pack_options: PackOptions | None = None,
    target_options: TargetOptions | None = None,
    jobs: int = 4,
    sign_key: PrivateKey | str | None = None,
    sign_passphrase: str | bytes | None = None,
) -> AdapterPushResult:
    """Pack ``adapter_dir`` as an adapter of ``base`` and store it at ``destination`` (any
    writable target: registry, layout, S3). With ``sign_key`` the adapter is signed before the
    tag is written (as ``push`` does), so a tag never names an unsigned adapter."""
    dst = parse_reference(destination) if isinstance(destination, str) else destination
    if dst.digest:
        raise InvalidReferenceError(f"{dst}: push to a tag, not a digest (the digest is computed)")
    topts = (target_options or TargetOptions.from_environ()).bound_to(dst)
    key = _signing_key(sign_key, sign_passphrase)
    tag = dst.tag or "latest"
    target = open_target(dst, topts, for_write=True)
    bref = base_reference(base, dst)
    base_desc, _ = resolve_base(target, bref)
    opts = pack_options or PackOptions()
    staging_parent = dst.location if dst.scheme == "oci" else None
    artifact = build_adapter_artifact(adapter_dir, base_desc, opts, name=name, staging_parent=staging_parent)
    try:
        artifact.tag = tag
        copied = copy(artifact, target, tag, tag if key is None else None, jobs=jobs, progress=opts.progress)
    finally:
        artifact.cleanup()
    result = AdapterPushResult(
        str(dst.with_tag(tag)),
        str(artifact.digest),
        artifact.config.descriptor.name or "",
        str(base_desc.digest),
        bref.tag if not bref.digest else None,
        copied,
    )
    if key is not None:
        from modelpack.signing import sign_artifact

        desc = target.resolve(str(artifact.digest))
        result.signed = sign_artifact(target, desc, key, reference=dst.with_tag(tag)).to_json()
        target.tag(desc, tag)
    return result


def _signing_key(sign_key: PrivateKey | str | None, passphrase: str | bytes | None) -> PrivateKey | None:
    """Loaded before anything is uploaded: a bad key fails a push that wrote nothing."""
    if sign_key is None:
        return None
    from modelpack.signing.keys import PrivateKey, load_private_key

    return sign_key if isinstance(sign_key, PrivateKey) else load_private_key(sign_key, passphrase)


@dataclass
class SelectedAdapter:
    """An adapter chosen for a base, checked against it, with the reference it is pulled by."""

    name: str
    reference: Reference  # pinned by digest
    descriptor: Descriptor
    path: str = ""  # where it landed (DEST/adapters/NAME, or its cache snapshot)
    verification: dict[str, Any] | None = None
    listed: bool = False  # found in the base's referrers (not named with --adapter)
    hold_path: str = ""  # ``pull --cache --hold``: GC keeps the snapshot until ``hold_until``
    hold_until: float = 0.0

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "name": self.name,
            "reference": str(self.reference),
            "digest": str(self.descriptor.digest),
            "path": self.path,
            "verification": self.verification,
        }
        if self.hold_path:
            from modelpack.timestamps import rfc3339_utc

            doc["hold"] = {"path": self.hold_path, "until": rfc3339_utc(self.hold_until)}
        return doc


@dataclass
class BasePullResult:
    reference: str
    digest: str
    path: str
    adapters: list[SelectedAdapter] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    base: Any = None  # the base's own PullResult (directory or node cache)

    def to_json(self) -> dict[str, Any]:
        """``pull --with-adapters --json``: the base's pull document (the one ``pull --json``
        prints, under the reference as asked for) with the adapters taken and those left out."""
        return {
            **self.base.to_json(),
            "reference": self.reference,
            "adapters": [a.to_json() for a in self.adapters],
            "skippedAdapters": self.skipped,
        }


def select_adapters(
    target: ReadableTarget,
    base_ref: Reference,
    base_desc: Descriptor,
    *,
    with_adapters: bool,
    adapters: Sequence[str],
    target_options: TargetOptions | None,
) -> tuple[list[SelectedAdapter], list[str]]:
    """The adapters to pull with a base, each checked against it (names are checked for
    duplicates once the policy has had its say: ``unique_names``)."""
    chosen: list[SelectedAdapter] = []
    skipped: list[str] = []
    if with_adapters:
        listing = find_adapters(target, base_desc)
        skipped = listing.skipped
        chosen = [_selected(base_ref, found) for found in listing.adapters]
    for text in adapters:
        ref = parse_reference(text)
        src = open_readable(ref, (target_options or TargetOptions.from_environ()).bound_to(ref))
        desc = src.resolve(ref.identifier)
        manifest = fetch_verified_manifest(src, desc, "adapter manifest")
        name = check_adapter_for_base(manifest, str(ref), str(desc.digest), str(base_desc.digest))
        check_subject_resolves(src, manifest, f"adapter {ref} ({desc.digest})")
        pinned = dataclasses.replace(ref, tag=None, digest=desc.digest)
        chosen = [c for c in chosen if c.descriptor.digest != desc.digest]  # named: no longer optional
        chosen.append(
            SelectedAdapter(name, pinned, Descriptor(manifest.media_type, desc.digest, len(manifest.raw)))
        )
    return chosen, skipped


def unique_names(chosen: Sequence[SelectedAdapter], base_digest: str) -> None:
    """Two adapters of one base under one name are refused: which one a node serves must not
    depend on listing order."""
    names: dict[str, str] = {}
    for c in chosen:
        if c.name in names:
            raise AdapterError(
                f"two adapters for base {base_digest} are named {c.name!r}: {names[c.name]} and "
                f"{c.descriptor.digest}; pull one of them by reference (--adapter)"
            )
        names[c.name] = str(c.descriptor.digest)


def apply_policy(
    pinned: Reference,
    chosen: list[SelectedAdapter],
    policy: PolicyOrKeys,
    topts: TargetOptions,
    skipped: list[str],
) -> list[SelectedAdapter]:
    """Verify the base and every adapter under ``policy`` before anything is written. The base
    and adapters named by reference must pass; an adapter only *listed* for the base that fails
    is left out and reported in ``skipped`` (anyone who can push may list adapters, as with
    junk signatures: an unsigned one must neither be served nor block the signed ones)."""
    from modelpack.errors import SignatureRefused
    from modelpack.mount.resolve import resolve_trusted

    resolve_trusted(pinned, policy=policy, target_options=topts)
    kept: list[SelectedAdapter] = []
    for a in chosen:
        try:
            verification = resolve_trusted(a.reference, policy=policy, target_options=topts).verification
            assert verification is not None  # a policy was given
            a.verification = verification.to_json()
        except SignatureRefused as exc:
            if not a.listed:
                raise
            skipped.append(f"adapter {a.name} ({a.descriptor.digest}) left out: {exc}")
            continue
        kept.append(a)
    return kept


def _selected(base_ref: Reference, found: FoundAdapter) -> SelectedAdapter:
    return SelectedAdapter(
        found.name,
        dataclasses.replace(base_ref, tag=None, digest=found.descriptor.digest),
        found.descriptor,
        listed=True,
    )


def pull_with_adapters(
    reference: str | Reference,
    dest_dir: str | None = None,
    *,
    cache: NodeCache | None = None,
    with_adapters: bool = True,
    adapters: Sequence[str] = (),
    policy: PolicyOrKeys | None = None,
    target_options: TargetOptions | None = None,
    jobs: int = 4,
    progress: str = "auto",
    force: bool = False,
    hold: float | None = None,
) -> BasePullResult:
    """Pull the base at ``reference`` and its adapters into ``dest_dir`` or into ``cache``.

    ``policy`` (a ``TrustPolicy``, public keys, or None) is checked for the base and for each
    adapter (each is its own signed artifact) before anything of it is written; with a cache,
    the cache checks it as for any pull. Adapters land at ``dest_dir/adapters/<name>/``, or each in
    its own snapshot; ``result.adapters`` says where. ``hold`` (seconds, with a cache) keeps the
    base and every adapter from GC for that long, as ``NodeCache.pull(hold=…)`` does for one
    snapshot: the engine they are handed to takes its own leases when it starts
    (``serving.adapter_leases``).
    """
    if hold is not None and cache is None:
        raise PullError("pull with adapters: a hold keeps node-cache snapshots; give a node cache")
    if (dest_dir is None) == (cache is None):
        raise PullError("pull with adapters: give a destination directory or a node cache, not both")
    ref = parse_reference(reference) if isinstance(reference, str) else reference
    topts = (target_options or TargetOptions.from_environ()).bound_to(ref)
    target = open_readable(ref, topts)
    desc = target.resolve(ref.identifier)
    base_manifest = fetch_verified_manifest(target, desc, "base manifest")
    if adapter_name_of(base_manifest) is not None:
        raise AdapterError(
            f"{ref} ({desc.digest}) is an adapter, not a base; pull its base with --adapter {ref}"
        )
    base_desc = Descriptor(base_manifest.media_type, desc.digest, len(base_manifest.raw))
    pinned = dataclasses.replace(ref, tag=None, digest=desc.digest)
    chosen, skipped = select_adapters(
        target, pinned, base_desc, with_adapters=with_adapters, adapters=adapters, target_options=topts
    )
    if dest_dir is not None:
        _refuse_adapters_dir_in_base(base_manifest, ref)
    if policy is not None:  # every signature before the first byte of any of them is written
        chosen = apply_policy(pinned, chosen, policy, topts, skipped)
    unique_names(chosen, str(desc.digest))
    if cache is not None:  # the cache checks the policy again, as for any pull, before publishing
        base_result = cache.pull(pinned, topts, policy=policy, jobs=jobs, progress=progress, hold=hold)
        for a in chosen:
            got = cache.pull(a.reference, topts, policy=policy, jobs=jobs, progress=progress, hold=hold)
            a.path, a.hold_path, a.hold_until = got.path, got.hold_path, got.hold_until
        return BasePullResult(str(ref), str(desc.digest), base_result.path, chosen, skipped, base_result)
    assert dest_dir is not None
    from modelpack.api.transfer import pull

    dir_result = pull(pinned, dest_dir, target_options=topts, jobs=jobs, progress=progress, force=force)
    for a in chosen:
        a.path = os.path.join(dest_dir, ADAPTERS_SUBDIR, a.name)
        _refuse_links(dest_dir, a.name)
        pull(a.reference, a.path, target_options=topts, jobs=jobs, progress=progress, force=force)
    return BasePullResult(str(ref), str(desc.digest), dest_dir, chosen, skipped, dir_result)


def _refuse_links(dest_dir: str, name: str) -> None:
    """``DEST/adapters`` and ``DEST/adapters/NAME`` must be directories of their own (or absent),
    never symlinks: whoever could write ``DEST`` must not send an adapter's files elsewhere."""
    for path in (os.path.join(dest_dir, ADAPTERS_SUBDIR), os.path.join(dest_dir, ADAPTERS_SUBDIR, name)):
        if os.path.islink(path) or (os.path.lexists(path) and not os.path.isdir(path)):
            raise PullError(
                f"{path}: is a symlink or not a directory; an adapter is written only into a directory"
            )


def _refuse_adapters_dir_in_base(manifest: Manifest, ref: Reference) -> None:
    from modelpack.mediatypes.annotations import layer_filepath

    for layer in manifest.layers:
        path = layer_filepath(layer.annotations) or ""
        if path == ADAPTERS_SUBDIR or path.startswith(ADAPTERS_SUBDIR + "/"):
            raise PullError(
                f"{ref}: the base has its own file {path}; its adapters cannot go under "
                f"{ADAPTERS_SUBDIR}/ — pull them by reference into a directory of their own"
            )


def list_adapters(
    reference: str | Reference, target_options: TargetOptions | None = None
) -> tuple[list[FoundAdapter], list[str]]:
    """The verified adapters of the base at ``reference``, and the listed entries skipped (why)."""
    ref = parse_reference(reference) if isinstance(reference, str) else reference
    target = open_readable(ref, (target_options or TargetOptions.from_environ()).bound_to(ref))
    desc = target.resolve(ref.identifier)
    listing = find_adapters(target, desc)
    return listing.adapters, listing.skipped


__all__ = [
    "ADAPTERS_SUBDIR",
    "AdapterPushResult",
    "BasePullResult",
    "SelectedAdapter",
    "list_adapters",
    "pull_with_adapters",
    "push_adapter",
]
