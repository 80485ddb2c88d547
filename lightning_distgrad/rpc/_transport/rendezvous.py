"""The rendezvous of ``init_rpc``: every rank of the communicator meets, or each that came
raises after a deadline instead of waiting forever.

A rank that never calls ``init_rpc`` (a script that starts RPC under ``if rank == 0:``, a
rank that failed earlier) would leave the others in a blocking collective for good. Here
the ranks first meet in a non-blocking barrier, polled until the deadline; then they agree
on a few numbers with a non-blocking allreduce (:func:`agree`) or exchange their ``init_rpc``
arguments with non-blocking all-gathers (:func:`exchange`), also under it.

MPI cannot cancel a collective. A barrier left pending by a timed-out ``init_rpc`` is
kept and waited for again by the next ``init_rpc`` of this process on that communicator,
so the ranks' collectives stay in step: a late rank completes it. A timeout after the
barrier (a rank left in between) leaves the communicator's collectives out of step; a
later ``init_rpc`` on it says so at once.
"""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np
from mpi4py import MPI

from ..._backoff import wait_collective

__all__ = ["agree", "exchange"]

# Per communicator handle: the barrier of an init_rpc that timed out, still pending.
_pending_barriers: dict[int, MPI.Request] = {}
# Communicators whose exchange timed out after the barrier.
_out_of_step: set[int] = set()
#: What this process's rendezvous handed to collectives and got back from them, in bytes, and
#: how many collectives it posted (barriers included): the cost of init_rpc, for benchmarks.
traffic = {"collectives": 0, "bytes_sent": 0, "bytes_received": 0}


def _handle(comm: MPI.Comm) -> int:
    return comm.py2f()


def _wait(request: MPI.Request, timeout: float) -> bool:
    return wait_collective(request.Test, timeout if timeout > 0 else None)


def _waited_too_long(comm: MPI.Comm, timeout: float, what: str) -> RuntimeError:
    return RuntimeError(
        f"init_rpc waited {timeout:g} s (the RPC timeout, rpc_backend_options.rpc_timeout) "
        f"{what}, on rank {comm.Get_rank()} of {comm.Get_size()}. init_rpc is a collective: "
        "every rank of the communicator (MPI.COMM_WORLD unless MPIRpcBackendOptions(comm=...) "
        "names another) must call it, with the same world_size. Call it on every rank, or "
        "pass a communicator of the ranks that use RPC; a larger rpc_timeout waits longer "
        "for slow ranks."
    )


def agree(comm: MPI.Comm, values: list[int], timeout: float) -> list[int]:
    """The elementwise maximum of every rank's ``values`` (integers of 63 bits), once all
    ranks of ``comm`` called this: one small allreduce, the same few bytes at any size.

    Waits as :func:`exchange` does, and raises as it does.

    Example::

        >>> # xdoctest: +SKIP
        >>> agree(MPI.COMM_WORLD, [MPI.COMM_WORLD.Get_rank()], timeout=60.0)  # mpiexec -n 2
        [1]
    """
    _meet(comm, timeout)
    mine = np.array(values, dtype=np.int64)
    top = np.empty_like(mine)
    _collective(comm, timeout, lambda: comm.Iallreduce(mine, top, op=MPI.MAX))
    _count(mine.nbytes, top.nbytes)
    return top.tolist()


def exchange(comm: MPI.Comm, value: Any, timeout: float, met: bool = False) -> list[Any]:
    """Every rank's ``value`` (picklable), by rank, once all ranks of ``comm`` called this.

    Waits at most ``timeout`` seconds (0: no limit) for the other ranks to arrive, then as
    long again for their values; raises ``RuntimeError`` saying so instead of waiting on.
    ``met``: the ranks just met in :func:`agree` on ``comm``, so no barrier first.

    Example::

        >>> # xdoctest: +SKIP
        >>> exchange(MPI.COMM_WORLD, "hello", timeout=60.0)   # under mpiexec -n 2
        ['hello', 'hello']
    """
    if not met:
        _meet(comm, timeout)
    data = np.frombuffer(pickle.dumps(value), dtype=np.uint8)
    sizes = np.zeros(comm.Get_size(), dtype=np.int64)
    mine = np.array([data.size], dtype=np.int64)
    _collective(comm, timeout, lambda: comm.Iallgather(mine, sizes))
    everyone = np.empty(int(sizes.sum()), dtype=np.uint8)
    _collective(comm, timeout, lambda: comm.Iallgatherv(data, (everyone, sizes)))
    _count(mine.nbytes + data.nbytes, sizes.nbytes + everyone.nbytes)
    offsets = np.concatenate(([0], np.cumsum(sizes)))
    return [
        pickle.loads(everyone[offsets[r] : offsets[r + 1]].tobytes()) for r in range(len(sizes))
    ]


def _meet(comm: MPI.Comm, timeout: float) -> None:
    """Every rank of ``comm`` arrives (a barrier), or this raises after ``timeout`` s."""
    handle = _handle(comm)
    if handle in _out_of_step:
        raise RuntimeError(
            "an earlier init_rpc on this communicator timed out while the ranks exchanged "
            "their arguments: its collectives are out of step and RPC cannot start on it. "
            "Restart the job, calling init_rpc on every rank."
        )
    barrier = _pending_barriers.pop(handle, None)
    if barrier is None:
        barrier = comm.Ibarrier()
        traffic["collectives"] += 1
    if not _wait(barrier, timeout):
        _pending_barriers[handle] = barrier  # the next init_rpc waits for it again
        raise _waited_too_long(comm, timeout, "for the other ranks to call init_rpc")


def _count(sent: int, received: int) -> None:
    traffic["bytes_sent"] += sent
    traffic["bytes_received"] += received


def _collective(comm: MPI.Comm, timeout: float, post: Any) -> None:
    """Post a collective (``post()``, after the ranks met) and wait for it; a timeout leaves
    the communicator's collectives out of step, which the next init_rpc on it reports."""
    traffic["collectives"] += 1
    if not _wait(post(), timeout):
        _out_of_step.add(_handle(comm))
        raise _waited_too_long(comm, timeout, "for the other ranks' arguments")
