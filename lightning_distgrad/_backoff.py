"""The one nap-and-retry policy of the package: naps that double up to a cap.

MPICH spins a core inside blocking calls; with more ranks than cores (or beside the RPC progress
thread) a spinning rank steals the CPU that the ranks it waits for need. Every wait of the package
on something that completes elsewhere (a non-blocking MPI request, a peer's message, a rank's
output being read) therefore checks it and naps between checks, with a :class:`Backoff`: the
first nap is short, so a quick completion is seen at once, and each nap doubles up to a cap, so a
long wait costs next to nothing. The RPC poller naps the same way but can be woken early (its
``wait`` is a doorbell's, see ``rpc._transport.doorbell``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from mpi4py import MPI

__all__ = ["NAP_MAX_S", "NAP_MIN_S", "Backoff", "nap_until", "wait_all"]

#: The first nap, and the longest by default: a wait ends at most NAP_MAX_S after what it
#: waits for happened.
NAP_MIN_S = 1.5e-5
NAP_MAX_S = 0.001


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
    done: Callable[[], bool], timeout: float | None = None, backoff: Backoff | None = None
) -> bool:
    """Call ``done`` until it returns True, napping between calls (``backoff``: a default
    :class:`Backoff`); False if ``timeout`` seconds (None: no limit) passed first.

    Example::

        >>> from mpi4py import MPI
        >>> request = MPI.COMM_WORLD.Ibarrier()
        >>> nap_until(request.Test, timeout=60.0)
        True
    """
    deadline = None if timeout is None else time.monotonic() + timeout
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


def wait_all(*requests: MPI.Request) -> None:
    """Wait for every one of ``requests`` (non-blocking MPI calls) with naps, never spinning.

    Example::

        >>> from mpi4py import MPI
        >>> wait_all(MPI.COMM_WORLD.Ibarrier())
    """
    pending = list(requests)
    nap_until(lambda: MPI.Request.Testall(pending))
