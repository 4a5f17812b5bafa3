"""Transfer tuning for S3 targets: part size, multipart threshold, concurrency, conditional writes.

Settings come from ``TargetOptions.extra`` first and the environment second, so one process can
tune a single target without changing what every other command sees.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

MIB = 1024 * 1024
DEFAULT_PART_SIZE = 16 * MIB
DEFAULT_CONCURRENCY = 8
MAX_PARTS = 10_000


@dataclass
class S3Settings:
    """Transfer tuning. ``part_size`` must be ≥ 5 MiB on AWS and MinIO (the server enforces it)."""

    part_size: int = DEFAULT_PART_SIZE
    multipart_threshold: int | None = None  # blobs larger than this go multipart; None = part_size
    concurrency: int = DEFAULT_CONCURRENCY  # parts in flight per target (bounds memory)
    conditional_writes: str = "auto"  # auto | on | off

    def __post_init__(self) -> None:
        if self.part_size < 1:
            raise ValueError("S3 part size must be positive")
        if self.concurrency < 1:
            raise ValueError("S3 concurrency must be at least 1")
        if self.conditional_writes not in ("auto", "on", "off"):
            raise ValueError("conditional_writes must be auto, on or off")

    @property
    def threshold(self) -> int:
        return self.part_size if self.multipart_threshold is None else self.multipart_threshold

    @classmethod
    def from_options(cls, extra: dict[str, Any] | None = None) -> S3Settings:
        """From ``TargetOptions.extra`` (``s3_part_size``, ``s3_concurrency``, …), else the env."""
        extra = extra or {}

        def pick(key: str, env: str) -> Any:
            if extra.get(key) is not None:
                return extra[key]
            return os.environ.get(env) or None

        s = cls()
        if (v := pick("s3_part_size", "MODELPACK_S3_PART_SIZE")) is not None:
            s.part_size = int(v)
        if (v := pick("s3_multipart_threshold", "MODELPACK_S3_MULTIPART_THRESHOLD")) is not None:
            s.multipart_threshold = int(v)
        if (v := pick("s3_concurrency", "MODELPACK_S3_CONCURRENCY")) is not None:
            s.concurrency = int(v)
        if (v := pick("s3_conditional_writes", "MODELPACK_S3_CONDITIONAL_WRITES")) is not None:
            s.conditional_writes = str(v)
        s.__post_init__()
        return s
