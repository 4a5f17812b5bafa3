"""The signing time a manifest signature carries, inside what the signature covers.

The time is an annotation of the statement's subject (in-toto v1 ``ResourceDescriptor.annotations``,
the field in-toto defines for extra facts about a subject, and where cosign puts ``sign -a``
annotations), under the project's own key ``dev.modelpack.signed-at``. cosign's predicate stays
``{}`` and no spec-owned field is invented. Its value is RFC 3339 in UTC with microseconds
(``2026-12-02T00:03:05.123456Z``), written by the signer's clock.

A node cache uses it to notice a tag moved back to an older signed version (``mount.rollback``).
A signature without the annotation (older modelpack versions, other signers) has time 0, which
is older than any timed signature.
"""

from __future__ import annotations

import datetime as dt
import re
import time

from modelpack.mediatypes.annotations import PROJECT_PREFIX

from modelpack.errors import BundleError
from modelpack.timestamps import rfc3339_utc

ANNOTATION_SIGNED_AT = PROJECT_PREFIX + "signed-at"
UNTIMED = 0.0
_RFC3339_UTC = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d{1,6})?Z")
_MAX_TEXT = 32


def format_signing_time(seconds: float) -> str:
    """``seconds`` since the epoch as RFC 3339 UTC with microseconds (two signatures within a
    second are still ordered)."""
    return rfc3339_utc(seconds, fraction=True)


def signing_time_now() -> str:
    return format_signing_time(time.time())


def parse_signing_time(text: object, *, where: str = "signing time") -> float:
    """Seconds since the epoch; ``BundleError`` for anything but RFC 3339 UTC (``…Z``) text."""
    if not isinstance(text, str) or len(text) > _MAX_TEXT or not _RFC3339_UTC.fullmatch(text):
        shown = repr(text)[:40]
        raise BundleError(f"{where} {shown} is not an RFC 3339 UTC time (YYYY-MM-DDTHH:MM:SS[.ffffff]Z)")
    try:
        when = dt.datetime.strptime(text[:-1] + ("" if "." in text else ".0"), "%Y-%m-%dT%H:%M:%S.%f")
    except ValueError as exc:
        raise BundleError(f"{where} {text!r}: {exc}") from exc
    return when.replace(tzinfo=dt.timezone.utc).timestamp()


def describe_signing_time(seconds: float | None) -> str:
    """For messages: the RFC 3339 text, or what an untimed signature is."""
    if not seconds:
        return "no signing time (counts as 0)"
    return format_signing_time(seconds)
