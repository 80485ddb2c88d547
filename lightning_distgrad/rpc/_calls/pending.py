"""Calls waiting for their responses, and their deadlines."""

from __future__ import annotations

import heapq
import threading
import time
from collections.abc import Callable

from .._transport import Transport

# How often the polling thread looks for expired calls.
TIMEOUT_CHECK_S = 0.01


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
    passes, on the polling thread (checked every ``TIMEOUT_CHECK_S`` while any is set)."""

    def __init__(self, transport: Transport, pending: dict, on_expired: Callable[[int], None]):
        self._transport = transport
        self._pending = pending
        self._on_expired = on_expired
        self._heap: list[tuple[float, int]] = []
        self._lock = threading.Lock()
        self._armed = False

    def __len__(self) -> int:
        return len(self._heap)

    def watch(self, deadline: float, call_id: int) -> None:
        with self._lock:
            heapq.heappush(self._heap, (deadline, call_id))
            if self._armed:
                return
            self._armed = True
        self._transport.call_later(TIMEOUT_CHECK_S, self._expire)

    def _expire(self) -> None:
        now = time.monotonic()
        expired = []
        with self._lock:
            while self._heap and self._heap[0][0] <= now:
                expired.append(heapq.heappop(self._heap)[1])
            # Answered calls need no watching: the heap stays bounded by the pending calls.
            pending = self._pending
            if len(self._heap) > 2 * len(pending) + 64:
                self._heap = [d for d in self._heap if d[1] in pending]
                heapq.heapify(self._heap)
            rearm = self._armed = bool(self._heap)
        for call_id in expired:
            self._on_expired(call_id)
        if rearm:
            self._transport.call_later(TIMEOUT_CHECK_S, self._expire)
