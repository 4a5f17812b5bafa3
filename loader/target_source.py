"""Opening a manifest pinned by digest in any Target (registry, S3, OCI layout) for range reads.

The manifest is fetched and checked against the pin; each weight layer is then read by ranges,
verified chunk by chunk against a signed chunk table, or as a whole layer against its digest.
Asking for a chunk table (trusted keys) and not getting one for every layer is a refusal unless
the caller accepts the downgrade.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from modelpack.loader.readers import RangeReader, TargetReader, VerifiedSpoolReader
from modelpack.loader.variant_source import is_index_document, select_entry
from modelpack.loader.weight_files import (
    ResolvedSource,
    WeightFile,
    config_json_layer,
    file_opener,
    quantization_from_hf_config,
    weight_layers,
)

from modelpack.errors import (
    ExpectedDigestError,
    ManifestError,
    SourceError,
    UnpinnedReferenceError,
    UnsignedSourceError,
)
from modelpack.oci.descriptor import Descriptor, Manifest
from modelpack.oci.digest import Digest, verify_bytes
from modelpack.targets.base import ReadableTarget, VerifiedSpooler


def cli_reference(target: ReadableTarget, reference: str | None) -> str:
    """``host/repo:tag``, ``host/repo@sha256:…``, ``oci:DIR:TAG``, ``s3://BUCKET/PREFIX@sha256:…``."""
    if not reference:
        return target.name
    return f"{target.name}{'@' if reference.startswith('sha256:') else ':'}{reference}"


