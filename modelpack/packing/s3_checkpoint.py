"""Pack a checkpoint that lives in S3 as plain files, streaming it: nothing lands on local disk.

``modelpack pack s3://BUCKET/CHECKPOINT_PREFIX/ DEST`` lists the objects under the prefix, hashes
each one by streaming it (objects in parallel threads; hashlib releases the GIL), validates every
safetensors header with a range read, and builds the same manifest ``modelpack.packing.packer`` builds
for a local directory holding the same files (same classification, config inference, annotations,
so the manifest digest is identical). The result is a ``PackedArtifact`` whose files open as S3
streams; ``copy()`` then streams each object a second time into the destination, whose writer
checks the digest again.

Both reads are pinned to the ETag seen when listing (``If-Match``): if an object is replaced
between hashing and uploading, the upload fails instead of publishing bytes nobody hashed.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, BinaryIO, cast

from modelpack.errors import InvalidReferenceError, PackError, UnsafePathError
from modelpack.file_selection import matches_pattern
from modelpack.mediatypes import LayerKind
from modelpack.mediatypes.annotations import safe_relative_path
from modelpack.oci.digest import HASH_CHUNK, Digest
from modelpack.packing.model_config import MAX_CONFIG_JSON, parse_checkpoint_json
from modelpack.packing.packer import (
    OTHER_FILE_CHOICES,
    PackedArtifact,
    PackedFile,
    PackOptions,
    classify,
    describe_model,
)
from modelpack.packing.safetensors_format import SafetensorsHeader, header_length, parse_header_bytes
from modelpack.progress import Progress
from modelpack.targets.s3.client import client_errors, is_not_found, make_client, wrap_client_error
from modelpack.targets.s3.stream import S3Patience, S3ReadStream

if TYPE_CHECKING:
    from modelpack.targets.options import TargetOptions

_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_NAME_RE = re.compile(r"[^A-Za-z0-9._-]+")
HEADER_PROBE = 64 * 1024


def is_s3_url(text: str) -> bool:
    return isinstance(text, str) and text.startswith("s3://")


def parse_s3_url(url: str) -> tuple[str, str]:
    """``s3://bucket/some/prefix/`` → (bucket, ``some/prefix``). No tag or digest here."""
    if not is_s3_url(url):
        raise InvalidReferenceError(f"{url!r} is not an s3:// URL")
    body = url[5:].strip("/")
    bucket, _, prefix = body.partition("/")
    if not _BUCKET_RE.match(bucket):
        raise InvalidReferenceError(f"{url!r}: {bucket!r} is not a valid S3 bucket name")
    if ".." in prefix.split("/"):
        raise InvalidReferenceError(f"{url!r}: '..' in the S3 prefix")
    return bucket, prefix


def is_s3_checkpoint(url: str, target_options: TargetOptions | None = None, *, client: Any = None) -> bool:
    """Whether ``url`` names plain checkpoint files rather than an OCI layout in the bucket.

    ``s3://B/P:TAG`` and ``…@sha256:…`` are layout references. Otherwise the prefix is a layout
    when it holds an ``oci-layout`` object, else it is a checkpoint (one HEAD request).
    """
    if not is_s3_url(url):
        return False
    body = url[5:].rstrip("/")
    if "@" in body or ":" in body.rsplit("/", 1)[-1]:
        return False
    bucket, prefix = parse_s3_url(url)
    if client is None:
        client = make_client(
            target_options.s3_endpoint if target_options else None,
            target_options.s3_region if target_options else None,
        )
    key = f"{prefix}/oci-layout" if prefix else "oci-layout"
    try:
        client.head_object(Bucket=bucket, Key=key)
    except client_errors() as exc:
        if is_not_found(exc):
            return True
        raise wrap_client_error(exc, "HeadObject", f"s3://{bucket}/{key}") from exc
    return False


@dataclass(frozen=True)
class S3Object:
    key: str
    relpath: str
    size: int
    etag: str


