"""Waiting for MPI without spinning: naps that double from :data:`NAP_MIN_S` to :data:`NAP_MAX_S`.

MPICH spins a core inside blocking calls; with more ranks than cores (or beside the RPC progress
thread) a spinning rank steals the CPU that the ranks it waits for need. Every wait of the package
on a non-blocking request therefore polls it and naps between polls. The RPC poller naps the same
way but can be woken early (``rpc._doorbell.Backoff``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from mpi4py import MPI

__all__ = ["NAP_MAX_S", "NAP_MIN_S", "nap_until", "wait_all"]

#: The first nap, and the longest: a wait ends at most NAP_MAX_S after its request completed.
NAP_MIN_S = 1.5e-5
NAP_MAX_S = 0.001


def nap_until(done: Callable[[], bool], timeout: float | None = None) -> bool:
    """Call ``done`` until it returns True, napping between calls; False if ``timeout`` seconds
    (None: no limit) passed first.

    Example::

        >>> from mpi4py import MPI
        >>> request = MPI.COMM_WORLD.Ibarrier()
        >>> nap_until(request.Test, timeout=60.0)
        True
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    delay = NAP_MIN_S
    while not done():
        if deadline is not None and time.monotonic() >= deadline:
            return False
        time.sleep(delay)
        delay = min(NAP_MAX_S, delay * 2)
    return True


def wait_all(*requests: MPI.Request) -> None:
    """Wait for every one of ``requests`` (non-blocking MPI calls) with naps, never spinning.

    Example::

        >>> from mpi4py import MPI
        >>> wait_all(MPI.COMM_WORLD.Ibarrier())
    """
    pending = list(requests)
    nap_until(lambda: MPI.Request.Testall(pending))
