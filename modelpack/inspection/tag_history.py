"""``audit --cache``: the tag history a node cache knows, next to what the registry says now.

The node cache records per tag the newest signed version it accepted and the ones before it
(``mount.rollback``). For each such tag of an audited repository this adds one entry to the
audit: the history, the newest accepted version, the digest the registry names now, and
``rollback``: True when the registry now names a version signed before the newest one accepted
(a ``pull`` under a policy would refuse it), False when not, None when the audit cannot tell
(no key was given, so the current version's signing time is unknown, and it is not in the
history). Audit reports; it decides nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from modelpack.inspection.audit import RepositoryAudit
from modelpack.mount.rollback import TagRecord


def _current_signed_at(audit: RepositoryAudit, digest: str) -> float | None:
    for v in audit.versions:
        if v.digest == digest:
            return v.signed_at if v.signature == "verified" else None
    return None


def _is_rollback(audit: RepositoryAudit, record: TagRecord, current: str | None) -> bool | None:
    if current is None or current == record.newest.digest:
        return False
    signed_at = _current_signed_at(audit, current)
    if signed_at is None:
        known = [v.signed_at for v in record.history if v.digest == current]
        if not known:
            return None
        signed_at = max(known)
    return signed_at < record.newest.signed_at


def attach_tag_history(audit: RepositoryAudit, records: Iterable[TagRecord]) -> bool:
    """Add the cache's records of ``audit``'s repository; returns whether any tag rolled back."""
    rolled_back = False
    for record in sorted(records, key=lambda r: r.tag):
        current = audit.tags.get(record.tag)
        rollback = _is_rollback(audit, record, current)
        rolled_back = rolled_back or rollback is True
        entry: dict[str, Any] = {
            "tag": record.tag,
            "current": current,
            "newest": record.newest.to_json(),
            "history": [v.to_json() for v in record.history],
            "rollback": rollback,
        }
        audit.tag_history.append(entry)
    return rolled_back
