"""DSSE (Dead Simple Signing Envelope) v1: pre-authentication encoding and envelopes.

The signature covers ``PAE(payloadType, payload)``, never the JSON around it, so the envelope
can be re-serialised freely while the signed bytes cannot change.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from modelpack.signing.keys import PrivateKey, PublicKey

from modelpack.errors import BundleError

IN_TOTO_PAYLOAD_TYPE = "application/vnd.in-toto+json"
MAX_SIGNATURES = 16


def pae(payload_type: str, payload: bytes) -> bytes:
    """``DSSEv1 <len(type)> <type> <len(payload)> <payload>`` (lengths in bytes, ASCII decimal)."""
    t = payload_type.encode()
    return b"DSSEv1 %d %s %d %s" % (len(t), t, len(payload), payload)


def _b64decode(value: Any, what: str) -> bytes:
    if not isinstance(value, str):
        raise BundleError(f"DSSE {what} must be a base64 string")
    try:
        # both alphabets occur in the wild; DSSE says standard or URL-safe
        if "-" in value or "_" in value:
            return base64.urlsafe_b64decode(value + "=" * (-len(value) % 4))
        return base64.b64decode(value + "=" * (-len(value) % 4), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise BundleError(f"DSSE {what} is not valid base64") from exc


@dataclass(frozen=True)
class Signature:
    sig: bytes
    keyid: str = ""


@dataclass(frozen=True)
class Envelope:
    payload: bytes
    payload_type: str
    signatures: tuple[Signature, ...]

    def to_dict(self) -> dict[str, Any]:
        sigs = []
        for s in self.signatures:
            d = {"sig": base64.b64encode(s.sig).decode()}
            if s.keyid:
                d["keyid"] = s.keyid
            sigs.append(d)
        return {
            "payload": base64.b64encode(self.payload).decode(),
            "payloadType": self.payload_type,
            "signatures": sigs,
        }

    @classmethod
    def from_dict(cls, doc: Any) -> Envelope:
        if not isinstance(doc, dict):
            raise BundleError("DSSE envelope must be a JSON object")
        payload_type = doc.get("payloadType")
        if not isinstance(payload_type, str) or not payload_type:
            raise BundleError("DSSE envelope has no payloadType")
        sigs_doc = doc.get("signatures")
        if not isinstance(sigs_doc, list) or not sigs_doc or len(sigs_doc) > MAX_SIGNATURES:
            raise BundleError(f"DSSE envelope must carry 1..{MAX_SIGNATURES} signatures")
        sigs = []
        for s in sigs_doc:
            if not isinstance(s, dict):
                raise BundleError("DSSE signature entry must be an object")
            keyid = s.get("keyid", "")
            sigs.append(Signature(_b64decode(s.get("sig"), "sig"), keyid if isinstance(keyid, str) else ""))
        return cls(_b64decode(doc.get("payload"), "payload"), payload_type, tuple(sigs))

    def verify(self, keys: Iterable[PublicKey]) -> PublicKey | None:
        """The first trusted key that signed ``PAE(type, payload)``, or None."""
        message = pae(self.payload_type, self.payload)
        keys = list(keys)
        for s in self.signatures:
            for key in keys:
                if key.verify(s.sig, message):
                    return key
        return None


def sign_envelope(
    payload: bytes, private_key: PrivateKey, payload_type: str = IN_TOTO_PAYLOAD_TYPE
) -> Envelope:
    sig = private_key.sign(pae(payload_type, payload))
    return Envelope(payload, payload_type, (Signature(sig),))
