"""The one nap-and-retry policy of the package: naps that double up to a cap.

MPICH spins a core inside blocking calls; with more ranks than cores (or beside the RPC progress
thread) a spinning rank steals the CPU that the ranks it waits for need. Every wait of the package
on something that completes elsewhere (a non-blocking MPI request, a peer's message, a rank's
output being read) therefore checks it and naps between checks, with a :class:`Backoff`: the
first nap is short, so a quick completion is seen at once, and each nap doubles up to a cap, so a
long wait costs next to nothing. The RPC poller naps the same way but can be woken early (its
``wait`` is a doorbell's, see ``rpc._transport.doorbell``).

Collectives are the exception (:func:`wait_collective`, :func:`wait_all`): each of their steps
moves only while the ranks concerned are inside an MPI call, so naps on every rank compound
(an 8-byte allreduce of 2 ranks on 2 cores took 230-500 us waited with naps, 7 us without). A
rank waiting for one first yields its core (``sched_yield``: any runnable process of the node
takes it, this one tests again as soon as none wants it) for up to :data:`YIELD_S`, then naps:
4 ranks on 2 cores took 40 us a collective so, 4 ms napping and 5 ms spinning.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable

from mpi4py import MPI

__all__ = [
    "NAP_MAX_S",
    "NAP_MIN_S",
    "YIELD_S",
    "Backoff",
    "nap_until",
    "wait_all",
    "wait_collective",
]

#: The first nap, and the longest by default: a wait ends at most NAP_MAX_S after what it
#: waits for happened.
NAP_MIN_S = 1.5e-5
NAP_MAX_S = 0.001
#: How long a wait for a collective yields the core between tests before it naps: longer than
#: a collective whose ranks have all arrived takes (150-220 us at 8 ranks on 2 cores), short
#: enough that a long wait for a late rank costs little CPU.
YIELD_S = 0.05


class Backoff:
    """Naps of ``first`` seconds, doubling up to ``cap``; :meth:`reset` after progress.

    ``wait(seconds)`` naps (``time.sleep`` unless something can cut the nap short).

    Example::

        >>> backoff = Backoff(cap=0.004)
        >>> backoff.nap()            # 15 us
        >>> backoff.nap()            # 30 us, ... up to 4 ms
        >>> backoff.reset()          # progress: the next nap is short again
    """

    __slots__ = ("first", "cap", "delay", "_wait")

    def __init__(
        self,
        cap: float = NAP_MAX_S,
        *,
        first: float = NAP_MIN_S,
        wait: Callable[[float], object] = time.sleep,
    ):
        self.first = first
        self.cap = cap
        self.delay = first
        self._wait = wait

    def reset(self) -> None:
        """The next nap is the first again (call after progress)."""
        self.delay = self.first

    def nap(self, limit: float = math.inf, cap: float | None = None) -> None:
        """Nap the current delay (at most ``limit`` s), then double it up to ``cap`` (default:
        the cap given at construction)."""
        self._wait(min(self.delay, limit))
        self.delay = min(self.cap if cap is None else cap, self.delay * 2)


def nap_until(
    done: Callable[[], bool],
    timeout: float | None = None,
    backoff: Backoff | None = None,
    yield_s: float = 0.0,
) -> bool:
    """Call ``done`` until it returns True, napping between calls (``backoff``: a default
    :class:`Backoff`) after the first ``yield_s`` seconds, in which it yields the core
    instead; False if ``timeout`` seconds (None: no limit) passed first.

    Example::

        >>> from mpi4py import MPI
        >>> request = MPI.COMM_WORLD.Ibarrier()
        >>> nap_until(request.Test, timeout=60.0)
        True
    """
    start = time.monotonic()
    deadline = None if timeout is None else start + timeout
    naps_from = start + yield_s if deadline is None else min(start + yield_s, deadline)
    while time.monotonic() < naps_from:
        if done():
            return True
        os.sched_yield()
    backoff = backoff or Backoff()
    while not done():
        if deadline is None:
            backoff.nap()
            continue
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        backoff.nap(left)
    return True


def wait_collective(done: Callable[[], bool], timeout: float | None = None) -> bool:
    """:func:`nap_until` for a collective (``done``: tests its request): yields the core
    for :data:`YIELD_S`, then naps.

    Example::

        >>> from mpi4py import MPI
        >>> wait_collective(MPI.COMM_WORLD.Ibarrier().Test, timeout=60.0)
        True
    """
    return nap_until(done, timeout, yield_s=YIELD_S)


def wait_all(*requests: MPI.Request) -> None:
    """Wait for every one of ``requests`` (non-blocking MPI collectives) as
    :func:`wait_collective` does: yielding the core, then napping.

    Example::

        >>> from mpi4py import MPI
        >>> wait_all(MPI.COMM_WORLD.Ibarrier())
    """
    pending = list(requests)
    wait_collective(lambda: MPI.Request.Testall(pending))
