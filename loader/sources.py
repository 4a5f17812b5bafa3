"""Where a load reads from: any accepted source, turned into weight files with a verification mode.

Sources: a snapshot directory (``modelpack pull --cache`` prints it), a ``(NodeCache, reference)``
pair, a ``CacheStream`` (a pinned reference streamed while it fills the node cache,
``stream_through``), a ``(ReadableTarget, reference)`` pair, or a reference string (``oci:…``, ``s3://…``,
``host/repo@sha256:…``) streamed by range reads. ``weight_files`` says what each mode means,
``snapshot_source`` and ``target_source`` open the two kinds.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from modelpack.loader.snapshot_source import open_cache_pair, open_snapshot
from modelpack.loader.stream_through import CacheStream, open_cache_stream
from modelpack.loader.target_source import open_target_source
from modelpack.loader.weight_files import ResolvedSource, WeightFile

from modelpack.errors import ModelpackError, SourceError
from modelpack.oci.reference import parse_reference
from modelpack.targets.base import ReadableTarget

if TYPE_CHECKING:
    from modelpack.signing.chunks import ChunkTable

    from modelpack.oci.variant_selection import VariantSelector
    from modelpack.targets.options import TargetOptions

__all__ = [
    "ResolvedSource",
    "WeightFile",
    "open_cache_pair",
    "open_snapshot",
    "open_target_source",
    "resolve_source",
]


def resolve_source(
    source: Any,
    *,
    expected_digest: str | None = None,
    chunk_table: ChunkTable | None = None,
    trusted_keys: Sequence[Any] | None = None,
    target_options: TargetOptions | None = None,
    allow_unverified: bool = False,
    allow_missing_chunk_table: bool = False,
    direct: bool = False,
    variant: VariantSelector | None = None,
    share: bool = False,
) -> ResolvedSource:
    """Turn any accepted ``source`` into files with a verification mode (see the module doc).
    ``variant`` selects the entry when a reference pins an index of variants. ``share``: the
    load reads only a rank's share (a ``CacheStream`` then leaves the cache to a fill)."""
    if isinstance(source, CacheStream):
        return open_cache_stream(
            source,
            share=share,
            expected_digest=expected_digest,
            trusted_keys=trusted_keys,
            chunk_table=chunk_table,
            allow_missing_chunk_table=allow_missing_chunk_table,
            direct=direct,
            variant=variant,
        )
    if isinstance(source, tuple) and len(source) == 2:
        first, ref = source
        if hasattr(first, "open_snapshot"):
            return open_cache_pair(
                first, ref, expected_digest=expected_digest, direct=direct, trusted_keys=trusted_keys
            )
        if isinstance(first, ReadableTarget):
            return open_target_source(
                first,
                str(ref) if ref is not None else None,
                expected_digest=expected_digest,
                chunk_table=chunk_table,
                trusted_keys=trusted_keys,
                allow_missing_chunk_table=allow_missing_chunk_table,
                direct=direct,
                variant=variant,
            )
        raise SourceError(f"unsupported source pair ({type(first).__name__}, …)")
    if isinstance(source, os.PathLike) or (isinstance(source, str) and os.path.isdir(source)):
        path = os.fspath(source)
        if not os.path.isdir(path):
            raise SourceError(f"{path}: not a directory")
        return open_snapshot(
            path,
            expected_digest=expected_digest,
            allow_unverified=allow_unverified,
            direct=direct,
            trusted_keys=trusted_keys,
        )
    if isinstance(source, str):
        try:
            ref = parse_reference(source)
        except ModelpackError as exc:
            raise SourceError(f"{source!r} is neither a directory nor a reference: {exc}") from exc
        from modelpack.targets.opener import open_readable

        target = open_readable(ref, target_options)
        return open_target_source(
            target,
            str(ref.digest) if ref.digest else (ref.tag if ref.tag else None),
            expected_digest=expected_digest,
            chunk_table=chunk_table,
            trusted_keys=trusted_keys,
            allow_missing_chunk_table=allow_missing_chunk_table,
            direct=direct,
            variant=variant,
        )
    raise SourceError(f"unsupported load source {type(source).__name__}")
