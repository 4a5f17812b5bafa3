"""Trust: keys, DSSE / Sigstore bundle signatures, model_signing interop, chunk tables, policy.

Entry points other layers use::

    sign_artifact(target, manifest_desc, private_key, *, chunk_table=True, directory_signature=True,
                  reference=None) -> SignResult
    verify_artifact(target, reference, manifest_desc, policy_or_keys, *, events=None)
        -> VerificationResult            # raises SignatureRefused after writing an event
    write_directory_signature(target, manifest_desc, path) -> str
    TrustPolicy.load(path).for_reference(ref) -> RepositoryPolicy
    modelpack.signing.chunks: ChunkTable, compute_chunk_table, push_chunk_table, load_chunk_table
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from modelpack.errors import (
    ChunkDigestMismatch,
    ChunkTableError,
    DirectorySignatureError,
    KeyLoadError,
    PolicyError,
    SignatureRefused,
    SigningError,
)

# Submodules load on first use (PEP 562): a chunk-verified stream needs keys and chunks, not the
# policy's YAML parser nor the signer, and a cache hit needs none of them (~35 ms of imports).
_LAZY = {
    "PrivateKey": "keys",
    "PublicKey": "keys",
    "generate_key": "keys",
    "load_private_key": "keys",
    "load_public_key": "keys",
    "RepositoryPolicy": "policy",
    "TrustPolicy": "policy",
    "SignResult": "sign",
    "sign_artifact": "sign",
    "write_directory_signature": "sign",
    "VerificationResult": "verify",
    "verify_artifact": "verify",
    "verify_directory": "verify",
}

if TYPE_CHECKING:
    from modelpack.signing.keys import (
        PrivateKey,
        PublicKey,
        generate_key,
        load_private_key,
        load_public_key,
    )
    from modelpack.signing.policy import RepositoryPolicy, TrustPolicy
    from modelpack.signing.sign import SignResult, sign_artifact, write_directory_signature
    from modelpack.signing.verify import VerificationResult, verify_artifact, verify_directory


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


__all__ = [
    "ChunkDigestMismatch",
    "ChunkTableError",
    "DirectorySignatureError",
    "KeyLoadError",
    "PolicyError",
    "PrivateKey",
    "PublicKey",
    "RepositoryPolicy",
    "SignResult",
    "SignatureRefused",
    "SigningError",
    "TrustPolicy",
    "VerificationResult",
    "generate_key",
    "load_private_key",
    "load_public_key",
    "sign_artifact",
    "verify_artifact",
    "verify_directory",
    "write_directory_signature",
]
