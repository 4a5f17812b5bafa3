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

from modelpack.mediatypes import MEDIA_TYPE_OCI_INDEX

from modelpack.errors import SourceError, UnsignedSourceError
from modelpack.oci.descriptor import Descriptor, Index, parse_manifest_or_index
from modelpack.oci.digest import Digest
from modelpack.oci.variant_index import check_entry_manifest, variant_index
from modelpack.oci.variant_selection import Selection, VariantSelector
from modelpack.targets.base import ReadableTarget


def is_index_document(raw: bytes, media_type: str | None) -> bool:
    try:
        return isinstance(parse_manifest_or_index(raw, media_type), Index)
    except Exception:  # the manifest path reports a malformed document with its own message
        return False


def select_entry(
    target: ReadableTarget,
    index_digest: str,
    raw: bytes,
    media_type: str | None,
    selector: VariantSelector | None,
    trusted_keys: Sequence[Any] | None,
    where: str,
) -> tuple[str, bytes, str, Selection]:
    """(entry digest, its verified manifest bytes, media type, the selection) for the index at
    ``index_digest`` (``raw`` already verified against it)."""
    parsed = parse_manifest_or_index(raw, media_type)
    assert isinstance(parsed, Index)
    vi = variant_index(parsed)
    if trusted_keys:
        from modelpack.signing.manifest_signature import check_manifest_signatures

        desc = Descriptor(parsed.media_type or MEDIA_TYPE_OCI_INDEX, Digest(index_digest), len(raw))
        checks = check_manifest_signatures(target, desc, list(trusted_keys))
        if not any(c.status == "verified" for c in checks):
            why = "; ".join(c.reason for c in checks if c.reason) or "no signature"
            raise UnsignedSourceError(f"{where}: the index is not signed by a trusted key ({why})")
    selection = (selector or VariantSelector()).select(vi)
    entry = selection.chosen
    digest = str(entry.descriptor.digest)
    entry_raw, entry_type = target.fetch_manifest(digest)
    try:
        check_entry_manifest(entry, entry_raw, entry_type, index=vi.digest)
    except Exception as exc:
        raise SourceError(f"{where}: {exc}") from exc
    return digest, entry_raw, entry_type or entry.descriptor.media_type, selection
