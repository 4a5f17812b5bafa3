"""The adapter parts of ``push --base``, ``pull --with-adapters/--adapter`` and ``inspect``.

Skins over ``modelpack.api.adapters``; the commands that own the flags (``cli.transfer``,
``cli.pull``, ``cli.pack``) hand over here only when an adapter flag was given, so a plain
pull imports none of this.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import click

from modelpack import settings
from modelpack.cli.options import (
    build_target_options,
    emit_json,
    handle_errors,
    human_size,
    json_option,
    signals_interrupt,
)
from modelpack.cli.trust_options import key_policy_options, push_signing_key, trust_policy_from
from modelpack.terminal import for_terminal

if TYPE_CHECKING:
    from modelpack.oci.descriptor import Manifest
    from modelpack.targets.options import TargetOptions


def push_adapter_cmd(
    source: str,
    destination: str,
    chunk_size: int | None,
    jobs: int,
    progress: str,
    as_json: bool,
    kwargs: dict[str, Any],
) -> None:
    """``push ADAPTER_DIR REF --base BASE``."""
    from modelpack.api.adapters import push_adapter
    from modelpack.cli.pack_options import pack_options_from

    base = kwargs.pop("base")
    if kwargs.pop("artifact_format", "artifact") != "artifact" or kwargs.pop("compression", None):
        raise click.UsageError("--base pushes a ModelPack adapter artifact: drop --format/--compression")
    if kwargs.pop("modelfile", None):
        raise click.UsageError("--base pushes a PEFT adapter directory: drop --modelfile")
    if kwargs.pop("mount_from", ()):
        raise click.UsageError("--mount-from does not apply to --base (adapters are small)")
    popts = pack_options_from(kwargs, progress)
    topts = build_target_options(kwargs, registry=destination)
    if chunk_size:
        topts = dataclasses.replace(topts, chunk_size=chunk_size)
    key = push_signing_key(kwargs)  # after --password-stdin's line, before any upload
    result = push_adapter(
        source, destination, base, pack_options=popts, target_options=topts, jobs=jobs, sign_key=key
    )
    if as_json:
        emit_json(result.to_json())
        return
    if result.base_resolved_from_tag:
        click.echo(
            f"--base tag {for_terminal(result.base_resolved_from_tag)} resolved to {result.base}; "
            "the adapter is pinned to that digest",
            err=True,
        )
    c = result.copy
    click.echo(
        f"pushed adapter {for_terminal(result.name)} of {result.base} to {for_terminal(result.reference)}: "
        f"{c.blobs_copied} uploaded ({human_size(c.bytes_copied)}), {c.blobs_skipped} already there",
        err=True,
    )
    click.echo(result.digest)


def pull_with_adapters_cmd(
    reference: str,
    dest_dir: str | None,
    cache_dir: str | None,
    adapters: tuple[str, ...],
    with_adapters: bool,
    *,
    jobs: int,
    progress: str,
    as_json: bool,
    force: bool,
    kwargs: dict[str, Any],
    hold: float | None = None,
) -> None:
    """``pull BASE [DEST] [--cache DIR [--hold D]] --with-adapters / --adapter REF``."""
    from modelpack.api.adapters import pull_with_adapters

    if kwargs.pop("signature_path", None):
        raise click.UsageError("--signature does not apply to pulls with adapters")
    if kwargs.pop("allow_rollback", False):
        raise click.UsageError("--allow-rollback does not apply to pulls with adapters")
    kwargs.pop("trust_events", None)
    topts = build_target_options(kwargs)
    policy = trust_policy_from(tuple(kwargs.pop("trust_keys", ()) or ()), kwargs.pop("trust_policy", None))
    cache = None
    if cache_dir is not None:
        from modelpack.mount.cache import NodeCache

        cache = NodeCache(cache_dir)
    with signals_interrupt():
        result = pull_with_adapters(
            reference,
            dest_dir,
            cache=cache,
            with_adapters=with_adapters,
            adapters=adapters,
            policy=policy,
            target_options=topts,
            jobs=jobs,
            progress=progress,
            force=force,
            hold=hold,
        )
    if as_json:
        emit_json(result.to_json())
        return
    from modelpack.timestamps import rfc3339_utc

    for note in result.skipped:
        click.echo(f"skipped a listed adapter: {for_terminal(note)}", err=True)
    for a in result.adapters:
        held = f"; held until {rfc3339_utc(a.hold_until)}" if a.hold_path else ""
        click.echo(f"adapter {a.name} {a.descriptor.digest} at {for_terminal(a.path)}{held}", err=True)
    base_hold = getattr(result.base, "hold_path", "")
    held = f"; held until {rfc3339_utc(result.base.hold_until)}" if base_hold else ""
    click.echo(
        f"pulled {result.digest} with {len(result.adapters)} adapter(s) to {for_terminal(result.path)}{held}",
        err=True,
    )
    click.echo(result.path if cache is not None else result.digest)


def adapters_section(manifest: Manifest, reference: str, topts: TargetOptions) -> dict[str, Any]:
    """``inspect``'s adapter lines: for an adapter, its name and base; for a model, its verified
    adapters (and the listed referrers that were not, with why). Nothing for other artifacts."""
    from modelpack.api.adapters import list_adapters
    from modelpack.errors import ModelpackError
    from modelpack.packing.adapter import adapter_name_of
    from modelpack.packing.adapter_referrers import is_model_manifest

    name = adapter_name_of(manifest)
    if name is not None:
        base = str(manifest.subject.digest) if manifest.subject is not None else None
        return {"adapter": {"name": name, "base": base}}
    if not is_model_manifest(manifest):
        return {}
    try:
        adapters, skipped = list_adapters(reference, topts)
    except ModelpackError as exc:  # a listing that fails must not hide the artifact itself
        return {"adapters": [], "skippedAdapters": [f"adapters not listed: {exc}"]}
    return {"adapters": [a.to_json() for a in adapters], "skippedAdapters": skipped}


def print_adapters(doc: dict[str, Any]) -> None:
    if "adapter" in doc:
        a = doc["adapter"]
        click.echo(f"Adapter:       {for_terminal(a['name'])} (LoRA) of base {a['base']}")
        return
    if doc.get("adapters"):
        click.echo(f"Adapters:      {len(doc['adapters'])}")
    for a in doc.get("adapters", []):
        click.echo(f"  {for_terminal(a['name'])}  {a['digest']}  {human_size(a['totalSize'])}")
    for note in doc.get("skippedAdapters", []):
        click.echo(f"  skipped referrer: {for_terminal(note)}")


@click.command("lora-args")
@click.argument("base")
@click.option(
    "--cache",
    "cache_dir",
    envvar=settings.CACHE.name,
    default=None,
    metavar="DIR",
    help="Node cache directory, which must exist (default: $MODELPACK_CACHE, else "
    "$XDG_CACHE_HOME/modelpack, else ~/.cache/modelpack).",
)
@click.option(
    "--adapter",
    "adapter_refs",
    multiple=True,
    metavar="REF",
    help="Serve only this cached adapter (reference or digest; repeatable); refused unless its subject is BASE "
    "and it passed BASE's trust.",
)
@key_policy_options(
    "Serve only adapters this public key verified when the cache pulled them (PEM file or env:VAR; "
    "repeatable); BASE too."
)
@json_option
@handle_errors
def cache_lora_args(
    base: str,
    cache_dir: str | None,
    adapter_refs: tuple[str, ...],
    keys: tuple[str, ...],
    policy: str | None,
    as_json: bool,
) -> None:
    """Print vLLM's LoRA flags for BASE and its cached adapters (no network; creates nothing).

    Every cached adapter whose subject is BASE (pulled with 'pull --cache --with-adapters'), each
    checked again from the cache (manifest digest, subject, name, rank): '--enable-lora
    --max-lora-rank R --max-loras N --lora-modules NAME=SNAPSHOT …', shell-quoted on one line.
    Requests then name an adapter as the model.

    Only adapters that passed the trust BASE passed on this node are served: under --key/--policy
    (default: $MODELPACK_POLICY or $MODELPACK_POLICY_YAML) the cache must have recorded that the
    policy accepted BASE and each adapter; without a policy, that a key which verified BASE also
    verified the adapter. Another adapter of BASE in the cache (another job pulled it without the
    policy) is left out with a line on stderr; one named with --adapter fails the command.

    \b
    Examples:
      modelpack pull reg.example/llama@sha256:… --cache /var/cache/modelpack --with-adapters --policy policy.yaml
      modelpack cache lora-args reg.example/llama@sha256:… --cache /var/cache/modelpack --policy policy.yaml
      python -m vllm.entrypoints.openai.api_server --model "$(modelpack cache path reg.example/llama@sha256:… \\
          --cache /var/cache/modelpack)" $(modelpack cache lora-args reg.example/llama@sha256:… \\
          --cache /var/cache/modelpack --policy policy.yaml)
    """
    import shlex

    from modelpack.cli.cache import open_cache
    from modelpack.serving.lora_adapters import select_cached_adapters, vllm_lora_args
    from modelpack.signing.policy import policy_from_environ

    trust = trust_policy_from(keys, policy)
    if trust is None:
        trust = policy_from_environ()
    selection = select_cached_adapters(open_cache(cache_dir), base, adapter_refs, policy=trust)
    for line in selection.left_out:
        click.echo(for_terminal(line), err=True)
    adapters = selection.served
    args = vllm_lora_args(adapters)
    if as_json:
        emit_json(
            {
                "base": base,
                "adapters": [a.to_json() for a in adapters],
                "skippedAdapters": selection.left_out,
                "args": args,
            }
        )
        return
    if not adapters:
        click.echo(f"no cached adapters of {for_terminal(base)}", err=True)
    click.echo(shlex.join(args))
