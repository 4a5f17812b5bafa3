"""in-toto v1 statements: the signed payloads of every modelpack signature.

The statement names what is signed (``subject``: digests) and what kind of claim it is
(``predicateType``). Verifiers must compare the subject with the digest they are about to use:
a valid signature over another digest is a replay, not a signature.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from modelpack.signing.signing_time import ANNOTATION_SIGNED_AT, UNTIMED, parse_signing_time

from modelpack import boundedjson
from modelpack.errors import BundleError, DocumentError
from modelpack.oci.descriptor import canonical_json

STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PREDICATE_COSIGN_SIGN = "https://sigstore.dev/cosign/sign/v1"
PREDICATE_MODEL_SIGNING = "https://model_signing/signature/v1.0"
PREDICATE_CHUNK_DIGESTS = "https://modelpack.dev/chunk-digests/v1"
MAX_STATEMENT_BYTES = 64 * 1024 * 1024
MAX_SUBJECTS = 64
#: The deepest predicate we write (chunk table: predicate → layers → digest → chunks) nests 5.
MAX_STATEMENT_DEPTH = 16


@dataclass(frozen=True)
class Statement:
    subjects: tuple[dict[str, Any], ...]
    predicate_type: str
    predicate: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {
            "_type": STATEMENT_TYPE,
            "subject": [dict(s) for s in self.subjects],
            "predicateType": self.predicate_type,
            "predicate": self.predicate,
        }

    def to_bytes(self) -> bytes:
        return canonical_json(self.to_dict())

    @property
    def subject_sha256(self) -> list[str]:
        """Every subject's sha256 hex (lowercase), in order; a subject without one yields ''."""
        out = []
        for s in self.subjects:
            d = s.get("digest")
            v = d.get("sha256") if isinstance(d, dict) else None
            out.append(v.lower() if isinstance(v, str) else "")
        return out

    @property
    def signed_at(self) -> float:
        """The signing time in the first subject's annotations (``signing_time``), seconds since
        the epoch; ``UNTIMED`` (0) when there is none. ``BundleError`` when it is malformed."""
        annotations = self.subjects[0].get("annotations") if self.subjects else None
        if annotations is None:
            return UNTIMED
        if not isinstance(annotations, dict):
            raise BundleError("in-toto statement subject annotations must be an object")
        if ANNOTATION_SIGNED_AT not in annotations:
            return UNTIMED
        return parse_signing_time(annotations[ANNOTATION_SIGNED_AT], where=ANNOTATION_SIGNED_AT)

    @classmethod
    def from_bytes(cls, raw: bytes) -> Statement:
        try:
            doc = boundedjson.loads_object(
                raw, what="in-toto statement", max_bytes=MAX_STATEMENT_BYTES, max_depth=MAX_STATEMENT_DEPTH
            )
        except DocumentError as exc:
            raise BundleError(str(exc)) from exc
        if doc.get("_type") != STATEMENT_TYPE:
            raise BundleError(f"payload is not an in-toto v1 statement (_type {STATEMENT_TYPE})")
        subjects = doc.get("subject")
        if not isinstance(subjects, list) or not subjects or len(subjects) > MAX_SUBJECTS:
            raise BundleError(f"in-toto statement must have 1..{MAX_SUBJECTS} subjects")
        if not all(isinstance(s, dict) for s in subjects):
            raise BundleError("in-toto statement subjects must be objects")
        pt = doc.get("predicateType")
        if not isinstance(pt, str):
            raise BundleError("in-toto statement has no predicateType")
        predicate = doc.get("predicate", {})
        if not isinstance(predicate, dict):
            raise BundleError("in-toto statement predicate must be an object")
        return cls(tuple(subjects), pt, predicate)


def manifest_statement(manifest_hex: str, *, signed_at: str | None = None) -> Statement:
    """The cosign-style signature statement over a manifest digest (empty predicate). With
    ``signed_at`` (RFC 3339 UTC) the subject carries it as the ``dev.modelpack.signed-at``
    annotation, inside what the signature covers; without, the signature is untimed (time 0)."""
    subject: dict[str, Any] = {"digest": {"sha256": manifest_hex}}
    if signed_at is not None:
        parse_signing_time(signed_at)  # never sign a time a verifier would refuse
        subject["annotations"] = {ANNOTATION_SIGNED_AT: signed_at}
    return Statement((subject,), PREDICATE_COSIGN_SIGN, {})
