"""The trust and verification options: ``--key``/``--policy``, keyless identities, signing keys
and their passphrases.

Split from ``modelpack.cli.options`` so that the flags which decide what a command trusts sit
together, in one place to review. Like ``options`` this module imports only click: the signing
library (and with it cryptography) is imported inside the function that turns the flags into a
policy or a key, and only when a key, policy or identity was given, so a pull without
verification (a node's cache hit) never pays for it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import click

if TYPE_CHECKING:
    from modelpack.signing.policy import TrustPolicy

F = TypeVar("F", bound=Callable[..., Any])


def _apply(fn: F, opts: list[Callable[[F], F]]) -> F:
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


def key_policy_options(
    key_help: str = "Trusted public key (PEM file or env:VAR); repeatable.",
) -> Callable[[F], F]:
    """``--key`` (repeatable, into ``keys``) and ``--policy``: what ``trust_policy_from`` reads."""

    def apply(fn: F) -> F:
        return _apply(
            fn,
            [
                click.option("--key", "keys", multiple=True, help=key_help),
                click.option(
                    "--policy", type=click.Path(exists=True, dir_okay=False), help="Trust policy YAML."
                ),
            ],
        )

    return apply


def keyless_identity_options(fn: F) -> F:
    """cosign's keyless identity flags (``--certificate-identity[-regexp]``,
    ``--certificate-oidc-issuer``, ``--trusted-root``): what ``keyless_policy_from`` reads."""
    return _apply(
        fn,
        [
            click.option(
                "--certificate-identity",
                "cert_identity",
                help="Trust a keyless (Sigstore) signature whose certificate names exactly this subject.",
            ),
            click.option(
                "--certificate-identity-regexp",
                "cert_identity_regexp",
                help="… or whose subject matches this pattern whole.",
            ),
            click.option(
                "--certificate-oidc-issuer",
                "cert_issuer",
                help="The OIDC issuer that certificate must name (with --certificate-identity[-regexp]).",
            ),
            click.option(
                "--trusted-root",
                type=click.Path(exists=True, dir_okay=False),
                help="Sigstore trusted_root.json for keyless signatures (default: Sigstore's public-good "
                "root, cached).",
            ),
        ],
    )


def trust_policy_from(keys: Sequence[str], policy: str | None) -> TrustPolicy | None:
    """``--key``/``--policy`` → the TrustPolicy to verify against; None when neither was given.

    The signing library (and with it cryptography) is imported only when a key or policy was
    given, so a pull without verification never pays for it.
    """
    if policy and keys:
        raise click.UsageError("give --key or --policy, not both")
    if not policy and not keys:
        return None
    from modelpack.signing.keys import load_public_key
    from modelpack.signing.policy import TrustPolicy

    if policy:
        return TrustPolicy.load(policy)
    return TrustPolicy.from_keys([load_public_key(k) for k in keys])


def keyless_policy_from(
    keys: Sequence[str],
    identity: str | None,
    identity_regexp: str | None,
    issuer: str | None,
    trusted_root: str | None,
) -> TrustPolicy:
    """cosign's ``--certificate-identity[-regexp]`` / ``--certificate-oidc-issuer`` as a policy of
    one rule: that identity (and any ``--key``) trusted for the reference given."""
    from modelpack.signing.keyless_trust import KeylessTrust, TrustedIdentity
    from modelpack.signing.keys import load_public_key
    from modelpack.signing.policy import RepositoryPolicy, TrustPolicy

    if not issuer or bool(identity) == bool(identity_regexp):
        raise click.UsageError(
            "keyless trust needs --certificate-oidc-issuer and one of --certificate-identity / "
            "--certificate-identity-regexp"
        )
    trust = KeylessTrust(
        (TrustedIdentity(issuer, identity or "", identity_regexp or ""),),
        os.path.abspath(trusted_root or "") if trusted_root else "",
    )
    rp = RepositoryPolicy(
        tuple(load_public_key(k) for k in keys), True, rule="--certificate-identity", keyless=trust
    )
    return TrustPolicy(default=rp)


def read_passphrase(from_stdin: bool) -> str | None:
    """A signing key's passphrase: a line of stdin when asked, else MODELPACK_SIGNING_PASSPHRASE.

    Never a flag value: command lines end up in shell history and process lists."""
    if from_stdin:
        line = sys.stdin.readline().rstrip("\n")
        return line or None
    from modelpack.settings import SIGNING_PASSPHRASE

    return SIGNING_PASSPHRASE.get() or None


def push_sign_options(fn: F) -> F:
    """``--sign-key`` and ``--sign-passphrase-stdin`` of ``push`` (and ``push --base``): what
    ``push_signing_key`` reads."""
    return _apply(
        fn,
        [
            click.option(
                "--sign-key",
                help="Sign the pushed manifest before tagging it: private key PEM file or env:VAR.",
            ),
            click.option(
                "--sign-passphrase-stdin",
                is_flag=True,
                help="Read the signing key passphrase from stdin (else MODELPACK_SIGNING_PASSPHRASE).",
            ),
        ],
    )


def push_signing_key(kwargs: dict[str, Any]) -> Any:
    """Pop the push signing options from ``kwargs`` and load the key now, before any upload (a
    public key, an unset ``env:`` variable or a wrong passphrase fails a push that sent nothing).
    The passphrase line is read after ``--password-stdin``'s."""
    key_spec = kwargs.pop("sign_key", None)
    from_stdin = kwargs.pop("sign_passphrase_stdin", False)
    if not key_spec:
        return None
    from modelpack.signing import load_private_key

    return load_private_key(key_spec, read_passphrase(from_stdin))
