"""Optional keyless signing through sigstore-python (``pip install 'modelpack-oci[keyless]'``).

CI systems with an OIDC identity (GitHub Actions, GitLab, Buildkite…) can sign without a key:
sigstore-python gets a short-lived Fulcio certificate for the job's identity, signs the same
in-toto statement as the key-based path (subject = manifest digest, predicateType
``https://sigstore.dev/cosign/sign/v1``) as a DSSE envelope, logs it in Rekor and returns a v0.3
bundle, which is stored exactly like a key-based one (same referrer layout, cosign-readable).

This needs network access to Sigstore's public good instance and an ambient OIDC credential, so
it cannot run in the offline test suite; it is deliberately small and imported lazily. Nodes verify
keyless bundles offline against the identities their trust policy names
(``modelpack.signing.keyless_trust``), as ``cosign verify --certificate-identity`` does.
"""

from __future__ import annotations

import time
from typing import Any

from modelpack.signing.bundle import Bundle
from modelpack.signing.referrers import ARTIFACT_TYPE_SIGNATURE, confirm_referrers, push_bundle_referrer
from modelpack.signing.signing_time import signing_time_now
from modelpack.signing.statements import PREDICATE_COSIGN_SIGN, manifest_statement

from modelpack.errors import SigningError
from modelpack.oci.descriptor import Descriptor
from modelpack.targets.base import Target


def sign_keyless(target: Target, manifest_desc: Descriptor, *, staging: bool = False) -> dict[str, Any]:
    try:
        from sigstore import dsse
        from sigstore.models import ClientTrustConfig
        from sigstore.oidc import IdentityToken, Issuer, detect_credential
        from sigstore.sign import SigningContext
    except ImportError as exc:  # pragma: no cover - depends on the optional extra
        raise SigningError(
            "keyless signing needs sigstore-python: pip install 'modelpack-oci[keyless]'"
        ) from exc
    trust = ClientTrustConfig.staging() if staging else ClientTrustConfig.production()
    raw_token = detect_credential()
    if raw_token is None:  # interactive fallback (browser flow) for a person at a terminal
        raw_token = str(Issuer(trust.signing_config.get_oidc_url()).identity_token())
    token = IdentityToken(raw_token)
    statement = dsse.Statement(
        manifest_statement(manifest_desc.digest.hex, signed_at=signing_time_now()).to_bytes()
    )
    ctx = SigningContext.from_trust_config(trust)
    with ctx.signer(token) as signer:
        bundle_json = signer.sign_dsse(statement).to_json().encode()
    desc = store_keyless_bundle(target, manifest_desc, bundle_json)
    return {"digest": str(manifest_desc.digest), "signature": str(desc.digest), "identity": token.identity}


def store_keyless_bundle(target: Target, manifest_desc: Descriptor, bundle_json: bytes) -> Descriptor:
    """Store a keyless bundle as the manifest's signature referrer, exactly like a key-based one,
    and return once it is listed. Separate from the Sigstore round trip so that what is stored
    is the same whoever produced the bundle (tests make theirs with a local Sigstore)."""
    bundle = Bundle.from_bytes(bundle_json, source="sigstore bundle")
    if not bundle.keyless:
        raise SigningError("a keyless bundle carries its signing certificate; this one has none")
    started = time.monotonic()
    desc = push_bundle_referrer(
        target,
        manifest_desc,
        bundle,
        artifact_type=ARTIFACT_TYPE_SIGNATURE,
        predicate_type=PREDICATE_COSIGN_SIGN,
    )
    confirm_referrers(target, manifest_desc, [desc], write_seconds=time.monotonic() - started)
    return desc
