"""The words every command uses for the state of a signature, and for an artifact's signatures.

``verify``, ``audit``, ``pull --policy`` and the events say the same thing with the same word:

========== ==========================================================================================
verified   a valid signature over this digest by a trusted key (or a trusted keyless identity)
untrusted  a valid signature, but by a key or identity that is not trusted here
invalid    a signature that does not verify: unreadable, wrong subject, wrong predicate, bad time
unsigned   no signature referrer at all
signed     signatures present, not checked: no key or policy was given (``audit`` without ``--key``)
========== ==========================================================================================

One signature is ``verified``, ``untrusted`` or ``invalid``; an artifact's state is its best
signature's (``overall``): one verified signature is enough, a valid signature by another key is
``untrusted`` even beside a broken one, and only when every signature is broken is it ``invalid``.
"""

from __future__ import annotations

from collections.abc import Iterable

from modelpack.mediatypes.types import StrEnum


class SignatureState(StrEnum):
    VERIFIED = "verified"
    UNTRUSTED = "untrusted"
    INVALID = "invalid"
    UNSIGNED = "unsigned"
    SIGNED = "signed"


#: what each word means, for help texts and docs
MEANING: dict[SignatureState, str] = {
    SignatureState.VERIFIED: "a valid signature over this digest by a trusted key or identity",
    SignatureState.UNTRUSTED: "a valid signature, but not by a trusted key or identity",
    SignatureState.INVALID: "a signature that does not verify (unreadable, wrong subject or predicate)",
    SignatureState.UNSIGNED: "no signature",
    SignatureState.SIGNED: "signatures present but not checked (no key or policy given)",
}

#: the best state first: an artifact has the state of its best signature
_ORDER = (SignatureState.VERIFIED, SignatureState.UNTRUSTED, SignatureState.INVALID)


def overall(states: Iterable[str], *, checked: bool = True) -> SignatureState:
    """The state of an artifact whose signatures have ``states`` (each verified, untrusted or
    invalid); ``checked`` False: no key or policy was given, so a readable signature is only
    ``signed``."""
    present = {SignatureState(s) for s in states}
    if not present:
        return SignatureState.UNSIGNED
    best = next(s for s in _ORDER if s in present)
    if not checked and best is not SignatureState.INVALID:
        return SignatureState.SIGNED
    return best


__all__ = ["MEANING", "SignatureState", "overall"]
