"""The options, output helpers and error mapping every command module shares.

Only click and the error hierarchy are imported here: every command loads this module, so
what it imports is paid by every start. The library behind an option (targets, signing) is
imported inside the function that turns the flags into library objects. The options that
decide what a command trusts (keys, policies, keyless identities, passphrases) are in
``modelpack.cli.trust_options``; how a command fails (one line, an exit code, signals) in
``modelpack.cli.failures``, whose names are re-exported here.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import click

from modelpack.cli.failures import (  # re-exported: where command modules find them
    PASS_THROUGH,
    debug_requested,
    debug_traceback,
    describe_os_error,
    exit_on_closed_pipe,
    handle_errors,
    one_line,
    report_failure,
    signals_interrupt,
)
from modelpack.errors import ModelpackError

if TYPE_CHECKING:
    from modelpack.targets.opener import TargetOptions

F = TypeVar("F", bound=Callable[..., Any])


def human_size(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def parse_size(text: str) -> int:
    """``500M``, ``2GiB``, ``1.5G``, ``123`` → bytes (binary units; K/M/G/T and KiB… alike)."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = 1
    for suffix, m in (("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30), ("T", 1 << 40)):
        if t.endswith(suffix):
            mult, t = m, t[:-1]
            break
    try:
        value = float(t)
    except ValueError as exc:
        raise click.BadParameter(f"{text!r} is not a size (examples: 512M, 2GiB, 1073741824)") from exc
    if value <= 0:
        raise click.BadParameter(f"{text!r} must be positive")
    return int(value * mult)


class SizeType(click.ParamType):
    """A byte count written the way people write sizes (``--max-file-size 4GiB``)."""

    name = "SIZE"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        return parse_size(str(value))


SIZE = SizeType()


def emit_json(doc: Any) -> None:
    click.echo(json.dumps(doc, indent=2, sort_keys=True))


def progress_option(fn: F) -> F:
    return click.option(
        "--progress",
        type=click.Choice(["auto", "on", "off"]),
        default="auto",
        show_default=True,
        help="Progress bars: auto shows them on a terminal and never in CI.",
    )(fn)


def json_option(fn: F) -> F:
    return click.option(
        "--json",
        "as_json",
        is_flag=True,
        help="Print machine-readable JSON on stdout (camelCase keys, RFC 3339 UTC times; its JSON "
        "Schema is modelpack/cli/schemas/<command>.json in the installed package).",
    )(fn)


def jobs_option(fn: F) -> F:
    return click.option(
        "--jobs",
        "-j",
        type=click.IntRange(1, 64),
        default=4,
        show_default=True,
        help="Concurrent blob transfers.",
    )(fn)


class DurationType(click.ParamType):
    """A duration written the way people write them (``--retry-for 2m``)."""

    name = "DURATION"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        if isinstance(value, (int, float)):
            return float(value)
        from modelpack.settings import parse_duration

        try:
            return parse_duration(str(value))
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


DURATION = DurationType()


class TimeoutType(DurationType):
    """A positive duration (``--timeout 2``, ``30s``): zero would mean a client that never waits."""

    name = "SECONDS"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        seconds = super().convert(value, param, ctx)
        if not seconds > 0:
            self.fail(f"{value!r} must be a positive number of seconds", param, ctx)
        return seconds


TIMEOUT = TimeoutType()


def global_timeout() -> float | None:
    """``modelpack --timeout SECONDS`` of the running command (None: not given, so
    ``MODELPACK_TIMEOUT`` through ``TargetOptions.from_environ``, else the default)."""
    ctx = click.get_current_context(silent=True)
    value = ctx.find_root().params.get("timeout") if ctx is not None else None
    return float(value) if value is not None else None


def target_options(fn: F) -> F:
    """Connection flags every command that touches a registry or bucket accepts."""
    opts = [
        click.option(
            "--plain-http", is_flag=True, help="Use HTTP, not HTTPS (always allowed for loopback registries)."
        ),
        click.option(
            "--ca-file", type=click.Path(exists=True, dir_okay=False), help="PEM CA bundle for registry TLS."
        ),
        click.option(
            "--username",
            "-u",
            help="Registry user, for the registry this command names (the destination of push, cp "
            "and tag) and no other; else MODELPACK_REGISTRY_USERNAME or docker config.",
        ),
        click.option("--password-stdin", is_flag=True, help="Read the registry password from stdin."),
        click.option(
            "--retry-for",
            type=DURATION,
            default=None,
            help="Keep retrying through a network or registry outage this long (30s, 2m; 0: never). "
            "Cut downloads resume from the byte reached. Else MODELPACK_RETRY_FOR; default 60s.",
        ),
        click.option(
            "--mirror",
            "mirrors",
            multiple=True,
            metavar="URL",
            help="Fetch blobs, and manifests by digest, from this mirror or peer ('cache serve') "
            "before the origin (repeatable, in order; e.g. http://node-a:5050). Tags always resolve "
            "at the origin; anything a mirror cannot deliver intact, or delivers below its floor "
            "(MODELPACK_MIRROR_MIN_RATE), comes from the next one and the origin. Else "
            "MODELPACK_MIRRORS (space or comma separated).",
        ),
        click.option(
            "--hosts-dir",
            type=click.Path(file_okay=False),
            default=None,
            help="containerd-style mirror config: DIR/<host[:port]>/hosts.toml "
            "(else MODELPACK_HOSTS_DIR) [default: /etc/containerd/certs.d].",
        ),
        click.option("--s3-endpoint", help="S3-compatible endpoint URL (else MODELPACK_S3_ENDPOINT)."),
        click.option("--s3-region", envvar="AWS_REGION", help="S3 region."),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


def build_target_options(kwargs: dict[str, Any], *, registry: str | None = None) -> TargetOptions:
    """Pop the connection flags out of a command's kwargs into a TargetOptions: the
    environment's (``TargetOptions.from_environ``, docs/configuration.md) with every flag given
    on the command line in its place.

    ``--username``/``--password-stdin`` (and the environment's credentials) are bound to one
    registry host: ``registry`` (a reference or host) when the command says which, else the one
    registry host among the command's arguments. A command naming two registries without saying
    which the credentials are for is a usage error, never a guess.
    """
    from modelpack.targets.opener import TargetOptions

    password = None
    if kwargs.pop("password_stdin", False):
        password = sys.stdin.readline().rstrip("\n")
    username = kwargs.pop("username", None)
    host = _registry_host(registry) if registry else _command_registry_host(bool(username))
    env = TargetOptions.from_environ()
    retry_for = kwargs.pop("retry_for", None)
    timeout = global_timeout()
    return dataclasses.replace(
        env,
        plain_http=kwargs.pop("plain_http", False) or env.plain_http,
        ca_file=kwargs.pop("ca_file", None) or env.ca_file,
        username=username,
        password=password,
        credentials_host=host,
        retry_for=env.retry_for if retry_for is None else retry_for,
        timeout=env.timeout if timeout is None else timeout,
        mirrors=list(kwargs.pop("mirrors", None) or ()) or env.mirrors,
        hosts_dir=kwargs.pop("hosts_dir", None) or env.hosts_dir,
        s3_endpoint=kwargs.pop("s3_endpoint", None) or env.s3_endpoint,
        s3_region=kwargs.pop("s3_region", None),
    )


def _registry_host(value: str) -> str | None:
    """The registry host a command argument names (``HOST/REPO:TAG`` or a bare ``HOST[:PORT]``),
    or None for anything else (a directory, ``oci:``, ``s3://``, a file)."""
    from modelpack.oci.reference import OCI_REGISTRY_SCHEME

    value = value.removeprefix(OCI_REGISTRY_SCHEME)
    if not value or value.startswith(("oci:", "s3://", ".", "/", "~")) or os.path.exists(value):
        return None
    first = value.split("/", 1)[0]
    if not ("." in first or ":" in first or first == "localhost") or "@" in first:
        return None  # implicit Docker Hub names are never guessed as the credentials' registry
    if "/" not in value:
        return first
    from modelpack.oci.reference import parse_reference

    try:
        ref = parse_reference(value)
    except ModelpackError:
        return None
    return ref.location if ref.scheme == "registry" else None


def _command_registry_host(credentials_given: bool) -> str | None:
    """The one registry host among the running command's arguments (None when there is none)."""
    ctx = click.get_current_context(silent=True)
    if ctx is None:
        return None
    from modelpack.targets.registry.hosts import canonical_host

    hosts: dict[str, str] = {}
    for param in ctx.command.params:
        if not isinstance(param, click.Argument) or isinstance(param.type, click.Path):
            continue
        value = ctx.params.get(param.name or "")
        for item in value if isinstance(value, (tuple, list)) else [value]:
            host = _registry_host(item) if isinstance(item, str) else None
            if host:
                hosts.setdefault(canonical_host(host), host)
    if len(hosts) > 1:
        if credentials_given:
            names = ", ".join(sorted(hosts))
            raise click.UsageError(
                f"-u/--password-stdin apply to one registry, and this command names {names}: store "
                "credentials per host with 'modelpack login HOST' instead"
            )
        # environment credentials then belong to MODELPACK_REGISTRY_HOST, or to none of them
        return None
    return next(iter(hosts.values()), None)


# ------------------------------------------------------------------ variants (an index of them)
def node_accelerator(device: str = "auto") -> Any:
    """The node's device arch as ``loader.fingerprint.device_arch`` computes it, lazily: torch
    is imported only when an index is actually met. ``auto``: the first CUDA device, else cpu."""

    def compute() -> str:
        import torch

        from modelpack.loader.fingerprint import device_arch

        dev = device
        if dev == "auto":
            dev = "cuda:0" if torch.cuda.is_available() else "cpu"
        return device_arch(dev)

    return compute


def variant_options(fn: Any = None, *, with_tp_size: bool = True) -> Any:
    """``--variant KEY=VALUE`` (repeatable), ``--engine`` and (``with_tp_size``) ``--tp-size``: how
    pull and load pick an entry when the reference is an index of variants (``load`` has its own
    ``--tp-size`` and ``--device``). The device arch is this node's (``node_accelerator``)."""
    opts = [
        click.option(
            "--variant",
            "variant",
            multiple=True,
            metavar="KEY=VALUE",
            help="When REFERENCE is an index of variants: take the entry with this field (precision, "
            "quantization, tp-size, accelerator, engine, layout); repeatable. Without it the entry "
            "is chosen by this node's device arch, TP size and engine; none or a tie is refused.",
        ),
        click.option("--engine", "variant_engine", help="Engine to select a variant for (e.g. vllm)."),
    ]
    if with_tp_size:
        opts.append(
            click.option(
                "--tp-size",
                "variant_tp_size",
                type=click.IntRange(1, 4096),
                help="Tensor-parallel size to select a variant for (default 1).",
            )
        )

    def apply(f: Any) -> Any:
        for opt in reversed(opts):
            f = opt(f)
        return f

    return apply(fn) if fn is not None else apply


def selector_from(kwargs: dict[str, Any], *, tp_size: int | None = None, device: str = "auto") -> Any:
    """Pop the variant options into a ``VariantSelector`` (device arch computed only if needed)."""
    from modelpack.oci.variant_selection import VariantSelector

    variant = kwargs.pop("variant", ()) or ()
    engine = kwargs.pop("variant_engine", None)
    tp = kwargs.pop("variant_tp_size", None) or tp_size
    return VariantSelector.from_options(
        tuple(variant), accelerator=node_accelerator(device), tp_size=tp, engine=engine
    )


__all__ = [
    "DURATION",
    "PASS_THROUGH",
    "SIZE",
    "TIMEOUT",
    "build_target_options",
    "debug_requested",
    "debug_traceback",
    "describe_os_error",
    "emit_json",
    "exit_on_closed_pipe",
    "global_timeout",
    "handle_errors",
    "human_size",
    "jobs_option",
    "json_option",
    "node_accelerator",
    "one_line",
    "parse_size",
    "progress_option",
    "report_failure",
    "selector_from",
    "signals_interrupt",
    "target_options",
    "variant_options",
]
