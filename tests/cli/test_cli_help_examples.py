"""Every command's ``--help`` carries a runnable example.

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
# one test per top-level command, walked when the test runs: a module that fails to import fails
# its own test, not the collection of this file
TOP = ["(root)", *sorted(COMMANDS)]


def _commands_under(top: str) -> list[tuple[str, ...]]:
    if top == "(root)":
        return [()]
    command = main.get_command(ROOT, top)
    assert command is not None, top
    if isinstance(command, click.Group):
        return [(top,), *_walk(command, click.Context(command, info_name=top, parent=ROOT), (top,))]
    return [(top,)]


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


@pytest.mark.parametrize("top", TOP)
def test_help_has_an_example(top: str) -> None:
    missing = []
    for path in _commands_under(top):
        text = _help(path)
        if "Example" not in text or not _examples(text):
            missing.append("modelpack " + " ".join(path))
    assert not missing, "no example ('Example' and a 'modelpack …' line) in --help of: " + ", ".join(missing)


@pytest.mark.parametrize("top", TOP)
def test_examples_name_real_commands_and_flags(top: str) -> None:
    for path in _commands_under(top):
        for example in _examples(_help(path)):
            _check_example(example, path)


def _check_values(command: click.Command, ctx: click.Context, argv: list[str], example: str) -> None:
    """Each value of ``argv`` converted by its parameter's type, as the command would on a run.

    ``resilient_parsing`` (needed so that a missing required argument or an existing-path check
    does not fail the parse) swallows conversion errors, so ``--max-bytes 0`` under a SIZE that
    must be positive passed unnoticed: the values are checked here again, strictly. Paths are
    left alone (whether ``./ckpt`` exists is the reader's machine's business)."""
    opts, _args, _order = command.make_parser(ctx).parse_args(list(argv))
    for param in command.get_params(ctx):
        if param.name not in opts or isinstance(param.type, (click.Path, click.File)):
            continue
        try:
            param.type_cast_value(ctx, opts[param.name])
        except click.BadParameter as exc:
            pytest.fail(f"{example!r}: {param.get_error_hint(ctx)}: {exc.format_message()}")


def _check_example(example: str, path: tuple[str, ...]) -> None:
    argv = _argv(example)[1:]
    command: click.Command = main
    ctx = click.Context(main, info_name="modelpack", resilient_parsing=True)
    # global options (``modelpack --debug pull …``, ``--timeout 30s``) come before the command
    root_args = []
    while argv and argv[0].startswith("-"):
        word = argv.pop(0)
        root_args.append(word)
        option = next((p for p in main.params if word in getattr(p, "opts", ())), None)
        assert isinstance(option, click.Option), f"{example!r}: no global option {word!r}"
        if not option.is_flag and argv:
            root_args.append(argv.pop(0))
    _check_values(main, ctx, root_args, example)
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
        sub_ctx = command.make_context(names[-1], list(argv), parent=ctx.parent, resilient_parsing=True)
    except click.UsageError as exc:
        pytest.fail(f"{example!r} in 'modelpack {' '.join(path)} --help': {exc.format_message()}")
    _check_values(command, sub_ctx, argv, example)


def test_an_example_with_a_value_its_command_rejects_fails_here() -> None:
    """The checker itself: an out-of-range value (the old ``cache gc --max-bytes 0``) and a
    global option's bad value are caught, a plausible line passes."""
    with pytest.raises(pytest.fail.Exception, match="max-bytes"):
        _check_example("modelpack cache gc --cache /c --max-bytes 0", ("cache", "gc"))
    with pytest.raises(pytest.fail.Exception, match="timeout"):
        _check_example("modelpack --timeout 0 ls reg.example/m", ())
    _check_example("modelpack --timeout 30s cache gc --cache /c --max-bytes 500G --min-age 0", ())
