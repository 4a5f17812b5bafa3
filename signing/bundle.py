"""Sigstore bundle v0.3, key-based: a DSSE envelope plus a public-key hint, no tlog entries.

This is the shape ``cosign verify --key … --insecure-ignore-tlog`` (new bundle format) and
OpenSSF ``model_signing verify key`` read: ``verificationMaterial.publicKey.hint`` is the key id
(hex sha256 of the SPKI PEM); there is no certificate and no transparency-log entry, so
verification is fully offline.

Every bundle here carries an in-toto statement: a DSSE envelope of any other ``payloadType`` is
refused when parsed (and again before its statement is read), because a valid signature over
another kind of payload is not a signature of the model. The JSON is read through
``modelpack.boundedjson`` (size and depth bounded before parsing).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from modelpack.signing.dsse import IN_TOTO_PAYLOAD_TYPE, Envelope, sign_envelope
from modelpack.signing.keys import PrivateKey, PublicKey
from modelpack.signing.statements import Statement

from modelpack import boundedjson
from modelpack.errors import BundleError, DocumentError
from modelpack.oci.descriptor import canonical_json

BUNDLE_MEDIA_TYPE = "application/vnd.dev.sigstore.bundle.v0.3+json"
ACCEPTED_BUNDLE_MEDIA_TYPES = (
    BUNDLE_MEDIA_TYPE,
    "application/vnd.dev.sigstore.bundle+json;version=0.3",
)
MAX_BUNDLE_BYTES = 96 * 1024 * 1024
#: A bundle nests 5 levels; its statement is a base64 string inside it, parsed on its own.
MAX_BUNDLE_DEPTH = 16


def require_in_toto(envelope: Envelope, source: str) -> None:
    if envelope.payload_type != IN_TOTO_PAYLOAD_TYPE:
        raise BundleError(
            f"{source}: DSSE payloadType {envelope.payload_type!r}, expected {IN_TOTO_PAYLOAD_TYPE!r}; "
            "a signature over another kind of payload is not a signature of the model"
        )


@dataclass(frozen=True)
class Bundle:
    envelope: Envelope
    key_hint: str = ""
    raw: bytes = b""
    # a certificate in the verification material: keyless (Sigstore), checked by identity, not key
    keyless: bool = False

    def to_dict(self) -> dict[str, Any]:
        vm: dict[str, Any] = {"tlogEntries": []}
        if self.key_hint:
            vm["publicKey"] = {"hint": self.key_hint}
        return {
            "mediaType": BUNDLE_MEDIA_TYPE,
            "verificationMaterial": vm,
            "dsseEnvelope": self.envelope.to_dict(),
        }

    def to_bytes(self) -> bytes:
        return self.raw or canonical_json(self.to_dict())

    @property
    def statement(self) -> Statement:
        """The payload parsed as an in-toto statement (NOT verified: call ``verify`` first)."""
        require_in_toto(self.envelope, "bundle")
        return Statement.from_bytes(self.envelope.payload)

    def verify(self, keys: list[PublicKey]) -> PublicKey | None:
        """The trusted key that signed the envelope, or None. The hint only orders the search."""
        ordered = sorted(keys, key=lambda k: k.key_id != self.key_hint)
        return self.envelope.verify(ordered)

    @classmethod
    def from_bytes(cls, raw: bytes, *, source: str = "bundle") -> Bundle:
        try:
            doc = boundedjson.loads_object(
                raw, what=source, max_bytes=MAX_BUNDLE_BYTES, max_depth=MAX_BUNDLE_DEPTH
            )
        except DocumentError as exc:
            raise BundleError(str(exc)) from exc
        mt = doc.get("mediaType")
        if mt not in ACCEPTED_BUNDLE_MEDIA_TYPES:
            raise BundleError(f"{source}: unsupported bundle mediaType {mt!r} (want {BUNDLE_MEDIA_TYPE})")
        env_doc = doc.get("dsseEnvelope")
        if env_doc is None:
            raise BundleError(f"{source}: no dsseEnvelope (message-signature bundles are not used here)")
        try:
            envelope = Envelope.from_dict(env_doc)
        except BundleError as exc:
            raise BundleError(f"{source}: {exc}") from exc
        require_in_toto(envelope, source)
        vm = doc.get("verificationMaterial")
        hint = ""
        if isinstance(vm, dict) and isinstance(vm.get("publicKey"), dict):
            h = vm["publicKey"].get("hint", "")
            hint = h if isinstance(h, str) else ""
        keyless = isinstance(vm, dict) and ("certificate" in vm or "x509CertificateChain" in vm)
        return cls(envelope, hint, raw, keyless)


def sign_statement(statement: Statement, private_key: PrivateKey) -> Bundle:
    envelope = sign_envelope(statement.to_bytes(), private_key)
    return Bundle(envelope, private_key.key_id)
