"""``keygen``, ``sign``, ``verify``: keys and signatures.

The signing steps of ``push`` and ``pull`` live with those commands (``modelpack.cli.transfer``,
``modelpack.cli.pull``), and what a registry holds (``audit``, ``diff``) in ``modelpack.cli.audit``;
all of them share ``trust_policy_from`` for ``--key``/``--policy``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from modelpack.cli.options import (
    build_target_options,
    emit_json,
    handle_errors,
    json_option,
    target_options,
)
from modelpack.cli.trust_options import (
    key_policy_options,
    keyless_identity_options,
    keyless_policy_from,
    read_passphrase,
    trust_policy_from,
)
from modelpack.errors import ModelpackError
from modelpack.events import EventLog
from modelpack.oci.reference import parse_reference
from modelpack.targets.opener import open_target
from modelpack.terminal import for_terminal

if TYPE_CHECKING:
    from modelpack.signing.policy import TrustPolicy


@click.command("keygen")
@click.option(
    "--out", "prefix", required=True, metavar="PREFIX", help="Writes PREFIX.key (0600) and PREFIX.pub."
)
@click.option(
    "--passphrase-stdin",
    is_flag=True,
    help="Encrypt the private key with a passphrase read from stdin (else MODELPACK_SIGNING_PASSPHRASE, else none).",
)
@json_option
@handle_errors
def keygen_cmd(prefix: str, passphrase_stdin: bool, as_json: bool) -> None:
    """Generate an ECDSA P-256 signing key pair (PKCS#8 PEM private key, SPKI PEM public key).

    \b
    CI recipe: run once, store PREFIX.key as a CI secret (and its passphrase, if any, as
    MODELPACK_SIGNING_PASSPHRASE), publish PREFIX.pub to the nodes' trust policy.

    \b
    Examples:
      modelpack keygen --out ./keys/modelpack-ci
      echo "$PASSPHRASE" | modelpack keygen --out ./keys/modelpack-ci --passphrase-stdin
    """
    from modelpack.signing.keys import generate_key, write_keypair

    key = generate_key()
    priv, pub = write_keypair(prefix, key, read_passphrase(passphrase_stdin))
    if as_json:
        emit_json({"privateKey": priv, "publicKey": pub, "keyId": key.key_id})
    else:
        click.echo(f"private key: {priv}\npublic key:  {pub}\nkey id:      {key.key_id}")


@click.command("sign")
@click.argument("reference")
@click.option("--key", "key_spec", help="Private key: a PEM file or env:VAR holding the PEM text.")
@click.option(
    "--keyless",
    is_flag=True,
    help="Sign with a Sigstore OIDC identity (needs the 'keyless' extra and network).",
)
@click.option(
    "--passphrase-stdin",
    is_flag=True,
    help="Read the key passphrase from stdin (after --password-stdin's line).",
)
@click.option("--no-chunk-table", is_flag=True, help="Do not publish the signed chunk-digest table.")
@click.option(
    "--no-directory-signature", is_flag=True, help="Do not publish the model_signing directory signature."
)
@click.option(
    "--chunk-size", type=click.IntRange(64 * 1024, 1 << 30), default=4 * 1024 * 1024, show_default=True
)
@click.option(
    "--chunk-layout",
    type=click.Choice(["aligned", "fixed"]),
    default="aligned",
    show_default=True,
    help="aligned: chunks begin and end on tensors and their dim-0 parts, and 2-D tensors' column "
    "blocks are signed too (a rank reads its share, rows or columns); fixed: every --chunk-size bytes "
    "(the form verifiers before 'aligned' accept).",
)
@target_options
@json_option
@handle_errors
def sign_cmd(
    reference: str,
    key_spec: str | None,
    keyless: bool,
    passphrase_stdin: bool,
    no_chunk_table: bool,
    no_directory_signature: bool,
    chunk_size: int,
    chunk_layout: str,
    as_json: bool,
    **kwargs: Any,
) -> None:
    """Sign an artifact that is already stored: manifest signature, directory signature and
    chunk table, each a referrer bound to the manifest digest (tags are not changed).

    The key is loaded before the registry is contacted, and the command exits 1 unless every
    signature it wrote can be read back from the registry's referrers list.

    \b
    Examples:
      modelpack sign registry.example.com/models/llama:v1 --key env:MODELPACK_SIGNING_KEY
      modelpack sign oci:./layout:v1 --key ./keys/modelpack-ci.key --no-directory-signature
    """
    if keyless and key_spec:
        raise click.UsageError("give --key or --keyless, not both")
    if not keyless and not key_spec:
        raise click.UsageError("--key is required (or --keyless)")
    topts = build_target_options(kwargs)  # reads --password-stdin's line before the passphrase
    key = None
    if key_spec:
        from modelpack.signing import load_private_key

        key = load_private_key(key_spec, read_passphrase(passphrase_stdin))
    ref = parse_reference(reference)
    target = open_target(ref, topts, for_write=True)
    desc = target.resolve(ref.identifier)
    if key is None:
        from modelpack.signing.keyless import sign_keyless

        result = sign_keyless(target, desc)
        if as_json:
            emit_json(result)
        else:
            click.echo(f"signed {ref} ({desc.digest}) keyless as {result.get('identity')}")
        return
    from modelpack.signing import sign_artifact

    res = sign_artifact(
        target,
        desc,
        key,
        chunk_table=not no_chunk_table,
        directory_signature=not no_directory_signature,
        reference=ref,
        chunk_size=chunk_size,
        aligned_chunks=chunk_layout == "aligned",
    )
    if as_json:
        emit_json({"reference": str(ref), **res.to_json()})
        return
    click.echo(f"signed {ref} ({desc.digest}) with key {key.key_id[:16]}")
    click.echo(f"  signature:           {res.signature.digest}")
    if res.directory_signature:
        click.echo(f"  directory signature: {res.directory_signature.digest}")
    if res.chunk_table:
        click.echo(f"  chunk table:         {res.chunk_table.digest}")
    for what, why in res.skipped.items():
        click.echo(f"  skipped {what}: {why}")


@click.command("verify")
@click.argument("reference")
@key_policy_options()
@click.option(
    "--directory", type=click.Path(exists=True, file_okay=False), help="Also check a pulled directory."
)
@click.option(
    "--signature", "signature_path", help="model_signing file for --directory (default: the stored one)."
)
@keyless_identity_options
@click.option("--events", "events_path", help="Append JSON events here ('-' for stderr).")
@target_options
@json_option
@handle_errors
def verify_cmd(
    reference: str,
    keys: tuple[str, ...],
    policy: str | None,
    directory: str | None,
    signature_path: str | None,
    cert_identity: str | None,
    cert_identity_regexp: str | None,
    cert_issuer: str | None,
    trusted_root: str | None,
    events_path: str | None,
    as_json: bool,
    **kwargs: Any,
) -> None:
    """Verify REFERENCE's signature against trusted keys or a policy; exit 1 when refused.

    Referrers that cannot be used (malformed, foreign, not an in-toto DSSE envelope) are skipped
    with a signing.referrer_skipped event; the refusal lists them when no valid signature remains.

    \b
    Examples:
      modelpack verify registry.example.com/models/llama:v1 --key ./keys/modelpack-ci.pub
      modelpack verify registry.example.com/models/llama:v1 --policy /etc/modelpack/policy.yaml --json
      modelpack verify REF --key ./keys/modelpack-ci.pub --directory /models/llama
      modelpack verify REF --certificate-oidc-issuer https://token.actions.githubusercontent.com \\
          --certificate-identity https://github.com/ORG/REPO/.github/workflows/publish-model.yml@refs/tags/v1
    """
    from modelpack.signing import verify_directory
    from modelpack.signing.bundle import Bundle
    from modelpack.signing.referrers import ARTIFACT_TYPE_MODEL_SIGNATURE, find_bundle_referrers
    from modelpack.signing.verify import resolve_policy, select_directory_bundle, verify_reference

    identity_flags = (cert_identity, cert_identity_regexp, cert_issuer, trusted_root)
    pol: TrustPolicy | None
    if any(identity_flags):
        if policy:
            raise click.UsageError("give --policy or --certificate-* options, not both")
        pol = keyless_policy_from(keys, cert_identity, cert_identity_regexp, cert_issuer, trusted_root)
    else:
        pol = trust_policy_from(keys, policy)
    if pol is None:
        raise click.UsageError("--key, --policy or --certificate-identity[-regexp] is required")
    topts = build_target_options(kwargs)
    ref = parse_reference(reference)
    events = EventLog.from_spec(None, events_path) if events_path else None
    target, desc, result = verify_reference(ref, pol, topts, events=events)
    doc = result.to_json()
    if directory:
        rp = resolve_policy(pol, ref)
        bundle: Bundle | None = None
        if not signature_path:
            bundles = [
                b.bundle
                for b in find_bundle_referrers(target, desc, ARTIFACT_TYPE_MODEL_SIGNATURE)
                if b.bundle
            ]
            manifest_raw, mt = target.fetch_manifest(str(desc.digest))
            from modelpack.oci.descriptor import Manifest

            bundle = select_directory_bundle(bundles, Manifest.parse(manifest_raw, media_type=mt), rp.keys)
            if bundle is None:
                raise ModelpackError(
                    f"{ref}: no directory signature by a trusted key to check {directory} against; "
                    "give the model_signing file with --signature"
                )
        files = verify_directory(
            directory,
            rp.keys,
            signature_path=signature_path,
            bundle=bundle,
            reference=str(ref),
            digest=str(desc.digest),
            events=events,
        )
        doc["directory"] = {"path": directory, "files": len(files), "status": "verified"}
    if as_json:
        emit_json(doc)
        return
    click.echo(f"{ref}: {result.status} ({for_terminal(result.reason)})")
    click.echo(f"  digest: {result.digest}")
    for s in result.signatures:
        reason = " — " + for_terminal(s.reason) if s.reason else ""
        click.echo(f"  {s.kind} signature {for_terminal(s.referrer[:19])}: {s.status}{reason}")
    click.echo(f"  directory signature: {result.directory_signature}; chunk table: {result.chunk_table}")
    if directory:
        click.echo(f"  {directory}: {doc['directory']['files']} files match the signed list")
