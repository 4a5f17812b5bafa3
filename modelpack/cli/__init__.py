"""The ``modelpack`` command: a thin click skin over the library.

Commands live in ``cli_*.py`` modules by area (pack, transfer, trust, node, loader), imported at
the end of this module, and register themselves on ``main``; this module holds the shared
options, output helpers and error mapping.
Exit codes: 0 ok, 1 a modelpack error (bad input, verification refused, not found), 2 usage.
"""

from __future__ import annotations

import functools
import json
import logging
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click

from modelpack.errors import ModelpackError
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
    name = "SIZE"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        return parse_size(str(value))


SIZE = SizeType()


def emit_json(doc: Any) -> None:
    click.echo(json.dumps(doc, indent=2, sort_keys=True))


def handle_errors(fn: F) -> F:
    """Map library errors to a one-line message and a meaningful exit code (no traceback)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except ModelpackError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(exc.exit_code)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)

    return wrapper  # type: ignore[return-value]


def progress_option(fn: F) -> F:
    return click.option(
        "--progress",
        type=click.Choice(["auto", "on", "off"]),
        default="auto",
        show_default=True,
        help="Progress bars: auto shows them on a terminal and never in CI.",
    )(fn)


def json_option(fn: F) -> F:
    return click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON on stdout.")(fn)


def jobs_option(fn: F) -> F:
    return click.option(
        "--jobs",
        "-j",
        type=click.IntRange(1, 64),
        default=4,
        show_default=True,
        help="Concurrent blob transfers.",
    )(fn)


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
            "--username", "-u", help="Registry user (else MODELPACK_REGISTRY_USERNAME or docker config)."
        ),
        click.option("--password-stdin", is_flag=True, help="Read the registry password from stdin."),
        click.option("--s3-endpoint", envvar="MODELPACK_S3_ENDPOINT", help="S3-compatible endpoint URL."),
        click.option("--s3-region", envvar="AWS_REGION", help="S3 region."),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


def build_target_options(kwargs: dict[str, Any]) -> TargetOptions:
    """Pop the connection flags out of a command's kwargs into a TargetOptions."""
    password = None
    if kwargs.pop("password_stdin", False):
        password = sys.stdin.readline().rstrip("\n")
    return TargetOptions(
        plain_http=kwargs.pop("plain_http", False),
        ca_file=kwargs.pop("ca_file", None),
        username=kwargs.pop("username", None),
        password=password,
        s3_endpoint=kwargs.pop("s3_endpoint", None),
        s3_region=kwargs.pop("s3_region", None),
    )


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(package_name="modelpack")
@click.option(
    "--debug", is_flag=True, help="Log requests and decisions to stderr (credentials are never logged)."
)
def main(debug: bool) -> None:
    """modelpack: safetensors checkpoints as verified, signed CNCF ModelPack OCI artifacts.

    \b
    Typical flow:
      modelpack pack ./ckpt oci:./layout:v1           # build an artifact (no server needed)
      modelpack push ./ckpt registry.example/m:v1     # CI: pack + upload straight from the files
      modelpack pull registry.example/m:v1 ./model    # node: verified files at their paths

    References: host[:port]/repo[:tag][@sha256:…], oci:DIR[:TAG|@DIGEST], s3://BUCKET/PREFIX[:TAG].
    """
    logging.basicConfig(
        level=logging.DEBUG if debug else logging.WARNING,
        stream=sys.stderr,
        format="%(levelname)s %(name)s: %(message)s",
    )


# Each area module registers its commands on ``main`` when imported.
from modelpack.cli import loader, node, pack, transfer, trust  # noqa: E402

__all__ = ["loader", "main", "node", "pack", "transfer", "trust"]
