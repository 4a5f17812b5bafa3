"""A click group whose subcommands are imported only when one of them runs or shows its help.

Every command module pulls in the library it drives (registry clients, signing, the loader),
and importing all of them would make each start pay for every command: a node's
``modelpack pull … --cache DIR`` hit would spend most of its time importing ``push``.
The group's own ``--help`` lists the commands from a table of short help strings instead of
importing them; a test keeps that table equal to the commands' own docstrings.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any, NamedTuple

import click


class LazyCommand(NamedTuple):
    """Where a subcommand lives (``"package.module:attribute"``) and its one-line help."""

    target: str
    short_help: str


class LazyGroup(click.Group):
    """``click.Group`` that resolves ``lazy_commands`` on first use (click docs, "Lazily Loading
    Subcommands"); commands added the usual way still work alongside them."""

    def __init__(self, *args: Any, lazy_commands: Mapping[str, LazyCommand] | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.lazy_commands = dict(lazy_commands or {})

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self.lazy_commands})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in self.lazy_commands:
            self.add_command(self.load(cmd_name), cmd_name)
        return super().get_command(ctx, cmd_name)

    def load(self, cmd_name: str) -> click.Command:
        """Import the module of ``cmd_name`` and return its command object."""
        module_name, _, attr = self.lazy_commands[cmd_name].target.partition(":")
        command = getattr(importlib.import_module(module_name), attr)
        if not isinstance(command, click.Command):
            raise TypeError(f"{module_name}:{attr} is {type(command).__name__}, not a click command")
        return command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """List every command, importing none: unloaded ones show their table help, shortened the
        way click shortens a docstring."""
        rows: list[tuple[str, click.Command]] = []
        for name in self.list_commands(ctx):
            command = self.commands.get(name)
            if command is None:
                command = click.Command(name, help=self.lazy_commands[name].short_help)
            if not command.hidden:
                rows.append((name, command))
        if not rows:
            return
        limit = formatter.width - 6 - max(len(name) for name, _ in rows)
        with formatter.section("Commands"):
            formatter.write_dl([(name, command.get_short_help_str(limit)) for name, command in rows])
