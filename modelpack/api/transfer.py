"""push, pull, cp, tag, login, logout as Python functions (the CLI commands are skins over them).

All of them are ``modelpack.transfer.copy.copy`` between two targets, except pull (files at their paths,
``modelpack.transfer.materialize``) and login/logout (Docker-compatible credential storage). The
registry client (requests, urllib3) is imported by the targets that talk to a registry and by
login, never by importing this module.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from modelpack.api import pack
from modelpack.errors import InvalidReferenceError
from modelpack.oci.reference import Reference, parse_reference, validate_tag
from modelpack.packing.packer import PackOptions
from modelpack.targets.opener import TargetOptions, open_readable, open_target
from modelpack.transfer.copy import CopyResult, copy
from modelpack.transfer.materialize import PullResult, pull_to_directory


@dataclass
class PushResult:
    reference: str
    digest: str
    copy: CopyResult
    files: int | None = None

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "reference": self.reference,
            "digest": self.digest,
            "transfer": self.copy.to_json(),
        }
        if self.files is not None:
            doc["files"] = self.files
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
) -> PushResult:
    """Push a checkpoint directory (packed on the fly, uploaded straight from its files) or an
    artifact at another reference (``oci:DIR:TAG``, ``s3://…``) to ``destination``.

    ``format="image"`` (directories only) pushes the image-shaped variant (``modelpack.packing.image_format``).
    """
    dst = parse_reference(destination) if isinstance(destination, str) else destination
    if dst.digest:
        raise InvalidReferenceError(f"{dst}: push to a tag, not a digest (the digest is computed)")
    if os.path.isdir(source) or _is_s3_checkpoint(source, target_options):
        opts = pack_options or PackOptions(progress=progress)
        result = pack(source, dst, opts, target_options, jobs=jobs, format=format, compression=compression)
        return PushResult(
            result.reference, str(result.artifact.digest), result.copy, len(result.artifact.files)
        )
    if format != "artifact" or compression:
        raise InvalidReferenceError(f"{source}: --format/--compression apply when pushing a directory")
    src_ref = parse_reference(source)
    tag = dst.tag or "latest"
    res = cp(src_ref, dst.with_tag(tag), target_options=target_options, jobs=jobs, progress=progress)
    return PushResult(str(dst.with_tag(tag)), str(res.descriptor.digest), res)


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
) -> CopyResult:
    """Copy an artifact (and, with ``referrers``, its signatures etc.) between any two targets.

    The destination keeps the source's tag unless it names its own; a digest-only source is
    pushed by digest.
    """
    src_ref = parse_reference(source) if isinstance(source, str) else source
    dst_ref = parse_reference(destination) if isinstance(destination, str) else destination
    if dst_ref.digest:
        raise InvalidReferenceError(f"{dst_ref}: copy to a tag (or a bare repository), not a digest")
    src = open_readable(src_ref, target_options)
    dst = open_target(dst_ref, target_options, for_write=True)
    tag = dst_ref.tag or src_ref.tag
    return copy(src, dst, src_ref.identifier, tag, jobs=jobs, referrers=referrers, progress=progress)


def tag(reference: str | Reference, new_tag: str, *, target_options: TargetOptions | None = None) -> str:
    """Point ``new_tag`` at what ``reference`` names, in the same repository; returns the digest."""
    ref = parse_reference(reference) if isinstance(reference, str) else reference
    validate_tag(new_tag)
    target = open_target(ref, target_options, for_write=True)
    desc = target.resolve(ref.identifier)
    target.tag(desc, new_tag)
    return str(desc.digest)


def pull(
    reference: str | Reference,
    dest_dir: str,
    *,
    target_options: TargetOptions | None = None,
    include: tuple[str, ...] = (),
    exclude: tuple[str, ...] = (),
    jobs: int = 4,
    progress: str = "auto",
) -> PullResult:
    """Files of the artifact at ``reference`` into ``dest_dir``, each verified before it appears."""
    ref = parse_reference(reference) if isinstance(reference, str) else reference
    target = open_readable(ref, target_options)
    return pull_to_directory(
        target, ref.identifier, dest_dir, include=include, exclude=exclude, jobs=jobs, progress=progress
    )


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
    opts = target_options or TargetOptions()
    creds = Credentials(username, password, source="login")
    client = RegistryClient(
        host,
        plain_http=opts.plain_http,
        ca_file=opts.ca_file,
        insecure_skip_verify=opts.insecure_skip_verify,
        credentials=creds,
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
