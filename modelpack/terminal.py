"""Text from outside made safe for a terminal: control characters shown, never obeyed.

Model names, annotations, file paths, tags, registry error bodies and whatever else modelpack
prints came from someone else. A terminal obeys what they may carry: OSC 52 writes the
clipboard, ``ESC [2J`` clears the screen, cursor moves and a carriage return overwrite what was
printed (a fake green "verified" line), C1 characters are escape sequences in one byte, and
bidirectional overrides reorder what is shown. Two tools, one rule (escape visibly, as
``\\x1b`` / ``\\u202e``, never drop: a person should see that something was there):

- ``for_terminal(text)``: one value as one line — every control character escaped, newline and
  tab included, so a value never adds a line of its own. For fields the CLI formats.
- ``TerminalSafeStream`` / ``terminal_safe_output()``: the net under every write to stdout and
  stderr while a command runs (``modelpack.cli`` installs it): every control character except
  the newline and tab the output itself is made of is escaped, whichever path printed it (echo,
  the error handler, logging, click's usage errors). Progress bars draw their own cursor
  moves and write to ``unfiltered(sys.stderr)``; what they show of outside names goes through
  ``for_terminal``.

JSON output is unaffected: ``json.dumps`` writes every control character as a ``\\u`` escape
already, so the net never finds one to change.
"""

from __future__ import annotations

import contextlib
import re
import sys
from collections.abc import Iterator
from typing import Any

#: C0 controls, DEL, C1 controls, and the Unicode format characters that reorder or hide text
#: (bidirectional embeddings, overrides and isolates; line and paragraph separators)
_BEYOND_C0 = "\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069"
_ANY_CONTROL = re.compile(f"[\x00-\x1f{_BEYOND_C0}]")
#: the same, newline and tab aside (what multi-line output is made of)
_CONTROL_BUT_LAYOUT = re.compile(f"[\x00-\x08\x0b-\x1f{_BEYOND_C0}]")


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group(0))
    if code == 0x0A:
        return "\\n"
    if code == 0x09:
        return "\\t"
    if code == 0x0D:
        return "\\r"
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


def for_terminal(text: object) -> str:
    """``text`` as one inert line: every control character written as a visible escape."""
    return _ANY_CONTROL.sub(_escape, str(text))


def has_control_characters(text: str) -> bool:
    """Whether ``text`` holds any character ``for_terminal`` would escape."""
    return _ANY_CONTROL.search(text) is not None


def output_safe(text: str) -> str:
    """Multi-line output made inert: newline and tab kept, every other control escaped."""
    return _CONTROL_BUT_LAYOUT.sub(_escape, text)


class TerminalSafeStream:
    """A text stream that escapes control characters (``output_safe``) on their way to ``raw``.

    ``buffer`` is deliberately not offered: a writer that looks for the binary stream beneath
    (click does, for a stream it deems misconfigured) would get past the net."""

    def __init__(self, raw: Any) -> None:
        self.unfiltered = raw

    def write(self, text: str) -> int:
        self.unfiltered.write(output_safe(text))
        return len(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name: str) -> Any:
        if name == "buffer":
            raise AttributeError(name)
        return getattr(self.unfiltered, name)


def unfiltered(stream: Any) -> Any:
    """The stream beneath a ``TerminalSafeStream`` (itself when it is none): for progress bars,
    whose own cursor moves must reach the terminal."""
    return getattr(stream, "unfiltered", stream) if isinstance(stream, TerminalSafeStream) else stream


@contextlib.contextmanager
def terminal_safe_output() -> Iterator[None]:
    """``sys.stdout`` and ``sys.stderr`` behind ``TerminalSafeStream`` for the duration."""
    saved = sys.stdout, sys.stderr
    if not isinstance(sys.stdout, TerminalSafeStream):
        sys.stdout = TerminalSafeStream(sys.stdout)
    if not isinstance(sys.stderr, TerminalSafeStream):
        sys.stderr = TerminalSafeStream(sys.stderr)
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved
