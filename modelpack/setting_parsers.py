"""How a ``MODELPACK_*`` value is read: one parser per kind of value (durations, flags, lists,
bounded numbers, choices), shared by the settings module and the CLI's flags so a value means the
same from either. Each raises ``ValueError`` with the value; ``modelpack.settings`` turns that into
a ``SettingsError`` naming the variable."""

from __future__ import annotations

import math
import re
from collections.abc import Callable

_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$", re.IGNORECASE)
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def parse_duration(text: str) -> float:
    """``90``, ``30s``, ``2m``, ``1.5h``, ``500ms`` → seconds (``--retry-for``, ``--timeout``, and
    every duration setting; one parser for all of them)."""
    m = _DURATION_RE.match(text)
    if not m:
        raise ValueError(f"{text!r} is not a duration (examples: 30s, 2m, 1h, 0)")
    return float(m.group(1)) * _UNIT_S[(m.group(2) or "s").lower()]


def positive_duration(text: str) -> float:
    """A duration above zero (a timeout of 0 would be a client that never waits)."""
    seconds = parse_duration(text)
    if not seconds > 0:
        raise ValueError(f"{text!r} must be a positive number of seconds")
    return seconds


def text(value: str) -> str:
    """The value as given (secrets and paths are not stripped: a space may be part of them)."""
    return value


def word(value: str) -> str:
    """The value without surrounding blanks."""
    return value.strip()


def boolean(value: str) -> bool:
    """``1``/``true``/``yes``/``on`` or ``0``/``false``/``no``/``off`` (any case)."""
    v = value.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise ValueError(f"{value!r}: expected true or false")


def debug_flag(value: str) -> bool:
    """Anything but ``0`` turns it on (``MODELPACK_DEBUG=1``, ``=yes``)."""
    return value.strip() != "0"


def url_list(value: str) -> tuple[str, ...]:
    """Space- or comma-separated words, in order."""
    return tuple(u for u in value.replace(",", " ").split() if u)


def pairs_list(value: str) -> tuple[str, ...]:
    """Comma-separated ``KEY=VALUE`` words, blanks dropped."""
    return tuple(p.strip() for p in value.split(",") if p.strip())


def integer(minimum: int) -> Callable[[str], int]:
    def parse(value: str) -> int:
        try:
            n = int(value.strip())
        except ValueError:
            raise ValueError(f"{value.strip()[:40]!r}: expected a whole number") from None
        if n < minimum:
            raise ValueError(f"{n}: must be at least {minimum}")
        return n

    parse.__doc__ = f"A whole number, at least {minimum}."
    return parse


def number(minimum: float) -> Callable[[str], float]:
    def parse(value: str) -> float:
        try:
            n = float(value.strip())
        except ValueError:
            raise ValueError(f"{value.strip()[:40]!r}: expected a number") from None
        if math.isnan(n) or n < minimum:
            raise ValueError(f"{value.strip()!r}: must be at least {minimum:g}")
        return n

    parse.__doc__ = f"A number, at least {minimum:g}."
    return parse


def choice(*choices: str) -> Callable[[str], str]:
    def parse(value: str) -> str:
        v = value.strip().lower()
        if v not in choices:
            raise ValueError(f"{value.strip()[:40]!r}: expected one of {', '.join(choices)}")
        return v

    parse.__doc__ = f"One of {', '.join(choices)}."
    return parse
