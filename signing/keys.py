"""ECDSA P-256 keys: generation, PEM (PKCS#8 private, SPKI public) and key ids.

A key id is the hex sha256 of the SPKI PEM bytes of the public key: the same value the OpenSSF
``model_signing`` tool writes as ``verificationMaterial.publicKey.hint``, so one id names a key in
our bundles, in theirs, in audit output and in events.

Keys are loaded from a file path (``/dev/fd/N`` included), from ``env:NAME`` (the PEM text in an
environment variable — what a CI secret usually is), or from PEM bytes. PEM *text* in the string
form is refused unread: a command-line argument is readable by every local user. A private key's passphrase comes from the
``passphrase`` argument, else ``MODELPACK_SIGNING_PASSPHRASE``; the CLI may read it from stdin.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from modelpack import settings
from modelpack.errors import KeyLoadError, KeyTextArgumentError
from modelpack.files import atomic_write_bytes

PASSPHRASE_ENV = settings.SIGNING_PASSPHRASE.name
MAX_KEY_BYTES = 64 * 1024


def _check_curve(key: ec.EllipticCurvePublicKey, source: str) -> None:
    if not isinstance(key.curve, ec.SECP256R1):
        raise KeyLoadError(
            f"{source}: ECDSA {key.curve.name} key; modelpack signs with P-256 (secp256r1) only"
        )


@dataclass(frozen=True)
class PublicKey:
    key: ec.EllipticCurvePublicKey
    source: str = ""
    pem: bytes = field(default=b"", compare=False)

    def __post_init__(self) -> None:
        if not self.pem:
            pem = self.key.public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
            object.__setattr__(self, "pem", pem)

    @property
    def key_id(self) -> str:
        return hashlib.sha256(self.pem).hexdigest()

    def verify(self, signature: bytes, data: bytes) -> bool:
        try:
            self.key.verify(signature, data, ec.ECDSA(hashes.SHA256()))
        except (InvalidSignature, ValueError):
            return False
        return True

    def __repr__(self) -> str:
        return f"PublicKey(key_id={self.key_id[:16]}…, source={self.source!r})"


@dataclass(frozen=True)
class PrivateKey:
    key: ec.EllipticCurvePrivateKey
    source: str = ""

    @property
    def public(self) -> PublicKey:
        return PublicKey(self.key.public_key(), source=self.source)

    @property
    def key_id(self) -> str:
        return self.public.key_id

    def sign(self, data: bytes) -> bytes:
        """DER-encoded ECDSA P-256/SHA-256 signature (what DSSE and cosign carry)."""
        return self.key.sign(data, ec.ECDSA(hashes.SHA256()))

    def __repr__(self) -> str:  # never print key material
        return f"PrivateKey(key_id={self.key_id[:16]}…, source={self.source!r})"


def generate_key() -> PrivateKey:
    return PrivateKey(ec.generate_private_key(ec.SECP256R1()), source="generated")


def private_key_pem(key: PrivateKey, passphrase: bytes | str | None = None) -> bytes:
    if isinstance(passphrase, str):
        passphrase = passphrase.encode()
    enc: serialization.KeySerializationEncryption = (
        serialization.BestAvailableEncryption(passphrase) if passphrase else serialization.NoEncryption()
    )
    return key.key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, enc)


def write_keypair(prefix: str, key: PrivateKey, passphrase: bytes | str | None = None) -> tuple[str, str]:
    """Write ``PREFIX.key`` (0600) and ``PREFIX.pub``; refuses to overwrite an existing key."""
    priv_path, pub_path = f"{prefix}.key", f"{prefix}.pub"
    for p in (priv_path, pub_path):
        if os.path.exists(p):
            raise KeyLoadError(f"{p} already exists; refusing to overwrite a key")
    directory = os.path.dirname(os.path.abspath(priv_path))
    os.makedirs(directory, exist_ok=True)
    atomic_write_bytes(priv_path, private_key_pem(key, passphrase), mode=0o600)
    atomic_write_bytes(pub_path, key.public.pem, mode=0o644)
    return priv_path, pub_path


def _read_source(spec: str | os.PathLike[str] | bytes, *, secret: bool) -> tuple[bytes, str]:
    if isinstance(spec, bytes):
        return spec, "<pem>"
    text = os.fspath(spec)
    if text.startswith("env:"):
        name = text[4:]
        value = os.environ.get(name)
        if not value:
            raise KeyLoadError(f"environment variable {name} (from {text!r}) is not set or empty")
        return value.encode(), text
    if not secret and text.lstrip().startswith("-----BEGIN"):
        return text.encode(), "<pem>"  # a public key is no secret (an inline policy key)
    if "-----BEGIN" in text or "\n" in text:
        # never echoed: the text is a secret, and it already sat in this process's argument list
        raise KeyTextArgumentError(
            "the key was given as PEM text, which every local user can read in /proc/*/cmdline; "
            "pass a key file path (0600), env:NAME (an environment variable holding the PEM), or "
            "/dev/fd/N (a descriptor, e.g. bash's <(…)); the key was not read"
        )
    try:
        with open(text, "rb") as f:
            data = f.read(MAX_KEY_BYTES + 1)
    except OSError as exc:
        raise KeyLoadError(f"{text}: cannot read key: {exc.strerror or exc}") from exc
    if len(data) > MAX_KEY_BYTES:
        raise KeyLoadError(f"{text}: larger than {MAX_KEY_BYTES} bytes; not a PEM key")
    return data, text


def load_private_key(
    spec: str | os.PathLike[str] | bytes, passphrase: bytes | str | None = None
) -> PrivateKey:
    """Load a PKCS#8 (or SEC1) PEM private key from a path, ``env:NAME`` or PEM bytes; a string
    holding PEM text raises ``KeyTextArgumentError`` (exit 2)."""
    data, source = _read_source(spec, secret=True)
    if passphrase is None:
        passphrase = settings.SIGNING_PASSPHRASE.get() or None
    if isinstance(passphrase, str):
        passphrase = passphrase.encode()
    try:
        key = serialization.load_pem_private_key(data, passphrase)
    except TypeError as exc:
        if passphrase is None:
            raise KeyLoadError(
                f"{source}: the private key is encrypted; set {PASSPHRASE_ENV} or pass the passphrase "
                "on stdin (--passphrase-stdin; --sign-passphrase-stdin for push)"
            ) from exc
        raise KeyLoadError(f"{source}: the private key is not encrypted but a passphrase was given") from exc
    except (ValueError, UnsupportedAlgorithm) as exc:
        raise KeyLoadError(
            f"{source}: not a usable PEM private key, or a wrong passphrase (a public key cannot sign)"
        ) from exc
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise KeyLoadError(f"{source}: {type(key).__name__}; modelpack signs with ECDSA P-256 keys")
    _check_curve(key.public_key(), source)
    return PrivateKey(key, source=source)


def load_public_key(spec: str | os.PathLike[str] | bytes) -> PublicKey:
    """Load an SPKI PEM public key from a path, ``env:NAME``, PEM bytes or PEM text."""
    data, source = _read_source(spec, secret=False)
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, UnsupportedAlgorithm) as exc:
        raise KeyLoadError(f"{source}: not a PEM public key (SubjectPublicKeyInfo)") from exc
    if not isinstance(key, ec.EllipticCurvePublicKey):
        raise KeyLoadError(f"{source}: {type(key).__name__}; modelpack verifies ECDSA P-256 keys")
    _check_curve(key, source)
    return PublicKey(key, source=source)


def key_id(key: PublicKey | PrivateKey) -> str:
    return key.key_id
