"""Transfer tuning for S3 targets: part size, multipart threshold, concurrency, conditional writes.

Settings come from ``TargetOptions.s3`` (an ``S3Tuning``), which ``TargetOptions.from_environ``
fills from ``MODELPACK_S3_*``; a caller may tune a single target without changing what every
other command sees.
"""

from __future__ import annotations

from dataclasses import dataclass

from modelpack.targets.options import S3Tuning

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
    def from_options(cls, tuning: S3Tuning | None = None) -> S3Settings:
        """From ``TargetOptions.s3`` (filled from ``MODELPACK_S3_*`` by ``TargetOptions.from_environ``);
        a field left None keeps its default."""
        t = tuning or S3Tuning()
        s = cls()
        if t.part_size is not None:
            s.part_size = t.part_size
        if t.multipart_threshold is not None:
            s.multipart_threshold = t.multipart_threshold
        if t.concurrency is not None:
            s.concurrency = t.concurrency
        if t.conditional_writes is not None:
            s.conditional_writes = t.conditional_writes
        s.__post_init__()
        return s
