"""The one document ``pull --json`` prints, whichever way the files went.

A pull into a directory (``transfer.materialize.PullResult``) and a pull into the node cache
(``mount.reports.PullResult``) answer the same questions for a script: what was pinned, where
the files are, how many, how many bytes came over the network and from which source, how long
it took, what the trust step said. Those answers sit at the top level under the same names in
both modes; what only one mode has (files kept/replaced/deleted in a directory; hit or cold,
store reuse, a GC hold in the cache) sits under the mode's own key, ``directory`` or ``cache``.
The schema is ``modelpack/cli/schemas/pull.json``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

PullMode = Literal["directory", "cache"]


def pull_document(
    *,
    mode: PullMode,
    reference: str,
    digest: str,
    path: str,
    files: int,
    bytes_downloaded: int,
    bytes_by_source: Mapping[str, int],
    timings_ms: Mapping[str, float],
    signature: str,
    details: Mapping[str, Any],
    start_id: str = "",
    variant: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The pull's document: shared fields first, then ``mode``'s own details under its name.
    ``startId`` and ``variant`` appear when the pull has them (a startup id; an index)."""
    doc: dict[str, Any] = {
        "mode": mode,
        "reference": reference,
        "digest": digest,
        "path": path,
        "files": files,
        "bytesDownloaded": bytes_downloaded,
        "bytesBySource": dict(bytes_by_source),
        "timingsMs": dict(timings_ms),
        "signature": signature,
    }
    if start_id:
        doc["startId"] = start_id
    if variant is not None:
        doc["variant"] = dict(variant)
    doc[mode] = dict(details)
    return doc
