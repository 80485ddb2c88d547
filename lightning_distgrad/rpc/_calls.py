"""Calls waiting for their responses: their futures and their deadlines."""

from __future__ import annotations

import collections
import heapq
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from .._compat import future_done
from ._transport import Transport

# How often the polling thread looks for expired calls.
TIMEOUT_CHECK_S = 0.01


class UserFuture(torch.futures.Future):
    """The future of ``rpc_async``: ``wait()`` polls MPI on the waiting thread, as
    ``rpc_sync`` does, and completes the future with the response it received.

    The future is completed after the thread stopped polling: its callbacks then
    run there, and one that waits for an RPC of its own can poll in turn.
    """

    def __init__(self, transport: Transport):
        super().__init__()
        self._transport = transport
        self.waiter: int | None = None  # ident of a thread polling in wait()
        self.completion: Callable[[], None] | None = None  # set by the waiter's delivery

    def _answered(self) -> bool:
        return self.completion is not None or future_done(self)

    def wait(self) -> Any:
        if not self.done():
            self.waiter = threading.get_ident()
            self._transport.drive_until(self._answered)
            completion, self.completion = self.completion, None
            if completion is not None:
                completion()
        return super().wait()


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


class Waiter:
    """A thread that waits for served one-way frames, and the work handed to it."""

    __slots__ = ("ident", "_work", "_wake")

    def __init__(self, ident: int):
        self.ident = ident
        self._work: collections.deque = collections.deque()
        self._wake = threading.Event()

    def hand_over(self, fn: Callable[[], None]) -> None:
        self._work.append(fn)
        self._wake.set()

    def run_handed_over(self) -> None:
        while True:
            try:
                fn = self._work.popleft()
            except IndexError:
                return
            fn()

    def wake(self) -> None:
        self._wake.set()

    def sleep(self, seconds: float) -> None:
        self._wake.wait(max(0.0, seconds))
        self._wake.clear()