def open_target_source(
    target: ReadableTarget,
    reference: str | None,
    *,
    expected_digest: str | None,
    chunk_table: Any = None,
    trusted_keys: Sequence[Any] | None = None,
    allow_missing_chunk_table: bool = False,
    direct: bool = False,
    variant: Any = None,
    blob_reader: Callable[[Descriptor, str], RangeReader] | None = None,
) -> ResolvedSource:
    """A manifest pinned by digest in any Target; blobs read by ranges and verified.

    Once a chunk table is asked for (``trusted_keys`` or ``chunk_table``), every weight layer must
    be covered by it: a missing referrer, or a table that skips a layer, is a refusal
    (``UnsignedSourceError``) unless ``allow_missing_chunk_table`` accepts whole-layer digest checks
    for the uncovered layers (recorded as a ``loader.downgraded`` notice).
    """
    named = cli_reference(target, reference)
    pinned: str | None = None
    ref_digest: str | None = None
    if reference and reference.startswith("sha256:"):
        ref_digest = str(Digest(reference))
    if expected_digest:
        pinned = str(Digest(expected_digest))
        if ref_digest and ref_digest != pinned:
            raise ExpectedDigestError(pinned, ref_digest, source=named)
    elif ref_digest:
        pinned = ref_digest
    if pinned is None:
        raise UnpinnedReferenceError(
            f"{named}: pin the manifest digest ({target.name}@sha256:… or --expected-digest); "
            "a tag can move between the ranks of one model start"
        )
    if reference and not reference.startswith("sha256:"):
        # the caller named a tag AND pinned a digest: the tag must still point at the pin
        desc = target.resolve(reference)
        if desc.digest != pinned:
            raise ExpectedDigestError(pinned, desc.digest, source=named)
    pinned_ref = f"{target.name}@{pinned}"
    desc = target.resolve(pinned)
    raw, media_type = target.fetch_manifest(pinned)
    verify_bytes(raw, pinned, None, what="manifest", source=pinned_ref)
    if is_index_document(raw, media_type):  # an index of variants: the entry that fits
        pinned, raw, media_type, _ = select_entry(target, raw, media_type, variant, trusted_keys, pinned_ref)
        pinned_ref = f"{target.name}@{pinned}"
        desc = target.resolve(pinned)
    try:
        manifest = Manifest.parse(raw, media_type=media_type)
    except ManifestError as exc:
        raise SourceError(f"{pinned_ref}: {exc}") from exc
    table = chunk_table
    wanted_table = table is not None or bool(trusted_keys)
    if table is None and trusted_keys:
        from modelpack.signing.chunks import load_chunk_table

        table = load_chunk_table(target, desc, list(trusted_keys), manifest=manifest)
    if table is not None and str(table.manifest_digest) != pinned:
        raise ExpectedDigestError(pinned, str(table.manifest_digest), source=f"{pinned_ref} chunk table")
    local_path: Callable[[str], str] | None = None
    blob_path = getattr(target, "blob_path", None)
    if callable(blob_path):
        local_path = blob_path
    files = []
    uncovered: list[str] = []
    for rel, layer in weight_layers(manifest, pinned_ref):
        layer_table = None
        if table is not None and str(layer.digest) in table.layers:
            entry = table.layers[str(layer.digest)]
            if entry.size != layer.size:
                raise SourceError(
                    f"{pinned_ref}: chunk table says layer {layer.digest} is {entry.size} bytes, "
                    f"the manifest says {layer.size}"
                )
            layer_table = table
        elif wanted_table:
            uncovered.append(rel)
        mode = "chunks" if layer_table is not None else "whole"
        if blob_reader is not None:
            opener = _follow_opener(blob_reader, layer, f"{target.name} {rel} ({layer.digest})")
        elif local_path is not None:
            opener = file_opener(local_path(layer.digest), layer.size, direct)
        else:
            opener = _target_opener(target, layer, rel, layer_table)
        files.append(WeightFile(rel, layer.size, opener, mode, descriptor=layer, chunks=layer_table))
    notices: list[tuple[str, dict[str, Any]]] = []
    if uncovered:
        what = (
            "has no chunk table signed by a trusted key"
            if table is None
            else "has a signed chunk table that does not cover " + ", ".join(uncovered[:10])
        )
        if not allow_missing_chunk_table:
            raise UnsignedSourceError(
                f"{pinned_ref} {what}, so its range reads cannot be checked chunk by chunk against "
                "--trusted-key. Sign it with 'modelpack sign' (chunk table included), or pass "
                "--allow-missing-chunk-table to check whole layers against the manifest instead",
                uncovered,
            )
        notices.append(
            (
                "loader.downgraded",
                {"files": uncovered, "reason": f"{what}; whole-layer digest checks instead"},
            )
        )
    quant = "none"
    data: bytes | None = None
    cfg = config_json_layer(manifest)
    if cfg is not None:
        # from the filling node cache (a stream-through load: unverified ingest bytes) or the
        # target; either way checked against its digest before it is parsed or planned from
        if blob_reader is not None:
            buf = bytearray(cfg.size)
            cfg_reader = blob_reader(cfg, f"{pinned_ref} config.json ({cfg.digest})")
            try:
                cfg_reader.read_into(0, memoryview(buf))
            finally:
                cfg_reader.close()
            data = bytes(buf)
        else:
            with target.fetch_blob(cfg) as f:
                data = f.read(cfg.size + 1)
        verify_bytes(data, cfg.digest, cfg.size, what="config.json", source=pinned_ref)
        quant = quantization_from_hf_config(data)
    return ResolvedSource(
        pinned_ref,
        pinned,
        manifest,
        files,
        local_path is None,
        quant,
        "streamed",
        notices=notices,
        config=data,
    )


def _follow_opener(
    blob_reader: Callable[[Descriptor, str], RangeReader], layer: Descriptor, name: str
) -> Callable[[], RangeReader]:
    def opener() -> RangeReader:
        return blob_reader(layer, name)

    return opener


def _target_opener(
    target: ReadableTarget, layer: Descriptor, rel: str, table: Any = None
) -> Callable[[], RangeReader]:
    check = table.range_check(str(layer.digest)) if table is not None else None

    def opener() -> RangeReader:
        name = f"{target.name} {rel} ({layer.digest})"
        if check is None and isinstance(target, VerifiedSpooler):  # verified whole: never a mirror's range
            return VerifiedSpoolReader(target, layer, name=name)
        return TargetReader(target, layer, name=name, check=check)

    return opener
