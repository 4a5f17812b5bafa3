"""Keyless trust: a signature is trusted when a Sigstore certificate names an identity the policy
trusts (an OIDC issuer and a subject, exact or by regular expression), as ``cosign verify
--certificate-identity … --certificate-oidc-issuer …`` decides.

CI jobs sign with the job's OIDC identity (``modelpack sign --keyless``); there is no key to
distribute, so the policy names *who* may sign instead. The bundle is checked whole by
sigstore-python's verifier against a trusted root: the certificate chains to the CA at the time
the transparency log recorded, carries a valid SCT, the log entry's inclusion proof, checkpoint and
signed entry timestamp verify, the entry matches the envelope, and the DSSE signature is the
certificate key's. Only then is the SAN compared with the policy. Everything runs offline: the
trusted root is a file the policy names (``trusted_root:``), or Sigstore's public-good root from
sigstore-python's TUF cache (never fetched during a verification).

Who controls what: the pusher (or a registry, a mirror) controls the bundle, including the
certificate and its SAN; only the trusted root (the node's file) and the policy decide. A bundle
that fails any check is "untrusted" with sigstore's reason, never an exception: the policy, not
the parser, says no. A missing sigstore-python (the ``keyless`` extra) fails closed the same way.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any

from modelpack.errors import PolicyError

MAX_TRUSTED_ROOT_BYTES = 1024 * 1024
MAX_IDENTITIES = 64
MAX_PATTERN_CHARS = 1024


@dataclass(frozen=True)
class TrustedIdentity:
    """One signer the policy trusts: certificates from ``issuer`` whose SAN (URI or e-mail) equals
    ``subject`` or fully matches ``subject_regex``. ``id`` is what trust records remember."""

    issuer: str
    subject: str = ""
    subject_regex: str = ""

    def __post_init__(self) -> None:
        if not self.issuer or bool(self.subject) == bool(self.subject_regex):
            raise PolicyError("a trusted identity needs an issuer and exactly one of subject / subject_regex")
        if len(self.subject_regex) > MAX_PATTERN_CHARS:
            raise PolicyError(f"subject_regex longer than {MAX_PATTERN_CHARS} characters")
        if self.subject_regex:
            try:
                re.compile(self.subject_regex)
            except re.error as exc:
                raise PolicyError(f"subject_regex {self.subject_regex!r}: {exc}") from exc

    @property
    def id(self) -> str:
        subject = self.subject or f"~{self.subject_regex}"
        return f"keyless:{self.issuer} {subject}"

    def matches(self, sans: set[str]) -> str | None:
        """The SAN that satisfies this identity, if one does."""
        for san in sorted(sans):
            if (self.subject and san == self.subject) or (
                self.subject_regex and re.fullmatch(self.subject_regex, san)
            ):
                return san
        return None


@dataclass(frozen=True)
class KeylessCheck:
    """``identity``: the policy identity that verified (None: untrusted, ``reason`` says why);
    ``san``: the certificate's subject that matched; ``payload``: the DSSE payload sigstore
    verified (the statement to check next)."""

    identity: TrustedIdentity | None
    reason: str = ""
    san: str = ""
    payload: bytes = b""


@dataclass(frozen=True)
class KeylessTrust:
    identities: tuple[TrustedIdentity, ...]
    trusted_root: str = ""  # a trusted_root.json; "" = Sigstore's public-good root (TUF cache)
    _verifier: list[Any] = field(default_factory=list, compare=False, repr=False)

    @property
    def ids(self) -> list[str]:
        return [i.id for i in self.identities]

    def _load_verifier(self) -> Any:
        if self._verifier:
            return self._verifier[0]
        from sigstore.models import ClientTrustConfig, TrustedRoot
        from sigstore.verify import Verifier

        if self.trusted_root:
            try:
                with open(self.trusted_root, "rb") as f:
                    raw = f.read(MAX_TRUSTED_ROOT_BYTES + 1)
            except OSError as exc:
                raise PolicyError(
                    f"{self.trusted_root}: cannot read the trusted root: {exc.strerror}"
                ) from exc
            if len(raw) > MAX_TRUSTED_ROOT_BYTES:
                raise PolicyError(f"{self.trusted_root}: larger than {MAX_TRUSTED_ROOT_BYTES} bytes")
            from sigstore_models.trustroot import v1 as trustroot_v1

            try:
                root = TrustedRoot(trustroot_v1.TrustedRoot.from_json(raw))
            except Exception as exc:  # sigstore raises pydantic and its own errors for bad documents
                raise PolicyError(f"{self.trusted_root}: not a Sigstore trusted root: {exc}") from exc
        else:
            root = ClientTrustConfig.production(offline=True).trusted_root
        verifier = Verifier(trusted_root=root)
        self._verifier.append(verifier)
        return verifier

    def check(self, raw_bundle: bytes, *, source: str = "bundle") -> KeylessCheck:
        try:
            from sigstore.models import Bundle as SigstoreBundle
            from sigstore.verify import policy as sigstore_policy
        except ImportError:
            return KeylessCheck(
                None, "keyless verification needs sigstore-python: pip install 'modelpack-oci[keyless]'"
            )
        try:
            verifier = self._load_verifier()
        except PolicyError as exc:
            return KeylessCheck(None, str(exc))
        except Exception as exc:  # no TUF cache on an offline node, a broken cache…
            return KeylessCheck(None, f"Sigstore's trusted root is not available offline: {exc}")
        try:
            bundle = SigstoreBundle.from_json(raw_bundle)
        except Exception as exc:
            return KeylessCheck(None, f"{source}: not a verifiable Sigstore bundle: {exc}")
        sans = _certificate_sans(bundle.signing_certificate)
        problems = []
        for identity in self.identities:
            san = identity.matches(sans)
            if san is None:
                continue
            try:
                payload_type, payload = verifier.verify_dsse(
                    bundle, sigstore_policy.Identity(identity=san, issuer=identity.issuer)
                )
            except Exception as exc:  # sigstore's VerificationError and friends
                problems.append(f"{identity.id}: {exc}")
                continue
            if payload_type != "application/vnd.in-toto+json":
                return KeylessCheck(None, f"{source}: DSSE payloadType {payload_type!r} is not in-toto")
            return KeylessCheck(identity, san=san, payload=payload)
        shown = ", ".join(sorted(sans)) or "none"
        if problems:
            return KeylessCheck(
                None, f"{source}: certificate for {shown} does not verify: {'; '.join(problems)}"
            )
        return KeylessCheck(None, f"{source}: signed by {shown}, not by an identity the policy trusts")


def _certificate_sans(cert: Any) -> set[str]:
    from cryptography.x509 import RFC822Name, SubjectAlternativeName, UniformResourceIdentifier

    try:
        ext = cert.extensions.get_extension_for_class(SubjectAlternativeName).value
    except Exception:
        return set()
    return set(ext.get_values_for_type(RFC822Name)) | set(ext.get_values_for_type(UniformResourceIdentifier))


def keyless_from_policy(doc: Any, where: str, base_dir: str) -> KeylessTrust | None:
    """The ``identities`` / ``trusted_root`` part of a policy rule (None when it names none)."""
    identities_doc = doc.get("identities")
    root = doc.get("trusted_root")
    if identities_doc is None:
        if root is not None:
            raise PolicyError(f"{where}: trusted_root without identities trusts nobody")
        return None
    if not isinstance(identities_doc, list) or not identities_doc:
        raise PolicyError(f"{where}: identities must be a non-empty list")
    if len(identities_doc) > MAX_IDENTITIES:
        raise PolicyError(f"{where}: more than {MAX_IDENTITIES} identities")
    identities = []
    for j, item in enumerate(identities_doc):
        iw = f"{where}.identities[{j}]"
        if not isinstance(item, dict) or set(item) - {"issuer", "subject", "subject_regex"}:
            raise PolicyError(f"{iw}: a mapping of issuer and subject (or subject_regex)")
        values = {k: item.get(k, "") for k in ("issuer", "subject", "subject_regex")}
        if not all(isinstance(v, str) for v in values.values()):
            raise PolicyError(f"{iw}: issuer, subject and subject_regex are strings")
        try:
            identities.append(TrustedIdentity(**values))
        except PolicyError as exc:
            raise PolicyError(f"{iw}: {exc}") from exc
    if root is not None and (not isinstance(root, str) or not root):
        raise PolicyError(f"{where}: trusted_root must be a path")
    path = os.path.join(base_dir, os.path.expanduser(root)) if root else ""
    return KeylessTrust(tuple(identities), path)


__all__ = ["KeylessCheck", "KeylessTrust", "TrustedIdentity", "keyless_from_policy"]