def _refuse_unplain_key(bucket: str, key: str, rel: str) -> None:
    """Raise ``PackError`` naming ``s3://bucket/key`` unless ``rel`` is a plain relative path
    (a trailing ``/`` of a directory marker aside)."""
    parts = (rel[:-1] if rel.endswith("/") else rel).split("/")
    odd = next((p for p in parts if p in ("", ".", "..")), None)
    if odd is not None:
        shown = repr(odd) if odd else "an empty"
        raise PackError(
            f"s3://{bucket}/{key}: object key {rel!r} has {shown} path component; refusing to pack "
            "it (rename the object: such a key does not name the file it would become)"
        )
    try:
        safe_relative_path(rel.rstrip("/"), what="object key")
    except UnsafePathError as exc:
        raise PackError(f"s3://{bucket}/{key}: {exc}; refusing to pack it") from exc


def list_checkpoint(
    client: Any, bucket: str, prefix: str, include: Sequence[str] = (), exclude: Sequence[str] = ()
) -> list[S3Object]:
    """The objects to pack under ``prefix``, sorted by path parts, as ``discover_files`` does.

    Directory markers (keys ending in ``/``) and hidden entries (``.cache/…``) are skipped. A key
    that is not a plain relative path is refused, naming it: an empty, ``.`` or ``..`` component
    (``a//b``, ``./x``, ``sub/../x``; an S3 key is a name, not a path, so such a key would land
    somewhere else than it says, or collide with another), a leading ``/``, NUL, a backslash or a
    control character (``mediatypes.annotations.safe_relative_path``).
    """
    where = f"s3://{bucket}/{prefix}"
    base = f"{prefix}/" if prefix else ""
    out: list[S3Object] = []
    kwargs: dict[str, Any] = {"Bucket": bucket, "Prefix": base}
    while True:
        try:
            resp = client.list_objects_v2(**kwargs)
        except client_errors() as exc:
            raise wrap_client_error(exc, "ListObjectsV2", where) from exc
        for obj in resp.get("Contents", []):
            key = str(obj["Key"])
            rel = key[len(base) :]
            if not rel:
                continue  # the prefix's own marker
            _refuse_unplain_key(bucket, key, rel)
            if rel.endswith("/"):
                continue  # a "directory" marker
            if any(part.startswith(".") for part in rel.split("/")):
                continue  # hidden (``.cache/…``); ``.`` and ``..`` were refused above
            if include and not matches_pattern(rel, include):
                continue
            if exclude and matches_pattern(rel, exclude):
                continue
            out.append(S3Object(key, rel, int(obj["Size"]), str(obj.get("ETag") or "")))
        if not resp.get("IsTruncated"):
            break
        kwargs["ContinuationToken"] = resp["NextContinuationToken"]
    out.sort(key=lambda o: o.relpath.split("/"))
    if not out:
        raise PackError(f"{where}: no objects to pack (empty prefix, or everything excluded)")
    return out


class _Reader:
    """Opens pinned (``If-Match``) streams and ranges of one bucket's objects."""

    def __init__(self, client: Any, bucket: str, patience: S3Patience | None = None) -> None:
        self.client = client
        self.bucket = bucket
        self.patience = patience or S3Patience()

    def where(self, obj: S3Object) -> str:
        return f"s3://{self.bucket}/{obj.key}"

    def open(self, obj: S3Object, offset: int = 0) -> BinaryIO:
        stream = S3ReadStream(
            self.client,
            self.bucket,
            obj.key,
            offset,
            obj.size,
            self.where(obj),
            etag=obj.etag or None,
            patience=self.patience,
        )
        return cast(BinaryIO, stream)

    def opener(self, obj: S3Object) -> Callable[[int], BinaryIO]:
        return lambda offset: self.open(obj, offset)

    def read_range(self, obj: S3Object, offset: int, length: int) -> bytes:
        with self.open(obj, offset) as f:
            chunks = []
            got = 0
            while got < length:
                data = f.read(min(length - got, HASH_CHUNK))
                if not data:
                    break
                chunks.append(data)
                got += len(data)
        return b"".join(chunks)

    def header(self, obj: S3Object) -> SafetensorsHeader:
        """Strict safetensors header check from at most two range reads."""
        where = self.where(obj)
        probe = self.read_range(obj, 0, min(obj.size, HEADER_PROBE)) if obj.size >= 8 else b""
        n = header_length(where, probe[:8], obj.size)
        header = probe[8 : 8 + n]
        if len(header) < n:
            header += self.read_range(obj, len(probe), 8 + n - len(probe))
        return parse_header_bytes(where, probe[:8], header, obj.size)

    def hash(self, obj: S3Object, progress: Progress) -> Digest:
        h = hashlib.sha256()
        with self.open(obj) as f:
            while True:
                data = f.read(HASH_CHUNK)
                if not data:
                    break
                h.update(data)
                progress.update(len(data))
        return Digest.from_hex(h.hexdigest())


