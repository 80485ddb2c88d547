"""The one way a thread waits for a future of the agent: by driving MPI progress itself.

A thread that waits for a response polls MPI in the progress thread's place
(``Transport.drive_until``): the response then wakes no other thread. Only one thread
polls at a time; a thread that finds another one polling sleeps until its future completes
instead. :meth:`Waiting.wait` is that path, for every wait of the package: ``rpc_sync``, a
``UserFuture.wait()`` (``rpc_async``), the internal calls of RRefs, autograd and the
optimizer, and a distributed backward pass waiting for its credit.

A thread may also ask for the served one-way frames that answer what it waits for (those
whose waiter key is its key, see ``one_way``): they then run on that thread while it waits,
instead of on the worker pool (:meth:`Waiting.waiting_for`).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import math
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..._compat import future_done
from .._transport import Transport


class Waiter:
    """A thread that waits, and the work handed to it meanwhile."""

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
        self._wake.wait(None if seconds == math.inf else max(0.0, seconds))
        self._wake.clear()


class Waiting:
    """How the threads of one agent wait for its futures (see the module's docstring)."""

    def __init__(self, transport: Transport):
        self._transport = transport
        # Threads that take served one-way frames, by waiter key (see waiting_for).
        self._waiters: dict[Any, Waiter] = {}

    def waiter(self, key: Any) -> Waiter | None:
        """The thread that takes served one-way frames of waiter key ``key``, if any."""
        return self._waiters.get(key)

    @contextlib.contextmanager
    def waiting_for(self, key: Any) -> Iterator[None]:
        """Served one-way frames whose waiter key is ``key`` run on this thread from now
        on: while it waits in :meth:`wait` with that key, and those that come before or
        between its waits are kept for it. Enter it before sending what they answer."""
        waiter = self._waiters[key] = Waiter(threading.get_ident())
        try:
            yield
        finally:
            self._waiters.pop(key, None)
            waiter.run_handed_over()  # handed over before it stopped: its work all the same

    def wait(
        self,
        future: torch.futures.Future,
        timeout: float = 0.0,
        key: Any = None,
        answered: Callable[[], bool] | None = None,
    ) -> bool:
        """Wait at most ``timeout`` s (<= 0: no limit) until ``future`` is done (or
        ``answered()``, when given); True if it is.

        This thread drives MPI progress meanwhile; while another thread drives it, this
        one sleeps until the future completes. Served one-way frames for ``key`` (see
        :meth:`waiting_for`) run on this thread meanwhile: they are the work it waits for.
        """
        if answered is None:
            answered = functools.partial(future_done, future)
        if answered():
            return True
        me = threading.get_ident()
        if self._transport.is_progress_thread(me):
            # A request run on the progress thread waits: another thread polls meanwhile.
            self._transport.step_out()
        if key is not None and key not in self._waiters:
            with self.waiting_for(key):
                return self.wait(future, timeout, key, answered)
        waiter = self._waiters.get(key) if key is not None else None
        if waiter is not None and waiter.ident != me:
            waiter = None  # that key's work goes to the thread that asked for it
        deadline = time.monotonic() + timeout if timeout > 0 else math.inf

        def done() -> bool:
            if waiter is not None:
                waiter.run_handed_over()
            return answered() or time.monotonic() >= deadline

        # The common wait (no limit, nothing handed over) checks only the future.
        plain = deadline == math.inf and waiter is None
        if not self._transport.drive_until(answered if plain else done):  # another polls
            sleeper = waiter or Waiter(me)
            future.add_done_callback(lambda _: sleeper.wake())
            while not done():
                sleeper.sleep(deadline - time.monotonic())
        return answered()


class UserFuture(torch.futures.Future):
    """The future of ``rpc_async``: ``wait()`` polls MPI on the waiting thread, as
    ``rpc_sync`` does, and completes the future with the response it received.

    The future is completed after the thread stopped polling: its callbacks then
    run there, and one that waits for an RPC of its own can poll in turn.
    """

    def __init__(self, waiting: Waiting):
        super().__init__()
        self._waiting = waiting
        self.waiter: int | None = None  # ident of a thread polling in wait()
        self.completion: Callable[[], None] | None = None  # set by the waiter's delivery

    def _answered(self) -> bool:
        return self.completion is not None or future_done(self)

    def wait(self) -> Any:
        if not self.done():
            self.waiter = threading.get_ident()
            self._waiting.wait(self, answered=self._answered)
            completion, self.completion = self.completion, None
            if completion is not None:
                completion()
        return super().wait()
