"""Calls due at given times, run by whichever thread polls (under the transport's lock)."""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable


class Timers:
    """A heap of ``(due time, sequence, call)``; not thread-safe: the transport's lock guards
    it.

    Example::

        >>> timers = Timers()
        >>> timers.add(5.0, print)         # True: the earliest one now
        True
        >>> timers.until_next(4.0), timers.take_due(4.0), timers.take_due(5.0)
        (1.0, [], [<built-in function print>])
    """

    __slots__ = ("_heap", "_seq")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = 0

    def add(self, due: float, fn: Callable[[], None]) -> bool:
        """Add ``fn`` for time ``due``; True if it is the earliest now (a napping poller
        must then wake before its nap's end)."""
        self._seq += 1
        entry = (due, self._seq, fn)
        heapq.heappush(self._heap, entry)
        return self._heap[0] is entry

    def due(self, now: float) -> bool:
        return bool(self._heap) and self._heap[0][0] <= now

    def take_due(self, now: float) -> list[Callable[[], None]]:
        """The calls due by ``now``, in order of their times (removed)."""
        heap, due = self._heap, []
        while heap and heap[0][0] <= now:
            due.append(heapq.heappop(heap)[2])
        return due

    def until_next(self, now: float) -> float:
        """Seconds from ``now`` to the next call (inf if none)."""
        return max(0.0, self._heap[0][0] - now) if self._heap else math.inf