def build_s3_artifact(
    url: str,
    opts: PackOptions | None = None,
    target_options: TargetOptions | None = None,
    *,
    client: Any = None,
) -> PackedArtifact:
    """Validate, hash and describe the checkpoint under ``url`` without downloading it to disk."""
    opts = opts or PackOptions()
    opts.check(OTHER_FILE_CHOICES)
    bucket, prefix = parse_s3_url(url)
    if client is None:
        client = make_client(
            target_options.s3_endpoint if target_options else None,
            target_options.s3_region if target_options else None,
            max_pool=32,
        )
    reader = _Reader(client, bucket, S3Patience(target_options.retry_for if target_options else None))
    objects = list_checkpoint(client, bucket, prefix, opts.include, opts.exclude)
    reader.patience.answered = True  # the listing came back: from now on an outage is waited for
    kinds: list[tuple[S3Object, LayerKind, bool]] = []
    for obj in objects:
        kind, untested = classify(obj.relpath, opts.other_files)
        if kind is None:
            raise PackError(f"{reader.where(obj)}: not a recognised model file and --other-files=refuse")
        kinds.append((obj, kind, untested))
    jobs = max(1, min(opts.jobs or 8, len(objects)))
    tensors = [o for o in objects if o.relpath.endswith(".safetensors")]
    with ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="modelpack-s3-pack") as pool:
        headers = dict(zip((o.relpath for o in tensors), pool.map(reader.header, tensors), strict=True))
        if opts.max_file_size and any(h.file_size > opts.max_file_size for h in headers.values()):
            raise PackError(
                f"{url}: --max-file-size re-sharding needs local files; it is not supported for s3:// "
                "checkpoints (re-shard before uploading, or pack from a local copy)"
            )
        total = sum(o.size for o in objects)
        with Progress(total, "hash", opts.progress) as prog:
            order = sorted(range(len(objects)), key=lambda i: -objects[i].size)
            digests = dict(zip(order, pool.map(lambda i: reader.hash(objects[i], prog), order), strict=True))
    packed = [
        PackedFile(
            obj.relpath,
            reader.where(obj),
            kind,
            untested,
            obj.size,
            digests[i],
            opener=reader.opener(obj),
        )
        for i, (obj, kind, untested) in enumerate(kinds)
    ]
    hf_config = None
    for obj in objects:
        if obj.relpath == "config.json":
            if obj.size > MAX_CONFIG_JSON:
                raise PackError(
                    f"{reader.where(obj)}: larger than {MAX_CONFIG_JSON} bytes; refusing to parse"
                )
            doc = parse_checkpoint_json(reader.read_range(obj, 0, obj.size), reader.where(obj))
            hf_config = doc if isinstance(doc, dict) else None
    last = prefix.rsplit("/", 1)[-1] if prefix else bucket
    default_name = _NAME_RE.sub("-", last) or "model"
    spec, config_bytes, manifest = describe_model(packed, headers, hf_config, opts, default_name)
    name = f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"
    return PackedArtifact(manifest, spec, config_bytes, packed, name=name)


__all__ = [
    "S3Object",
    "build_s3_artifact",
    "is_s3_checkpoint",
    "is_s3_url",
    "list_checkpoint",
    "parse_s3_url",
]
