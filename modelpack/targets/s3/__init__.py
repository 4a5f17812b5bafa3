"""An OCI image layout stored in an S3 bucket, as a Target: object storage as the authoritative copy.

Objects under ``s3://BUCKET/PREFIX``: ``oci-layout``, ``index.json`` and ``blobs/sha256/<hex>``,
the layout ``modelpack.targets.layout`` writes to a directory. The rules, each explained where it
is kept:

- ``settings``: transfer tuning (part size, multipart threshold, concurrency, conditional writes).
- ``client``: the boto3 client from the standard credential chain; botocore errors → typed errors.
- ``objects``: single-object calls; blobs are immutable, written only if absent.
- ``stream``: ranged reads that resume a dropped connection, pinned to the object's ETag.
- ``multipart``: large blobs, hashed while they upload, completed only when the digest matched;
  an interrupted upload is resumed on the next push.
- ``target``: ``S3Target``, the Target protocol; ``index.json`` updated with conditional writes.

Names resolve on first use, so importing this package loads neither boto3 nor the modules a
caller does not need (``modelpack.targets.opener`` imports it only for an ``s3://`` reference).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from modelpack.errors import S3Error, S3LayoutError
    from modelpack.targets.s3.client import (
        client_errors,
        endpoint_from_env,
        error_code,
        is_conflict,
        is_not_found,
        is_unsupported,
        make_client,
        wrap_client_error,
    )
    from modelpack.targets.s3.multipart import MultipartUploader
    from modelpack.targets.s3.objects import S3Objects
    from modelpack.targets.s3.settings import DEFAULT_CONCURRENCY, DEFAULT_PART_SIZE, MAX_PARTS, S3Settings
    from modelpack.targets.s3.stream import S3ReadStream
    from modelpack.targets.s3.target import LAYOUT_FILE, MAX_INDEX_BYTES, MAX_MANIFEST_BYTES, S3Target

_EXPORTS = {
    "S3Error": "modelpack.errors",
    "S3LayoutError": "modelpack.errors",
    "client_errors": "modelpack.targets.s3.client",
    "endpoint_from_env": "modelpack.targets.s3.client",
    "error_code": "modelpack.targets.s3.client",
    "is_conflict": "modelpack.targets.s3.client",
    "is_not_found": "modelpack.targets.s3.client",
    "is_unsupported": "modelpack.targets.s3.client",
    "make_client": "modelpack.targets.s3.client",
    "wrap_client_error": "modelpack.targets.s3.client",
    "MultipartUploader": "modelpack.targets.s3.multipart",
    "S3Objects": "modelpack.targets.s3.objects",
    "DEFAULT_CONCURRENCY": "modelpack.targets.s3.settings",
    "DEFAULT_PART_SIZE": "modelpack.targets.s3.settings",
    "MAX_PARTS": "modelpack.targets.s3.settings",
    "S3Settings": "modelpack.targets.s3.settings",
    "S3ReadStream": "modelpack.targets.s3.stream",
    "LAYOUT_FILE": "modelpack.targets.s3.target",
    "MAX_INDEX_BYTES": "modelpack.targets.s3.target",
    "MAX_MANIFEST_BYTES": "modelpack.targets.s3.target",
    "S3Target": "modelpack.targets.s3.target",
}


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


__all__ = [
    "DEFAULT_CONCURRENCY",
    "DEFAULT_PART_SIZE",
    "LAYOUT_FILE",
    "MAX_INDEX_BYTES",
    "MAX_MANIFEST_BYTES",
    "MAX_PARTS",
    "MultipartUploader",
    "S3Error",
    "S3LayoutError",
    "S3Objects",
    "S3ReadStream",
    "S3Settings",
    "S3Target",
    "client_errors",
    "endpoint_from_env",
    "error_code",
    "is_conflict",
    "is_not_found",
    "is_unsupported",
    "make_client",
    "wrap_client_error",
]
