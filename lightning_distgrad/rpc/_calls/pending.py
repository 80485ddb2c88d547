"""Calls waiting for their responses, and their deadlines."""

from __future__ import annotations

import heapq
import threading
import time
from collections.abc import Callable

from .._transport import Transport


class Pending:
    __slots__ = ("future", "dst", "user_visible", "ctx_id", "deadline", "timeout")

    def __init__(self, future, dst, user_visible, ctx_id, timeout):
        self.future = future
        self.dst = dst
        self.user_visible = user_visible
        self.ctx_id = ctx_id  # the caller's autograd context: its callbacks run in it
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout if timeout > 0 else None


class Deadlines:
    """The deadlines of pending calls: ``on_expired(call_id)`` runs for each one that
    passes, on the polling thread.

    One timer is armed, for the earliest deadline watched: an agent whose calls were
    answered has nothing to wake up for until that deadline, and a call expires when its
    deadline passes, not at the next check.
    """

    def __init__(self, transport: Transport, pending: dict, on_expired: Callable[[int], None]):
        self._transport = transport
        self._pending = pending
        self._on_expired = on_expired
        self._heap: list[tuple[float, int]] = []
        self._lock = threading.Lock()
        # The deadline the armed timer is due at (None: none armed). A timer superseded by
        # an earlier one finds another deadline here when it fires, and does nothing.
        self._armed_for: float | None = None

    def __len__(self) -> int:
        return len(self._heap)

    def watch(self, deadline: float, call_id: int) -> None:
        with self._lock:
            heap = self._heap
            # Answered calls need no watching: the heap stays bounded by the pending calls.
            if len(heap) > 2 * len(self._pending) + 64:
                heap[:] = [d for d in heap if d[1] in self._pending]
                heapq.heapify(heap)
            heapq.heappush(heap, (deadline, call_id))
            if self._armed_for is not None and self._armed_for <= deadline:
                return
            self._armed_for = deadline
        self._arm(deadline)

    def _arm(self, deadline: float) -> None:
        delay = max(0.0, deadline - time.monotonic())
        self._transport.call_later(delay, lambda: self._expire(deadline))

    def _expire(self, armed_for: float) -> None:
        now = time.monotonic()
        expired = []
        with self._lock:
            if armed_for != self._armed_for:
                return  # superseded by a timer for an earlier deadline
            heap, pending = self._heap, self._pending
            while heap and (heap[0][0] <= now or heap[0][1] not in pending):
                call_id = heapq.heappop(heap)[1]
                if call_id in pending:
                    expired.append(call_id)
            rearm = self._armed_for = heap[0][0] if heap else None
        for call_id in expired:
            self._on_expired(call_id)
        if rearm is not None:
            self._arm(rearm)
