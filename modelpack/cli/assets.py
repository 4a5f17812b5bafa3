"""``assets push|pull|fingerprint|ls``: compile caches as fingerprinted, signed referrers of a model.

Thin skins over ``modelpack.assets``; the library (and torch, which the fingerprint needs) is
imported inside each command, so ``modelpack --help`` stays light.
"""

from __future__ import annotations

from typing import Any

import click

from modelpack.assets.kinds import kind_names
from modelpack.cli.options import (
    SIZE,
    build_target_options,
    emit_json,
    handle_errors,
    human_size,
    json_option,
    target_options,
)
from modelpack.cli.trust_options import key_policy_options, read_passphrase, trust_policy_from


def _environment_options(fn: Any) -> Any:
    """What the model half of the fingerprint needs when it is computed here."""
    opts = [
        click.option(
            "--fingerprint",
            "fingerprint_path",
            type=click.Path(exists=True, dir_okay=False),
            help="A fingerprint file (from 'modelpack assets fingerprint') instead of this machine's.",
        ),
        click.option("--device", default="cpu", show_default=True, help="Device the engine compiles for."),
        click.option("--tp-size", type=click.IntRange(1, 4096), default=1, show_default=True),
        click.option(
            "--dtype", help="Dtype the engine computes in (default: the checkpoint's), e.g. bfloat16."
        ),
        click.option("--quantization", help="Quantization the engine applies (default: the model config's)."),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


def _kind_option(fn: Any) -> Any:
    return click.option(
        "--kind",
        required=True,
        type=click.Choice(kind_names()),
        help="Which runtime's cache: inductor (TORCHINDUCTOR_CACHE_DIR), triton (TRITON_CACHE_DIR), "
        "vllm (vLLM's $VLLM_CACHE_ROOT/torch_compile_cache; push it with the --fingerprint file the "
        "'modelpack' load format wrote next to it).",
    )(fn)


def _events(spec: str | None) -> Any:
    from modelpack.events import EventLog

    return EventLog.from_spec(None, spec) if spec else None


@click.group("assets")
def assets_group() -> None:
    """Ship compile caches (Inductor, Triton, vLLM) as fingerprinted, signed referrers of a model.

    \b
    Example — build machine (after a warm-up run compiled into $TORCHINDUCTOR_CACHE_DIR):
      modelpack assets push registry.example/m@sha256:… "$TORCHINDUCTOR_CACHE_DIR" --kind inductor \\
          --sign-key env:MODELPACK_SIGNING_KEY
    Replica, before the engine compiles:
      modelpack assets pull registry.example/m@sha256:… /tmp/inductor --kind inductor \\
          --policy /etc/modelpack/policy.yaml && export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
    """


@assets_group.command("push")
@click.argument("model_ref")
@click.argument("directory", type=click.Path(exists=True, file_okay=False))
@_kind_option
@_environment_options
@click.option("--sign-key", help="Sign the asset: a PEM private key file or env:VAR (same keys as models).")
@click.option("--passphrase-stdin", is_flag=True, help="Read the signing key's passphrase from stdin.")
@click.option("--events", "events_spec", metavar="-|FILE", help="Append JSON events to FILE (- for stderr).")
@target_options
@json_option
@handle_errors
def push_cmd(
    model_ref: str,
    directory: str,
    kind: str,
    fingerprint_path: str | None,
    device: str,
    tp_size: int,
    dtype: str | None,
    quantization: str | None,
    sign_key: str | None,
    passphrase_stdin: bool,
    events_spec: str | None,
    as_json: bool,
    **kwargs: Any,
) -> None:
    """Push the KIND cache in DIRECTORY as a runtime asset of MODEL_REF (a referrer of its manifest).

    The asset records the fingerprint of the environment the cache was built in: this machine
    for --device/--tp-size (and --dtype/--quantization when the engine overrides the model's),
    or --fingerprint FILE. Lock and temp files are left out. Prints the asset's digest.

    \b
    Example (CPU, a cache torch.compile just filled):
      TORCHINDUCTOR_CACHE_DIR=/tmp/ind python serve_warmup.py
      modelpack assets push localhost:5000/models/llama:v1 /tmp/ind --kind inductor

    \b
    Example (vLLM, after a cold start with --load-format modelpack and the 'assets' setting):
      modelpack assets push localhost:5000/models/llama@sha256:… \\
          "$VLLM_CACHE_ROOT/torch_compile_cache" --kind vllm \\
          --fingerprint "$VLLM_CACHE_ROOT/modelpack-fingerprint.json"
    """
    from modelpack.assets import push_asset

    topts = build_target_options(kwargs)
    result = push_asset(
        model_ref,
        directory,
        kind,
        fingerprint=fingerprint_path,
        device=device,
        tp_size=tp_size,
        dtype=dtype,
        quantization=quantization,
        sign_key=sign_key,
        passphrase=read_passphrase(passphrase_stdin) if sign_key else None,
        target_options=topts,
        events=_events(events_spec),
    )
    if as_json:
        emit_json(result.to_json())
        return
    signed = f", signed by {result.key_id[:16]}" if result.key_id else ""
    click.echo(
        f"pushed {kind} asset of {result.model_digest}: {result.files} files, {human_size(result.bytes)} "
        f"({human_size(result.compressed_bytes)} compressed){signed}; fingerprint {result.fingerprint.digest}",
        err=True,
    )
    click.echo(str(result.asset.digest))


@assets_group.command("pull")
@click.argument("model_ref")
@click.argument("dest", type=click.Path(file_okay=False))
@_kind_option
@_environment_options
@key_policy_options()
@click.option(
    "--allow-unsigned",
    is_flag=True,
    help="Use an asset nobody signed (an asset is code the runtime runs; without --policy/--key "
    "the pull is refused unless this is given).",
)
@click.option(
    "--max-bytes",
    type=SIZE,
    default=None,
    help="Write at most SIZE into DEST (besides the asset's recorded size and the free space).",
)
@click.option(
    "--cache",
    "cache_dir",
    metavar="DIR",
    help="Keep the asset in this node cache (next to the model snapshots, same GC); DEST is a view.",
)
@click.option("--events", "events_spec", metavar="-|FILE", help="Append JSON events to FILE (- for stderr).")
@click.option("--start-id", help="Group the events with a model start (default: $MODELPACK_START_ID).")
@click.option("--require-hit", is_flag=True, help="Exit 1 unless an asset was materialised.")
@target_options
@json_option
@handle_errors
def pull_cmd(
    model_ref: str,
    dest: str,
    kind: str,
    fingerprint_path: str | None,
    device: str,
    tp_size: int,
    dtype: str | None,
    quantization: str | None,
    keys: tuple[str, ...],
    policy: str | None,
    allow_unsigned: bool,
    max_bytes: int | None,
    cache_dir: str | None,
    events_spec: str | None,
    start_id: str | None,
    require_hit: bool,
    as_json: bool,
    **kwargs: Any,
) -> None:
    """Materialise at DEST the KIND asset of MODEL_REF built for exactly this environment.

    The running fingerprint (or --fingerprint FILE) must match a stored asset field for field;
    the asset must be signed by a key the trust policy of the model's repository trusts
    (--policy/--key; required: an asset is code, and --allow-unsigned is the only way around it)
    and hash to its digest; then it appears at DEST in one rename. A near miss or a failed check
    is refused with an event naming the reason and nothing is written: the engine compiles cold.
    Prints DEST on a hit; exit 0 either way (1 with --require-hit unless hit).

    \b
    Example (CPU replica):
      modelpack assets pull localhost:5000/models/llama:v1 /tmp/ind --kind inductor \\
          --policy /etc/modelpack/policy.yaml --json
      TORCHINDUCTOR_CACHE_DIR=/tmp/ind python serve.py
    """
    from modelpack.assets import pull_asset

    pol = trust_policy_from(keys, policy)
    if pol is None and not allow_unsigned:
        raise click.UsageError(
            "an asset is code the runtime executes: give --policy or --key (whose signers may ship "
            "compile caches), or --allow-unsigned to use an asset nobody signed"
        )
    if pol is not None and allow_unsigned:
        raise click.UsageError("--allow-unsigned applies without --policy/--key; give one or the other")
    result = pull_asset(
        model_ref,
        dest,
        kind,
        fingerprint=fingerprint_path,
        device=device,
        tp_size=tp_size,
        dtype=dtype,
        quantization=quantization,
        policy=pol,
        allow_unsigned=allow_unsigned,
        max_bytes=max_bytes,
        target_options=build_target_options(kwargs),
        events=_events(events_spec),
        start_id=start_id,
        require_hit=require_hit,
        cache=cache_dir,
    )
    if as_json:
        emit_json(result.to_json())
        return
    if result.state == "hit":
        how = "already present" if result.present else f"{result.files} files, {human_size(result.bytes)}"
        click.echo(f"hit: {kind} asset {result.asset} ({how}; signature {result.signature})", err=True)
        click.echo(result.path)
    else:
        click.echo(f"{result.state}: {result.reason}; the engine will compile cold", err=True)


@assets_group.command("fingerprint")
@click.argument("model_ref")
@click.option("--out", "out_path", type=click.Path(dir_okay=False), help="Write the fingerprint file here.")
@click.option("--device", default="cpu", show_default=True, help="Device the engine compiles for.")
@click.option("--tp-size", type=click.IntRange(1, 4096), default=1, show_default=True)
@click.option("--dtype", help="Dtype the engine computes in (default: the checkpoint's), e.g. bfloat16.")
@click.option("--quantization", help="Quantization the engine applies (default: the model config's).")
@target_options
@json_option
@handle_errors
def fingerprint_cmd(
    model_ref: str,
    out_path: str | None,
    device: str,
    tp_size: int,
    dtype: str | None,
    quantization: str | None,
    as_json: bool,
    **kwargs: Any,
) -> None:
    """Compute this machine's runtime-asset fingerprint for MODEL_REF (for 'pull --fingerprint').

    Run it where the engine runs (the GPU node); an init container without a GPU or torch then
    pulls with --fingerprint FILE. Only the model's safetensors headers are read.

    \b
    Example:
      modelpack assets fingerprint registry.example/m@sha256:… --device cuda:0 --tp-size 8 --out fp.json
    """
    from modelpack.assets import running_fingerprint
    from modelpack.oci.reference import parse_reference
    from modelpack.targets.opener import open_readable

    ref = parse_reference(model_ref)
    target = open_readable(ref, build_target_options(kwargs))
    model = target.resolve(ref.identifier)
    fp = running_fingerprint(
        target, model, device=device, tp_size=tp_size, dtype=dtype, quantization=quantization
    )
    if out_path:
        fp.write(out_path)
    if as_json or not out_path:
        emit_json({"fingerprint": fp.to_dict(), "digest": fp.digest})
    else:
        click.echo(f"{out_path}: {fp.digest}")


@assets_group.command("ls")
@click.argument("model_ref")
@click.option("--kind", type=click.Choice(kind_names()), help="Only assets of this kind.")
@target_options
@json_option
@handle_errors
def ls_cmd(model_ref: str, kind: str | None, as_json: bool, **kwargs: Any) -> None:
    """List MODEL_REF's runtime assets, newest first, with the fingerprint each was built under.

    \b
    Example:
      modelpack assets ls localhost:5000/models/llama:v1 --kind inductor --json
    """
    from modelpack.assets import list_assets
    from modelpack.oci.reference import parse_reference
    from modelpack.targets.opener import open_readable

    ref = parse_reference(model_ref)
    target = open_readable(ref, build_target_options(kwargs))
    model = target.resolve(ref.identifier)
    assets = list_assets(target, model, kind)
    if as_json:
        emit_json(
            {"reference": model_ref, "digest": str(model.digest), "assets": [a.to_json() for a in assets]}
        )
        return
    for a in assets:
        if a.record is None:
            click.echo(f"{a.digest[:19]}…  unusable: {a.error}")
            continue
        fp = a.record.fingerprint
        click.echo(
            f"{a.digest[:19]}…  {a.record.kind:<9} {a.created or '-':<21} {human_size(a.record.size):>10}  "
            f"{fp.device_kind} {fp.device_arch.split(';')[0]} torch {fp.torch_version} tp {fp.tp_size} "
            f"{fp.dtype}  fp {fp.digest[7:19]}"
        )
    click.echo(f"{len(assets)} assets of {model.digest}", err=True)
