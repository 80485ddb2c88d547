"""Which functions a request may run right where it is delivered, without a hand-off.

A request whose function runs short and never waits is served fastest on the progress thread
that delivered it (an *inline run*, see ``_transport.progress``): no other thread has to wake,
take the GIL and answer. Whether a function does is learnt by trying: any function's request
may run inline; one whose inline run waited for something (the progress role then moved to
another thread) or outlasted :data:`BUDGET_S` goes to the worker pool for its next
``2**n`` requests (``n``: how often that happened in a row, capped), then is tried inline
again; a trial that runs short clears the record.

A run is judged by what its function did, not by how the machine treated it
(:class:`InlineRun`): one that only waited for a core (more ranks than cores, or other
processes) is short if its own CPU time is. Moving its function to the pool would not help
(a worker waits for a core as well), and on a crowded node every function is preempted past
the budget now and then: as each time doubles its stay on the pool, under sustained load most
of its requests would run there.
"""

from __future__ import annotations

import time
from typing import Any

try:
    from resource import RUSAGE_THREAD, getrusage
except ImportError:  # no per-thread counts (Windows, macOS): a long run counts as waiting
    getrusage = None

#: An inline run longer than this holds up the rank's other messages: its function moves to
#: the pool for a while.
BUDGET_S = 0.001
#: The most requests a function serves on the pool before it is tried inline again.
MAX_POOL_RUNS = 4096
#: Functions remembered at most (bound methods of ever new objects are each a key).
MAX_RECORDS = 4096


def _voluntary_switches() -> int | None:
    """How often this thread gave up its core to wait (sleep, lock, I/O, the GIL); None
    where the platform does not count it."""
    return None if getrusage is None else getrusage(RUSAGE_THREAD).ru_nvcsw


class InlineRun:
    """The clocks of one inline run, started where it begins.

    Example::

        >>> run = InlineRun()
        >>> run.short()      # a run that did nothing
        True
    """

    __slots__ = ("_wall", "_cpu", "_switches")

    def __init__(self) -> None:
        self._wall = time.perf_counter()
        self._cpu = time.thread_time()
        self._switches = _voluntary_switches()

    def short(self) -> bool:
        """Whether the run stayed within :data:`BUDGET_S`: of wall time, or, when the
        machine only preempted it (it never gave up its core to wait), of its thread's CPU
        time."""
        if time.perf_counter() - self._wall <= BUDGET_S:
            return True
        if time.thread_time() - self._cpu > BUDGET_S:
            return False
        return self._switches is not None and _voluntary_switches() == self._switches


class Inlining:
    """Per function: how many more requests go to the pool before an inline trial, and how
    often an inline run failed. Functions with no record run inline."""

    def __init__(self) -> None:
        self._records: dict[Any, list[int]] = {}  # function -> [pool runs left, failures]

    def allows(self, func: Any) -> bool:
        """Whether this request of ``func`` may run inline (one pool run is counted if not).

        Example::

            >>> inlining = Inlining()
            >>> inlining.allows(print)
            True
            >>> inlining.ran(print, ok=False)     # it waited: the next 2 go to the pool
            >>> [inlining.allows(print) for _ in range(3)]
            [False, False, True]
        """
        try:
            record = self._records.get(func)
        except TypeError:  # unhashable: an object with __call__
            return False
        if record is None or record[0] == 0:
            return True
        record[0] -= 1
        return False

    def ran(self, func: Any, ok: bool) -> None:
        """An inline run of ``func`` ended; ``ok``: short, and it kept the progress role."""
        if ok:
            if self._records:  # a failure now and then must not add up to a long stay
                self._records.pop(func, None)
            return
        if len(self._records) >= MAX_RECORDS:
            self._records.clear()
        record = self._records.setdefault(func, [0, 0])
        record[1] += 1
        record[0] = min(2 ** record[1], MAX_POOL_RUNS)
