"""A load pinned to an index of variants: the entry the caller's selector picks, then that manifest.

The index bytes hash to the pinned digest and the entry's bytes to the entry digest, so the
chain from the pin to the weights is unbroken; with trusted keys the index signature must also
verify (and the entry's signed chunk table, checked by ``target_source`` as for any model, covers
the entry). Which facts select (device arch, TP size, engine) is ``LoaderOptions.variant``, a
``modelpack.oci.variant_selection.VariantSelector``; without one, a selector that knows no node
facts is used (an entry for a given accelerator or engine then does not fit: fail closed).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from modelpack.errors import SignatureRefused, SourceError, UnsignedSourceError, VariantIndexError
from modelpack.oci.descriptor import Index, parse_manifest_or_index
from modelpack.oci.variant_index import variant_index
from modelpack.oci.variant_selection import Selection, VariantSelector
from modelpack.targets.base import ReadableTarget


def is_index_document(raw: bytes, media_type: str | None) -> bool:
    try:
        return isinstance(parse_manifest_or_index(raw, media_type), Index)
    except Exception:  # the manifest path reports a malformed document with its own message
        return False


def select_entry(
    target: ReadableTarget,
    raw: bytes,
    media_type: str | None,
    selector: VariantSelector | None,
    trusted_keys: Sequence[Any] | None,
    where: str,
) -> tuple[str, bytes, str, Selection]:
    """(entry digest, its verified manifest bytes, media type, the selection) for the index
    ``raw`` (already verified against its pinned digest): the node cache's own selection
    (``mount.variants.choose_entry``), its refusals in the loader's terms."""
    from modelpack.mount.variants import choose_entry

    parsed = parse_manifest_or_index(raw, media_type)
    assert isinstance(parsed, Index)
    vi = variant_index(parsed)
    try:
        chosen = choose_entry(target, None, vi, selector, policy=list(trusted_keys) if trusted_keys else None)
    except SignatureRefused as exc:
        raise UnsignedSourceError(
            f"{where}: the index is not signed by a trusted key ({exc.reason})"
        ) from exc
    except VariantIndexError as exc:
        raise SourceError(f"{where}: {exc}") from exc
    selection = chosen.resolved.selection
    return selection.digest, chosen.manifest_raw, chosen.media_type, selection
