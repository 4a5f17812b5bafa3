"""Single-object calls on one bucket: typed errors named by key, and writes only where absent.

The S3 target and its multipart uploads share one ``S3Objects``, so what one learns about the
endpoint (that it rejects conditional writes) the other uses too, and their counters add up.

Blobs are immutable: a blob is written only if absent, with ``If-None-Match: *`` (AWS since
2024-08, MinIO, moto 5.2), so two writers racing on one digest cannot overwrite each other. An
endpoint that answers ``NotImplemented`` to the condition is remembered and served
HEAD-then-write instead (a race then writes identical bytes twice: the key is their digest).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from modelpack.errors import S3LayoutError
from modelpack.targets.s3.client import (
    client_errors,
    is_conflict,
    is_not_found,
    is_unsupported,
    wrap_client_error,
)
from modelpack.targets.s3.settings import S3Settings

log = logging.getLogger("modelpack.targets.s3")


class S3Objects:
    """Keys of one bucket through one boto3 client. ``name`` (``s3://bucket/prefix``) is for logs."""

    def __init__(self, client: Any, bucket: str, settings: S3Settings, name: str) -> None:
        self.client = client
        self.bucket = bucket
        self.settings = settings
        self.name = name
        # False once the endpoint refused a condition (or when settings turn conditions off)
        self.conditional = settings.conditional_writes != "off"
        self.stats = {"parts_uploaded": 0, "parts_reused": 0, "uploads_aborted": 0, "uploads_resumed": 0}
        self._stats_lock = threading.Lock()

    def count(self, what: str) -> None:
        with self._stats_lock:
            self.stats[what] += 1

    def where(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def call(self, operation: str, key: str, fn: Callable[..., Any], **kwargs: Any) -> Any:
        """``fn(Bucket=…, Key=key, **kwargs)``, its failure raised as a typed error naming the key."""
        try:
            return fn(Bucket=self.bucket, Key=key, **kwargs)
        except client_errors() as exc:
            raise wrap_client_error(exc, operation, self.where(key)) from exc

    def head_size(self, key: str) -> int | None:
        try:
            resp = self.client.head_object(Bucket=self.bucket, Key=key)
        except client_errors() as exc:
            if is_not_found(exc):
                return None
            raise wrap_client_error(exc, "HeadObject", self.where(key)) from exc
        return int(resp["ContentLength"])

    def get_small(self, key: str, limit: int, *, what: str) -> tuple[bytes, str] | None:
        """An object of at most ``limit`` bytes and its ETag, or None when absent."""
        try:
            resp = self.client.get_object(Bucket=self.bucket, Key=key)
        except client_errors() as exc:
            if is_not_found(exc):
                return None
            raise wrap_client_error(exc, "GetObject", self.where(key)) from exc
        body = resp["Body"]
        try:
            if int(resp.get("ContentLength") or 0) > limit:
                raise S3LayoutError(f"{self.where(key)}: {what} is larger than {limit} bytes; refusing it")
            data: bytes = body.read(limit + 1)
        except client_errors() as exc:
            raise wrap_client_error(exc, "GetObject", self.where(key)) from exc
        finally:
            body.close()
        if len(data) > limit:
            raise S3LayoutError(f"{self.where(key)}: {what} is larger than {limit} bytes; refusing it")
        return data, str(resp.get("ETag") or "")

    def put_if_absent(self, key: str, body: bytes, content_type: str) -> bool:
        """PutObject only if no object has the key; False when one already did."""
        kwargs: dict[str, Any] = {"Body": body, "ContentType": content_type}
        if self.conditional:
            try:
                self.client.put_object(Bucket=self.bucket, Key=key, IfNoneMatch="*", **kwargs)
                return True
            except client_errors() as exc:
                if is_conflict(exc):
                    return False
                if not (is_unsupported(exc) and self.settings.conditional_writes == "auto"):
                    raise wrap_client_error(exc, "PutObject", self.where(key)) from exc
                log.warning(
                    "%s: endpoint rejects conditional writes; falling back to HEAD-then-write", self.name
                )
                self.conditional = False
        if self.head_size(key) is not None:
            return False
        self.call("PutObject", key, self.client.put_object, **kwargs)
        return True
