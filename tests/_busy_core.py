"""A core shared with a process that computes all along.

A thread pinned to that core waits for it the way a rank's thread does on a crowded node:
runnable, preempted, and waiting for nothing else.

Example::

    >>> with busy_core() as core, pinned([threading.get_native_id()], core):  # doctest: +SKIP
    ...     preempted_for(0.003)
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator

_COMPUTE = "print('computing', flush=True)\nwhile True:\n    pass\n"


@contextlib.contextmanager
def busy_core() -> Iterator[int]:
    """A process that computes all along on one core of this process's; yields that core
    once it computes, and stops the process on exit."""
    core = min(os.sched_getaffinity(0))
    busy = subprocess.Popen([sys.executable, "-c", _COMPUTE], stdout=subprocess.PIPE, text=True)
    try:
        os.sched_setaffinity(busy.pid, {core})
        busy.stdout.readline()
        yield core
    finally:
        busy.kill()
        busy.wait()
        busy.stdout.close()


@contextlib.contextmanager
def pinned(thread_ids: Iterable[int], core: int) -> Iterator[None]:
    """Threads ``thread_ids`` (native ids) run on ``core`` only, until the exit restores
    their cores. Pin before the part that is measured: moving a running thread to another
    core makes it wait for the move."""
    before = {tid: os.sched_getaffinity(tid) for tid in thread_ids}
    try:
        for tid in before:
            os.sched_setaffinity(tid, {core})
        yield
    finally:
        for tid, cores in before.items():
            os.sched_setaffinity(tid, cores)


def preempted_for(seconds: float) -> None:
    """Leave this thread's core to the other runnable work until ``seconds`` passed.
    ``sched_yield`` keeps the thread runnable: the kernel counts each switch as a
    preemption, not as a wait."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        os.sched_yield()
