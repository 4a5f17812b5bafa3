"""Run one job per item on a few threads, all or nothing: the first failure stops the rest.

Used by every transfer that fans out over blobs (the copy engine's uploads, a pull's downloads and
tar extractions). A failure (or a signal in the calling thread) sets the shared ``Cancel``: jobs
not started yet never start (with ``-j 1``, the blob queued after a failed upload is not sent),
running ones stop within one chunk when they read through a ``CancellableReader``, and the call
returns only once every worker has stopped, raising the failure that came first.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import TypeVar

from modelpack.errors import TransferCancelled
from modelpack.transfer.cancel import Cancel

T = TypeVar("T")
R = TypeVar("R")


def run_all(
    items: Sequence[T],
    fn: Callable[[T], R],
    jobs: int,
    cancel: Cancel,
    discard: Callable[[R], None] | None = None,
) -> list[R]:
    """``fn`` over ``items`` on up to ``jobs`` threads. The first failure (or a signal in this
    thread) cancels the rest; returns only once every worker has stopped and cleaned up, then
    raises the failure that came first (not a sibling's cancellation). Results of the workers
    that did finish are handed to ``discard`` first, so nothing they staged outlives the failure."""
    if not items:
        return []
    with ThreadPoolExecutor(max(1, min(jobs, len(items))), thread_name_prefix="modelpack-transfer") as pool:

        def job(item: T) -> R:
            cancel.check()  # queued behind a failure: never start
            try:
                return fn(item)
            except BaseException:
                cancel.set()  # before this thread takes the next item off the queue
                raise

        futures: list[Future[R]] = [pool.submit(job, it) for it in items]

        def stop_all() -> None:
            cancel.set()
            for f in futures:
                f.cancel()
            wait(futures)
            _discard(futures, discard)

        try:
            wait(futures, return_when=FIRST_EXCEPTION)
        except BaseException:
            stop_all()
            raise
        failed = [f for f in futures if f.done() and not f.cancelled() and f.exception() is not None]
        if failed:
            stop_all()
            errors = [f.exception() for f in futures if f.done() and not f.cancelled() and f.exception()]
            first = next((e for e in errors if not _is_cancellation(e)), errors[0])
            assert first is not None
            raise first
        return [f.result() for f in futures]


def _discard(futures: Sequence[Future[R]], discard: Callable[[R], None] | None) -> None:
    if discard is None:
        return
    for f in futures:
        if f.done() and not f.cancelled() and f.exception() is None:
            discard(f.result())


def _is_cancellation(exc: BaseException | None) -> bool:
    return isinstance(exc, TransferCancelled)


__all__ = ["run_all"]
