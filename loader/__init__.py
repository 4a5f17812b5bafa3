"""The streaming loader: weights → GPU ranks, verified at every hop (docs/loader.md).

``iter_tensors`` / ``load_state_dict`` / ``load_into`` read a node-cache snapshot or stream a
pinned reference by range reads, give each tensor-parallel rank only its shard, verify chunks
against the signed chunk table (or whole layers against the manifest) before serving any byte,
and refuse a load whose manifest digest or compatibility fingerprint does not match.
"""

from __future__ import annotations

from modelpack.loader.fingerprint import (
    FINGERPRINT_FILE,
    LOADER_FORMAT_VERSION,
    Fingerprint,
    check_fingerprint,
)
from modelpack.loader.options import LoaderOptions, LoadStats
from modelpack.loader.pipeline import (
    PreparedLoad,
    emit_check,
    iter_tensors,
    load_into,
    load_state_dict,
    prepare,
)
from modelpack.loader.plan import DEFAULT_RULES, ReadPlan, ShardRule
from modelpack.loader.request import LoadFields, LoadRequest
from modelpack.loader.stream_through import CacheStream, StreamReport

from modelpack.errors import (
    ExpectedDigestError,
    FingerprintFileError,
    FingerprintMismatchError,
    LoaderError,
    PlanError,
    SourceError,
    TruncatedSourceError,
    UnpinnedReferenceError,
    UnsupportedDtypeError,
    UnverifiedSourceError,
)

__all__ = [
    "DEFAULT_RULES",
    "FINGERPRINT_FILE",
    "LOADER_FORMAT_VERSION",
    "CacheStream",
    "ExpectedDigestError",
    "Fingerprint",
    "FingerprintFileError",
    "FingerprintMismatchError",
    "LoadFields",
    "LoadRequest",
    "LoadStats",
    "LoaderError",
    "LoaderOptions",
    "PlanError",
    "PreparedLoad",
    "ReadPlan",
    "ShardRule",
    "SourceError",
    "StreamReport",
    "TruncatedSourceError",
    "UnpinnedReferenceError",
    "UnsupportedDtypeError",
    "UnverifiedSourceError",
    "check_fingerprint",
    "emit_check",
    "iter_tensors",
    "load_into",
    "load_state_dict",
    "prepare",
]
