"""How a command fails: one line on stderr and a meaningful exit code, never a traceback unless
``--debug`` (``report_failure``, ``handle_errors``); SIGINT, SIGTERM and SIGHUP stop a command
alike (``signals_interrupt``); a reader that left (``… | head``) ends it quietly.

Only click, the error hierarchy and the exit codes are imported here: every command loads it.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any, NoReturn, TypeVar

import click

from modelpack.errors import ModelpackError
from modelpack.exit_codes import ExitCode, for_signal

F = TypeVar("F", bound=Callable[..., Any])


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
