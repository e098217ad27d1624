"""A preemption signal the launcher must not lose before training starts.

What it is: `record(exc)` (the launcher's signal handler keeps the `Stopped` it raises) and
`raise_pending()` (raise it again, once). An exception raised inside a signal handler is
dropped when the signal lands while Python runs a finalizer (a `__del__` or a weakref callback
prints "Exception ignored in ..." and goes on): a SIGTERM during the warm start was lost so, and
the run trained on for minutes. So the loops of the phases before training (each warm-start step,
the wait for engines) and the boundaries between phases call `raise_pending()`: a dropped
exception costs at most one step of its phase. `clear()` when a stop was handled.
`quiet_when_dropped()` keeps Python from printing the dropped stop as an error ("Exception
ignored in ...", a traceback in the launcher's output): it is not lost, only deferred. The same
holds when the signal lands in an asyncio protocol callback (an HTTP read of the evaluation):
asyncio catches the stop, logs "Fatal error: protocol.data_received() call failed." with its
traceback and closes the connection, and the stop reaches the caller through the failed request.
What it is not: the handler (`session.RunSession.preempt`) or the learners' stop at a step
boundary (trainer/), which reads a flag and needs none of this.
"""

from __future__ import annotations

import logging
import sys

_pending: list[BaseException] = []


def record(exc: BaseException) -> BaseException:
    """Keep `exc` as the pending stop and return it (for the handler to raise)."""
    _pending[:] = [exc]
    return exc


def raise_pending() -> None:
    """Raise the pending stop, if any (once: it is no longer pending after)."""
    if _pending:
        raise _pending.pop()


def clear() -> None:
    _pending.clear()


class _QuietPending(logging.Filter):
    """Drops a log record whose exception is the pending stop (asyncio's report of it)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (_pending and exc is _pending[0])


_QUIET = _QuietPending()


def quiet_when_dropped() -> None:
    """Install a `sys.unraisablehook` that says nothing for the pending stop (Python drops it in a
    finalizer; `raise_pending` raises it again) and reports everything else as Python would; and
    a filter on the `asyncio` logger that drops its report of the pending stop, nothing else."""
    logging.getLogger("asyncio").addFilter(_QUIET)  # once: a filter already there is not added again
    previous = sys.unraisablehook

    def hook(unraisable) -> None:
        if _pending and unraisable.exc_value is _pending[0]:
            return
        previous(unraisable)

    sys.unraisablehook = hook
