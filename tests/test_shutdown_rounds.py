"""Graceful shutdown's cost and guarantees: frames sent grow as log n, a late worker's
calls are answered, a frozen one bounds a timed shutdown.

The frames a rank sends during ``shutdown()`` are counted by the transport
(``Transport.frames_sent``), the RRefs' release counted apart: the protocol itself may send
at most 4 * ceil(log2(n)) + 4 (see ``rpc._calls.graceful_shutdown``).
"""

from __future__ import annotations

import math
import threading
import time

import pytest
import torch
from _timing import scaled

from lightning_distgrad import rpc
from lightning_distgrad.rpc._calls import dispatch, graceful_shutdown

pytestmark = pytest.mark.mpi(min_size=2)


def frames_bound(size: int) -> int:
    return 4 * math.ceil(math.log2(size)) + 4


def slow_add(seconds, x):
    time.sleep(seconds)
    return x + 1


def shutdown_frames(agent, **kwargs) -> tuple[int, int]:
    """(frames the shutdown protocol sent, frames the RRefs' release sent)."""
    released = []
    release = graceful_shutdown.graceful

    def counted(agent_, timeout, release_users):
        def release_counted():
            before = agent_.transport.frames_sent()
            release_users()
            released.append(agent_.transport.frames_sent() - before)

        release(agent_, timeout, release_counted)

    before = agent.transport.frames_sent()
    graceful_shutdown.graceful = counted
    try:
        rpc.shutdown(**kwargs)
    finally:
        graceful_shutdown.graceful = release
    total = agent.transport.frames_sent() - before
    return total - sum(released), sum(released)


def test_shutdown_sends_log_n_frames(rpc_stopped):
    world = rpc_stopped
    rpc.init_rpc()
    agent = dispatch.require_agent()
    for distance in range(world.size):
        rpc.rpc_sync(world.peer(distance), torch.add, (torch.ones(2), 1))
    # A user RRef whose release is counted apart.
    rref = rpc.remote(world.peer(), torch.add, (torch.ones(2), 1))
    assert torch.equal(rref.to_here(), torch.full((2,), 2.0))
    world.barrier()
    protocol, released = shutdown_frames(agent)
    everyone = world.comm.allgather((protocol, released))
    assert all(p <= frames_bound(world.size) for p, _ in everyone), everyone
    assert sum(r for _, r in everyone) <= world.size, everyone


def test_late_worker_still_has_its_calls_answered(rpc_stopped):
    """The others call shutdown at once; the last rank sleeps first, then calls each of
    them: every call is answered and every shutdown returns."""
    world = rpc_stopped
    rpc.init_rpc()
    last = world.size - 1
    world.barrier()
    if world.rank == last:
        time.sleep(1.0)
        futures = [rpc.rpc_async(world.names[r], slow_add, (0.1, r)) for r in range(last)]
        assert [f.wait() for f in futures] == [r + 1 for r in range(last)]
    returned = threading.Event()
    thread = threading.Thread(target=lambda: (rpc.shutdown(), returned.set()), daemon=True)
    thread.start()
    thread.join(scaled(60))
    assert returned.is_set(), "graceful shutdown did not return"
