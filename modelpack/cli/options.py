"""The options, output helpers and error mapping every command module shares.

Only click and the error hierarchy are imported here: every command loads this module, so
what it imports is paid by every start. The library behind an option (targets, signing) is
imported inside the function that turns the flags into library objects. The options that
decide what a command trusts (keys, policies, keyless identities, passphrases) are in
``modelpack.cli.trust_options``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import json
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import click

from modelpack.errors import ModelpackError
from modelpack.exit_codes import ExitCode, for_signal

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


def debug_requested() -> bool:
    """``modelpack --debug …`` (the root group's flag) or ``MODELPACK_DEBUG=1``."""
    ctx = click.get_current_context(silent=True)
    if ctx is not None and ctx.find_root().params.get("debug"):
        return True
    from modelpack.settings import DEBUG

    return DEBUG.get()


def _say(line: str) -> None:
    """One line on stderr; a closed stderr is not a second failure to report."""
    try:
        click.echo(line, err=True)
    except (OSError, ValueError):
        pass


def _first_line(text: str, limit: int = 300) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[: limit - 1] + "…"


def one_line(text: str, limit: int = 1000) -> str:
    """A message as one line of bounded length: a YAML or JSON parser's multi-line report joined,
    a hostile input's megabyte value elided in the middle (the start names it, the end says
    what to do)."""
    line = " ".join(part.strip() for part in text.splitlines() if part.strip())
    if len(line) <= limit:
        return line
    return line[: limit * 2 // 3] + " … " + line[-(limit // 3) :]


def _closed_pipe(exc: BaseException) -> bool:
    return isinstance(exc, BrokenPipeError) or (isinstance(exc, OSError) and exc.errno == errno.EPIPE)


def exit_on_closed_pipe() -> NoReturn:
    """``modelpack … | head``: the reader left, so nothing more is worth saying.

    stdout is pointed at /dev/null first (the recipe of Python's ``signal`` docs), else the
    interpreter's final flush fails again and prints "Exception ignored … BrokenPipeError".
    """
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.dup2(devnull, sys.stderr.fileno())
    except (OSError, ValueError):
        pass
    sys.exit(ExitCode.OUTPUT_CLOSED)


def describe_os_error(exc: OSError) -> str:
    """``PATH: reason`` — what a person needs to act on an operating-system refusal."""
    reason = exc.strerror or _first_line(str(exc)) or type(exc).__name__
    paths = [str(p) for p in (exc.filename, exc.filename2) if p is not None]
    if exc.errno == errno.ENOSPC:
        reason += "; free space on that filesystem and run the command again"
    return f"{' → '.join(paths)}: {reason}" if paths else f"{type(exc).__name__}: {reason}"


#: the lines of a traceback that are its own layout (every other chunk but frames is a message)
_TRACEBACK_LAYOUT = frozenset(
    {
        "Traceback (most recent call last):\n",
        "\nThe above exception was the direct cause of the following exception:\n\n",
        "\nDuring handling of the above exception, another exception occurred:\n\n",
    }
)


def debug_traceback(exc: BaseException) -> str:
    """``--debug``'s traceback, each exception's message one inert line (``for_terminal``): a
    message may quote a registry, and its newlines must not print lines of their own."""
    import traceback

    from modelpack.terminal import for_terminal

    out = []
    for chunk in traceback.format_exception(exc):
        if chunk.startswith("  File ") or chunk in _TRACEBACK_LAYOUT:
            out.append(chunk)
        else:
            out.append(for_terminal(chunk.rstrip("\n")) + "\n")
    return "".join(out)


def report_failure(exc: BaseException) -> NoReturn:
    """Print one line for ``exc`` (the traceback too under ``--debug``) and exit.

    ModelpackError: its message and exit code. OSError: the path and the reason. Anything else
    is a defect of ours, printed as one line that says how to see the details.
    """
    if isinstance(exc, KeyboardInterrupt):
        _say("interrupted")
        sys.exit(ExitCode.SIGINT)
    if _closed_pipe(exc):
        exit_on_closed_pipe()
    debug = debug_requested()
    if debug:
        try:
            sys.stderr.write(debug_traceback(exc))
        except (OSError, ValueError):
            pass
    if isinstance(exc, ModelpackError):
        _say(f"error: {one_line(str(exc))}")
        sys.exit(exc.exit_code)
    if isinstance(exc, OSError) and (exc.filename is not None or exc.strerror):
        _say(f"error: {one_line(describe_os_error(exc))}")
        sys.exit(ExitCode.FAILURE)
    hint = "" if debug else "; run with --debug for details"
    _say(f"error: unexpected {type(exc).__name__}: {_first_line(str(exc))}{hint}")
    sys.exit(ExitCode.FAILURE)


#: What click raises on purpose (usage errors, --help, aborts): click prints those itself.
PASS_THROUGH = (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort, SystemExit)


@contextlib.contextmanager
def signals_interrupt() -> Iterator[None]:
    """SIGINT (Ctrl-C), SIGTERM and SIGHUP (a CI timeout, a pod stopped, a terminal closed) end a
    command alike: every transfer thread is asked to stop (``stopping.request_stop``: blocked
    reads and retry sleeps end at once) and a ``TransferInterrupted`` (exit 128 + signal) is
    raised in the main thread, so every ``finally`` on the way out runs. Temp files and staging
    directories are removed; partial downloads are kept for the rerun to resume (their prefix is
    re-hashed then). Python's own ``KeyboardInterrupt`` stopped only the main thread, and a pull
    went on downloading in its workers until the whole download was done."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    from modelpack import stopping
    from modelpack.errors import TransferInterrupted

    def interrupt(signum: int, _frame: Any) -> None:
        name = signal.Signals(signum).name
        stopping.request_stop()  # worker threads blocked in a read or a retry sleep stop too
        raise TransferInterrupted(
            f"interrupted by {name}; temp files removed, partial downloads kept for the rerun",
            exit_code=for_signal(signum),
        )

    # a signal the parent set to be ignored (``nohup``, a background job's SIGINT) stays ignored
    caught = [
        s for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP) if signal.getsignal(s) != signal.SIG_IGN
    ]
    previous = {sig: signal.signal(sig, interrupt) for sig in caught}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        stopping.clear()


def handle_errors(fn: F) -> F:
    """Map every failure to a one-line message and a meaningful exit code (no traceback); SIGINT,
    SIGTERM and SIGHUP stop the command alike (``signals_interrupt``)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            with signals_interrupt():
                return fn(*args, **kwargs)
        except PASS_THROUGH:
            raise
        except BaseException as exc:
            report_failure(exc)

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
