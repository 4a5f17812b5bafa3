"""Every command's signal handling is one (``signals_interrupt``): Ctrl-C (SIGINT) stops the
command the way SIGTERM does — every transfer thread is asked to stop, and the main thread ends
with 128 + the signal — and a signal the parent set to be ignored (``nohup``, a background job)
stays ignored. Real signals are sent to this process."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest

from modelpack import stopping
from modelpack.cli.options import signals_interrupt
from modelpack.errors import TransferInterrupted


@pytest.fixture
def restore_sigint() -> Iterator[None]:
    previous = signal.getsignal(signal.SIGINT)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_each_signal_asks_every_transfer_to_stop_and_ends_with_its_status(
    sig: signal.Signals, restore_sigint: None
) -> None:
    """SIGINT, SIGTERM and SIGHUP alike: the stop request every worker thread sees is set before
    the main thread raises, and the exit status is 128 + the signal."""
    seen_stop = []
    with pytest.raises(TransferInterrupted) as raised, signals_interrupt():
        try:
            os.kill(os.getpid(), sig)
            time.sleep(5)  # the handler raises here
        finally:
            seen_stop.append(stopping.stop_requested())
    assert raised.value.exit_code == 128 + sig
    assert seen_stop == [True]
    assert not stopping.stop_requested()  # cleared once the command unwound


def test_a_signal_the_parent_ignored_stays_ignored(restore_sigint: None) -> None:
    """``nohup``/a background job starts with SIGINT ignored: the command does not start
    answering it, and the disposition is the same after the command."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with signals_interrupt():
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.1)
    assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
