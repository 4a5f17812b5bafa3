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

from modelpack.errors import (
    ChunkDigestMismatch,
    ChunkTableError,
    DirectorySignatureError,
    KeyLoadError,
    PolicyError,
    SignatureRefused,
    SigningError,
)

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
