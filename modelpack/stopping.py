"""A process-wide stop request: a signal ends every wait of every transfer thread at once.

The CLI turns SIGTERM/SIGHUP into an exception in the main thread; worker threads blocked in a
socket read or a retry sleep never see it. ``request_stop`` (called by the CLI's signal handler)
sets one event and runs the hooks registered by open responses (``abort_on_stop``: a socket
shut down, so a blocked ``recv`` returns at once); retry sleeps wait on the event
(``sleep``) and every read loop calls ``check``, which raises ``TransferCancelled``. ``clear``
ends the request once the command has unwound (the CLI's test runner reuses the process).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Callable, Iterator

from modelpack.errors import TransferCancelled

_event = threading.Event()
_lock = threading.Lock()
_hooks: dict[int, Callable[[], None]] = {}
_ids = itertools.count()


def request_stop() -> None:
    """Stop every transfer: set the event and run the abort hooks (each at most once)."""
    _event.set()
    with _lock:
        hooks = list(_hooks.values())
        _hooks.clear()
    for hook in hooks:
        with contextlib.suppress(Exception):
            hook()


def clear() -> None:
    _event.clear()


def stop_requested() -> bool:
    return _event.is_set()


def check() -> None:
    if _event.is_set():
        raise TransferCancelled("cancelled: the command was interrupted")


def sleep(seconds: float) -> None:
    """Sleep ``seconds``, or until a stop is requested (then ``TransferCancelled``)."""
    if seconds > 0:
        _event.wait(seconds)
    check()


@contextlib.contextmanager
def abort_on_stop(hook: Callable[[], None]) -> Iterator[None]:
    """Run ``hook`` if a stop is requested while the block runs (at once when one already was)."""
    key = next(_ids)
    with _lock:
        _hooks[key] = hook
    try:
        if _event.is_set():
            with contextlib.suppress(Exception):
                hook()
        yield
    finally:
        with _lock:
            _hooks.pop(key, None)


__all__ = ["abort_on_stop", "check", "clear", "request_stop", "sleep", "stop_requested"]
