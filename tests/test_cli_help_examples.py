"""Every command's ``--help`` carries a runnable example (issue 12, item 12).

A person reads ``modelpack X --help`` before the docs; one real command line teaches the argument
order and the reference forms faster than the option table. Each example line is also parsed
against the command it names, so an example that uses a flag the command no longer has fails
here rather than in a user's terminal.
"""

from __future__ import annotations

import shlex

import click
import pytest

from modelpack.cli import COMMANDS, main


def _walk(group: click.Group, ctx: click.Context, prefix: tuple[str, ...]) -> list[tuple[str, ...]]:
    out: list[tuple[str, ...]] = []
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        assert command is not None, name
        path = (*prefix, name)
        if command.hidden:
            continue
        out.append(path)
        if isinstance(command, click.Group):
            out.extend(_walk(command, click.Context(command, info_name=name, parent=ctx), path))
    return out


ROOT = click.Context(main, info_name="modelpack")
ALL_COMMANDS = [(), *_walk(main, ROOT, ())]


def _resolve(path: tuple[str, ...]) -> tuple[click.Command, click.Context]:
    command: click.Command = main
    ctx = ROOT
    for name in path:
        assert isinstance(command, click.Group)
        sub = command.get_command(ctx, name)
        assert sub is not None, f"{' '.join(path)}: no command {name!r}"
        command = sub
        ctx = click.Context(command, info_name=name, parent=ctx)
    return command, ctx


def _help(path: tuple[str, ...]) -> str:
    command, ctx = _resolve(path)
    return command.get_help(ctx)


def _examples(text: str) -> list[str]:
    """The ``modelpack …`` command lines of a help text (continuation lines joined, comments cut)."""
    lines: list[str] = []
    pending = ""
    for line in text.splitlines():
        stripped = line.strip()
        if pending:
            stripped = pending + " " + stripped
            pending = ""
        elif not stripped.startswith("modelpack "):
            continue
        if stripped.endswith("\\"):
            pending = stripped[:-1].strip()
            continue
        lines.append(stripped.split("  #", 1)[0].split(" # ", 1)[0].strip())
    return lines


def _argv(example: str) -> list[str]:
    """The words of the first command of a shell line (up to ``&&``, ``|``, ``;``, a redirect)."""
    lexer = shlex.shlex(example, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    words = []
    for word in lexer:
        if word in ("&&", "||", "|", ";", ">", ">>", "<", "2>"):
            break
        words.append(word)
    return words


def test_the_walk_sees_every_top_level_command() -> None:
    assert {p[0] for p in ALL_COMMANDS if p} == set(COMMANDS)


@pytest.mark.parametrize("path", ALL_COMMANDS, ids=lambda p: " ".join(("modelpack", *p)))
def test_help_has_an_example(path: tuple[str, ...]) -> None:
    text = _help(path)
    assert "Example" in text, f"'modelpack {' '.join(path)} --help' shows no example"
    assert _examples(text), f"'modelpack {' '.join(path)} --help' has no 'modelpack …' command line"


@pytest.mark.parametrize("path", ALL_COMMANDS, ids=lambda p: " ".join(("modelpack", *p)))
def test_examples_name_real_commands_and_flags(path: tuple[str, ...]) -> None:
    for example in _examples(_help(path)):
        argv = _argv(example)[1:]
        command: click.Command = main
        ctx = click.Context(main, info_name="modelpack", resilient_parsing=True)
        # global options (``modelpack --debug pull …``) come before the command
        while argv and argv[0].startswith("-"):
            argv.pop(0)
        names = []
        while isinstance(command, click.Group) and argv and not argv[0].startswith("-"):
            sub = command.get_command(ctx, argv[0])
            if sub is None:
                break
            names.append(argv.pop(0))
            command = sub
            ctx = click.Context(command, info_name=names[-1], parent=ctx, resilient_parsing=True)
        assert names, f"{example!r}: names no command"
        try:
            command.make_context(names[-1], list(argv), parent=ctx.parent, resilient_parsing=True)
        except click.UsageError as exc:
            pytest.fail(f"{example!r} in 'modelpack {' '.join(path)} --help': {exc.format_message()}")
