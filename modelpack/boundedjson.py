"""Parse a JSON document from outside with a size bound, a depth bound and no duplicate keys.

Every document modelpack reads from a registry, a bucket, a layout, a cache or a checkpoint
(manifests, indexes, configs, referrers, bundles, safetensors headers, policy and event files)
goes through :func:`loads`, so a hostile document is a typed refusal (:class:`DocumentError`)
naming what was being read — never ``RecursionError``, a ``MemoryError`` or a traceback.
Duplicate keys are refused because two parsers that keep different duplicates see different
documents under the same digest.
"""

from __future__ import annotations

import json
import re
from typing import Any

from modelpack.errors import DocumentError

#: Deep enough for every document the formats define (manifests nest 4–5 levels, bundles ~8).
DEFAULT_MAX_DEPTH = 64
#: The OCI distribution limit for manifests; callers pass their own bound for other documents.
DEFAULT_MAX_BYTES = 4 * 1024 * 1024


def _unique_keys(what: str) -> Any:
    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out = dict(pairs)
        if len(out) != len(pairs):
            seen: set[str] = set()
            dup = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
            raise DocumentError(what, f"duplicate key {dup!r}")
        return out

    return hook


_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_BRACKETS = bytes.maketrans(b"{}", b"[]")
_NOT_BRACKETS = bytes(set(range(256)) - set(b"[]{}"))


def _depth_exceeds(data: bytes, max_depth: int) -> bool:
    """Checked on the bytes before parsing, so a deep document never reaches the recursive parser.

    Strings are cut out, the rest is reduced to its brackets, and each pass removes the innermost
    level: ``max_depth`` C-speed passes at most, whatever the document.
    """
    skeleton = _STRING.sub(b"", data).translate(_BRACKETS, _NOT_BRACKETS)
    for _ in range(max_depth):
        if not skeleton:
            return False
        shorter = skeleton.replace(b"[]", b"")
        if len(shorter) == len(skeleton):
            return False  # unbalanced: the parser refuses it with a precise message
        skeleton = shorter
    return bool(skeleton)


def loads(
    data: bytes | bytearray | memoryview | str,
    *,
    what: str,
    max_bytes: int = DEFAULT_MAX_BYTES,
    max_depth: int = DEFAULT_MAX_DEPTH,
) -> Any:
    """Parse ``data`` or raise :class:`DocumentError` naming ``what`` (e.g. "manifest sha256:…")."""
    size = len(data)
    if size > max_bytes:
        raise DocumentError(what, f"{size} bytes exceeds the {max_bytes}-byte limit")
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else bytes(data)
    if _depth_exceeds(raw, max_depth):
        raise DocumentError(what, f"nested deeper than {max_depth} levels")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DocumentError(what, f"not UTF-8 ({exc.reason} at byte {exc.start})") from None
    try:
        doc = json.loads(text, object_pairs_hook=_unique_keys(what))
    except DocumentError:
        raise
    except RecursionError:
        raise DocumentError(what, f"nested deeper than {max_depth} levels") from None
    except json.JSONDecodeError as exc:
        raise DocumentError(what, f"not JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    except ValueError as exc:  # e.g. integers longer than Python's int-string limit
        raise DocumentError(what, f"not JSON ({exc})") from None
    return doc


def loads_object(
    data: bytes | bytearray | memoryview | str,
    *,
    what: str,
    max_bytes: int = DEFAULT_MAX_BYTES,
    max_depth: int = DEFAULT_MAX_DEPTH,
) -> dict[str, Any]:
    """Like :func:`loads`, for documents whose top level must be a JSON object."""
    doc = loads(data, what=what, max_bytes=max_bytes, max_depth=max_depth)
    if not isinstance(doc, dict):
        raise DocumentError(what, f"top level is {type(doc).__name__}, not a JSON object")
    return doc
