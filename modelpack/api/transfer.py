"""push, pull, cp, tag, login, logout as Python functions (the CLI commands are skins over them).

All of them are ``modelpack.transfer.copy.copy`` between two targets, except pull (files at their paths,
``modelpack.transfer.materialize``) and login/logout (Docker-compatible credential storage). The
registry client (requests, urllib3) is imported by the targets that talk to a registry and by
login, never by importing this module.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from modelpack.api.artifacts import pack
from modelpack.errors import InvalidReferenceError, ManifestError, ModelpackError, PackError, SigningError
from modelpack.events import EventLog
from modelpack.mediatypes import SpecNames
from modelpack.oci.digest import Digest
from modelpack.oci.reference import Reference, parse_reference, validate_tag
from modelpack.oci.variant_selection import VariantSelector
from modelpack.packing.packer import PackOptions
from modelpack.settings import resolve_start_id
from modelpack.targets.opener import TargetOptions, open_readable, open_target
from modelpack.transfer.copy import CopyResult, copy
from modelpack.transfer.materialize import PullOptions, PullResult, pull_to_directory

if TYPE_CHECKING:
    from modelpack.mount.resolve import Pinned
    from modelpack.signing.keys import PrivateKey
    from modelpack.signing.verify import PolicyOrKeys


@dataclass
class PushResult:
    reference: str
    digest: str
    copy: CopyResult
    files: int | None = None
    signed: dict[str, Any] | None = None  # SignResult.to_json() when pushed with a signing key

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "reference": self.reference,
            "digest": self.digest,
            "transfer": self.copy.to_json(),
        }
        if self.files is not None:
            doc["files"] = self.files
        if self.signed is not None:
            doc["signed"] = self.signed
        return doc


def push(
    source: str,
    destination: str | Reference,
    *,
    pack_options: PackOptions | None = None,
    target_options: TargetOptions | None = None,
    jobs: int = 4,
    progress: str = "auto",
    format: str = "artifact",
    compression: str | None = None,
    sign_key: PrivateKey | str | None = None,
    sign_passphrase: str | bytes | None = None,
    mount_from: Sequence[str] = (),
    modelfile: str | None = None,
    spec_names: str | None = None,
) -> PushResult:
    """Push a checkpoint directory (packed on the fly, uploaded straight from its files) or an
    artifact at another reference (``oci:DIR:TAG``, ``s3://…``) to ``destination``.

    ``format="image"`` (directories only) pushes the image-shaped variant (``modelpack.packing.image_format``).

    With ``sign_key`` (a loaded key, a PEM path or ``env:VAR``) the key is loaded before anything
    is uploaded, and the tag is written last: manifest by digest → signatures (read back until
    discoverable) → tag. Whatever fails on the way, no tag points at an unsigned model; an
    earlier version under the same tag stays where it was.

    Into a registry, a blob the destination lacks is mounted from ``mount_from`` (repositories of
    the same registry) or from where this user pushed it before (``transfer.pushed_blobs``).

    ``spec_names`` (``cncf``/``cnai``) names the ModelPack media types written: a directory is
    packed in that naming (over ``pack_options.spec_names``); a stored artifact is respelled as
    ``cp`` does. None: a directory in ``pack_options``' naming, a stored artifact as it is.
    """
    dst = parse_reference(destination) if isinstance(destination, str) else destination
    if dst.digest:
        raise InvalidReferenceError(f"{dst}: push to a tag, not a digest (the digest is computed)")
    target_options = (target_options or TargetOptions.from_environ()).bound_to(
        dst
    )  # credentials: the destination's
    key = _signing_key(sign_key, sign_passphrase)
    tag = dst.tag or "latest"
    files: int | None = None
    if os.path.isdir(source) or source.startswith("hf://") or _is_s3_checkpoint(source, target_options):
        opts = pack_options or PackOptions(progress=progress)
        if spec_names is not None:
            opts = dataclasses.replace(opts, spec_names=spec_names)
        packed = pack(
            source,
            dst.with_tag(tag),
            opts,
            target_options,
            jobs=jobs,
            format=format,
            compression=compression,
            tag=key is None,
            mount_from=mount_from,
            modelfile=modelfile,
        )
        digest, copied, files = packed.artifact.digest, packed.copy, len(packed.artifact.files)
    else:
        if modelfile:
            raise PackError(f"{source}: --modelfile applies when pushing a context directory")
        _refuse_missing_directory(source)
        if format != "artifact" or compression:
            raise InvalidReferenceError(f"{source}: --format/--compression apply when pushing a directory")
        src_ref = parse_reference(source)
        src = open_readable(src_ref, target_options)
        dst_target = open_target(dst, target_options, for_write=True)
        copied = copy(
            src,
            dst_target,
            src_ref.identifier,
            tag if key is None else None,
            jobs=jobs,
            progress=progress,
            mount_from=mount_from,
            spec_names=_spec_names(spec_names),
        )
        digest = copied.descriptor.digest
    result = PushResult(str(dst.with_tag(tag)), str(digest), copied, files)
    if key is not None:
        result.signed = _sign_then_tag(source, dst, tag, digest, key, target_options)
    return result


def _signing_key(sign_key: PrivateKey | str | None, passphrase: str | bytes | None) -> PrivateKey | None:
    """The signing key, loaded (and so checked) before the first byte goes out: a public key,
    an unset ``env:`` variable or a wrong passphrase must fail a push that has uploaded nothing."""
    if sign_key is None:
        return None
    from modelpack.signing.keys import PrivateKey, load_private_key

    return sign_key if isinstance(sign_key, PrivateKey) else load_private_key(sign_key, passphrase)


def _sign_then_tag(
    source: str,
    dst: Reference,
    tag: str,
    digest: Digest,
    key: PrivateKey,
    target_options: TargetOptions | None,
) -> dict[str, Any]:
    """Sign the manifest pushed by digest, then point ``tag`` at it: the tag is the last write."""
    from modelpack.signing import sign_artifact
    from modelpack.signing.chunks import chunk_table_from_directory
    from modelpack.targets.fetch import fetch_manifest

    target = open_target(dst, target_options, for_write=True)
    manifest, _ = fetch_manifest(target, str(digest))
    desc = target.resolve(str(digest))
    # hashed from the files just uploaded when they are the layers (no second download)
    table = chunk_table_from_directory(source, manifest, aligned=True) if os.path.isdir(source) else None
    try:
        signed = sign_artifact(target, desc, key, chunk_table=table or True, reference=dst.with_tag(tag))
    except ModelpackError as exc:
        raise SigningError(
            f"{dst.with_tag(tag)}: signing failed, so the tag was not written (the model is stored "
            f"untagged as {digest}; run the push again): {exc}"
        ) from exc
    target.tag(desc, tag)
    return signed.to_json()


def _refuse_missing_directory(source: str) -> None:
    """A SOURCE written as a path is a checkpoint directory that is not there, never a reference
    (``./nope`` would otherwise read as the registry host ``.``)."""
    looks_like_path = source in (".", "..") or source.startswith(("/", "./", "../", "~"))
    if looks_like_path or (os.path.exists(source) and ":" not in source):
        what = "is not a directory" if os.path.exists(source) else "does not exist"
        raise PackError(
            f"checkpoint directory {source} {what}; SOURCE is a directory, oci:LAYOUT:TAG, "
            "s3://BUCKET/PREFIX or a registry reference"
        )


def _is_s3_checkpoint(source: str, target_options: TargetOptions | None) -> bool:
    """``s3://BUCKET/PREFIX/`` holding plain checkpoint files (not an OCI layout): pack it."""
    if not source.startswith("s3://"):
        return False
    from modelpack.packing.s3_checkpoint import is_s3_checkpoint

    return is_s3_checkpoint(source, target_options)


def cp(
    source: str | Reference,
    destination: str | Reference,
    *,
    target_options: TargetOptions | None = None,
    jobs: int = 4,
    referrers: bool = False,
    progress: str = "auto",
    spec_names: str | None = None,
) -> CopyResult:
    """Copy an artifact (and, with ``referrers``, its signatures etc.) between any two targets.

    The destination keeps the source's tag unless it names its own; a digest-only source is
    pushed by digest. ``spec_names`` (``cncf``/``cnai``) writes the model manifest with its
    ModelPack media types in that naming: the same blobs under a new manifest digest (refused
    with ``referrers``, for an index, and for a manifest that is not a model).
    """
    src_ref = parse_reference(source) if isinstance(source, str) else source
    dst_ref = parse_reference(destination) if isinstance(destination, str) else destination
    if dst_ref.digest:
        raise InvalidReferenceError(f"{dst_ref}: copy to a tag (or a bare repository), not a digest")
    target_options = (target_options or TargetOptions.from_environ()).bound_to(
        dst_ref
    )  # credentials: the destination's
    src = open_readable(src_ref, target_options)
    dst = open_target(dst_ref, target_options, for_write=True)
    tag = dst_ref.tag or src_ref.tag
    return copy(
        src,
        dst,
        src_ref.identifier,
        tag,
        jobs=jobs,
        referrers=referrers,
        progress=progress,
        spec_names=_spec_names(spec_names),
    )


def _spec_names(value: str | None) -> SpecNames | None:
    """``--spec-names`` as the vocabulary's member; an unknown naming is refused, listing both."""
    if value is None:
        return None
    try:
        return SpecNames(value)
    except ValueError:
        raise ManifestError(f"spec names {str(value)[:40]!r}: choose one of {', '.join(SpecNames)}") from None


def tag(reference: str | Reference, new_tag: str, *, target_options: TargetOptions | None = None) -> str:
    """Point ``new_tag`` at what ``reference`` names, in the same repository; returns the digest."""
    ref = parse_reference(reference) if isinstance(reference, str) else reference
    validate_tag(new_tag)
    target = open_target(ref, (target_options or TargetOptions.from_environ()).bound_to(ref), for_write=True)
    desc = target.resolve(ref.identifier)
    target.tag(desc, new_tag)
    return str(desc.digest)


def pull(
    reference: str | Reference,
    dest_dir: str,
    options: PullOptions | None = None,
    *,
    target_options: TargetOptions | None = None,
    policy: PolicyOrKeys | str | None = None,
    variant: VariantSelector | Sequence[str] | Mapping[str, str] | None = None,
    events: EventLog | None = None,
    include: Sequence[str] = (),
    exclude: Sequence[str] = (),
    jobs: int = 4,
    progress: str = "auto",
    force: bool = False,
    delete: bool = False,
    max_bytes: int | None = None,
    keep_prefix: bool = False,
) -> PullResult:
    """Files of the artifact at ``reference`` into ``dest_dir``, each verified before it appears.

    Trust comes first, as for ``modelpack pull`` (``mount.resolve.resolve_trusted``): under
    ``policy`` (a ``TrustPolicy``, public keys, or a policy file path) the signature is verified
    and the digest pinned before any file is written (``SignatureRefused`` otherwise). A
    reference naming an index of variants gives the entry ``variant`` selects (a
    ``VariantSelector``, or fields such as ``["precision=bf16"]``; under a policy the index and
    the entry are both verified). A file filter never skips these checks.

    A container image (the image-shaped variant, a KServe modelcar) gives the files of its
    ``models/`` directory, at their paths below it (``keep_prefix``: below ``models/``).

    A file at the destination that differs from the artifact's raises ``DestinationConflictError``
    unless ``force``; files the artifact does not contain are reported in ``extra_files`` and
    removed only with ``delete``. What is written (tar layers as they expand) is capped by the
    free space, or by ``max_bytes``. The keywords ``include`` … ``keep_prefix`` are the fields of
    ``PullOptions``; pass either them or ``options``.
    """
    keywords = PullOptions(
        include=tuple(include),
        exclude=tuple(exclude),
        jobs=jobs,
        progress=progress,
        force=force,
        delete=delete,
        max_bytes=max_bytes,
        keep_prefix=keep_prefix,
    )
    if options is not None and keywords != PullOptions():
        given = [f.name for f in dataclasses.fields(PullOptions) if getattr(keywords, f.name) != f.default]
        raise TypeError(f"pull(): give options= or {', '.join(given)}, not both")
    if isinstance(variant, VariantSelector) or variant is None:
        selector = variant
    else:
        selector = VariantSelector.from_options(variant)
    _, result = pull_trusted(
        reference,
        dest_dir,
        options or keywords,
        target_options=target_options,
        policy=policy,
        selector=selector,
        events=events,
    )
    return result


def pull_trusted(
    reference: str | Reference,
    dest_dir: str,
    options: PullOptions,
    *,
    target_options: TargetOptions | None = None,
    policy: PolicyOrKeys | str | None = None,
    selector: VariantSelector | None = None,
    events: EventLog | None = None,
) -> tuple[Pinned, PullResult]:
    """``pull``, also returning what the trust step decided (the CLI prints the variant taken and
    writes a model_signing signature with the policy's keys)."""
    from modelpack.mount.resolve import resolve_trusted  # the node cache's modules: only when pulling

    ref = parse_reference(reference) if isinstance(reference, str) else reference
    pinned = resolve_trusted(
        ref,
        policy=policy,
        selector=selector,
        target_options=(target_options or TargetOptions.from_environ()).bound_to(ref),
        events=events,
    )
    result = pull_to_directory(pinned.target, pinned.digest, dest_dir, options)
    pinned.accept()
    result.reference = str(ref)
    result.start_id = resolve_start_id()
    if pinned.verification is not None:
        result.signature = str(pinned.verification.status)
    if pinned.variant is not None:
        result.variant = pinned.variant.to_json()
    return pinned, result


def _host(registry: str) -> str:
    host = registry.split("://", 1)[-1].split("/", 1)[0]
    if not host:
        raise InvalidReferenceError(f"{registry!r} is not a registry host")
    return host


def login(registry: str, username: str, password: str, *, target_options: TargetOptions | None = None) -> str:
    """Check the credentials against the registry, then store them where ``docker login`` would.

    Returns where they were stored (config path or credential helper); nothing is stored when
    the registry refuses them.
    """
    from modelpack.targets.registry.auth import Credentials, store_credentials
    from modelpack.targets.registry.client import RegistryClient

    host = _host(registry)
    opts = target_options or TargetOptions.from_environ()
    creds = Credentials(username, password, source="login")
    client = RegistryClient(
        host,
        plain_http=opts.plain_http,
        ca_file=opts.ca_file,
        insecure_skip_verify=opts.insecure_skip_verify,
        credentials=creds,
        timeout=opts.timeout,
    )
    try:
        client.ping()
        if client.auth.scheme == "bearer":
            # /v2/ may be open to anyone; make sure the token service accepts these credentials
            client.auth.header(())
    finally:
        client.close()
    return store_credentials(host, creds)


def logout(registry: str) -> bool:
    from modelpack.targets.registry.auth import erase_credentials

    return erase_credentials(_host(registry))
