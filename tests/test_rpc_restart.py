"""``init_rpc`` after ``shutdown`` in the same process starts clean.

A script may run several trainings, each between ``init_rpc`` and ``shutdown``; what
one leaves behind (frames still on their way to a rank that stopped at once, RRef and
autograd bookkeeping) must not reach the next. These tests run with the shared agent
stopped (the ``rpc_stopped`` fixture restarts it afterwards).
"""

from __future__ import annotations

import gc
import threading

import pytest
import torch
from _timing import scaled

import lightning_distgrad.autograd as dist_autograd
from lightning_distgrad import rpc

pytestmark = pytest.mark.mpi(min_size=2)

#: Seconds a graceful shutdown may take here before the test fails instead of hanging.
SHUTDOWN_TIMEOUT_S = scaled(60.0)

_seen: list = []
_seen_lock = threading.Lock()


def record(tag):
    """Remember that a request with ``tag`` ran here; returns ``tag``."""
    with _seen_lock:
        _seen.append(tag)
    return tag


def fetch(rref):
    return rref.to_here(timeout=scaled(10))


def seen() -> list:
    with _seen_lock:
        return list(_seen)


def test_requests_sent_to_a_stopped_rank_do_not_reach_its_next_agent(rpc_stopped):
    # Odd ranks stop at once (graceful=False); the rank before each keeps sending it
    # requests, which can never be answered. They must not be served by, nor answered
    # from, the agents of the next init_rpc.
    world = rpc_stopped
    stops_first = world.rank % 2 == 1
    target = world.peer() if not stops_first and world.peer_rank() % 2 == 1 else None
    rpc.init_rpc()
    world.barrier()
    if stops_first:
        rpc.shutdown(graceful=False)
        with _seen_lock:
            _seen.clear()
    world.barrier()
    if not stops_first:
        if target is not None:
            stale = [rpc.rpc_async(target, record, (f"stale{i}",), timeout=0.2) for i in range(5)]
            for future in stale:
                with pytest.raises(RuntimeError):
                    future.wait()
        rpc.shutdown(graceful=False)
    world.barrier()

    rpc.init_rpc()
    if target is not None:
        # The first calls of the new agent reuse the call ids of the stale ones.
        assert [rpc.rpc_sync(target, record, (f"fresh{i}",)) for i in range(5)] == [
            f"fresh{i}" for i in range(5)
        ]
        assert rpc.rpc_sync(target, seen) == [f"fresh{i}" for i in range(5)]
    world.barrier()
    rpc.shutdown(timeout=SHUTDOWN_TIMEOUT_S)


def test_autograd_and_rrefs_work_after_a_shutdown_that_did_not_wait(rpc_stopped):
    # A distributed backward pass and RRefs of the next agent give the results of a
    # first run, after a run whose ranks stopped at once with work still in flight.
    world = rpc_stopped
    t1 = torch.rand(3, 3, requires_grad=True)
    t2 = torch.rand(3, 3, requires_grad=True)
    for graceful in (False, True):
        rpc.init_rpc()
        with dist_autograd.context() as context_id:
            loss = rpc.rpc_sync(world.peer(), torch.mul, (t1, t2)).sum()
            dist_autograd.backward(context_id, [loss])
            grads = dist_autograd.get_gradients(context_id)
            assert torch.equal(grads[t1], t2.detach()) and torch.equal(grads[t2], t1.detach())
        rref = rpc.remote(world.peer(), torch.add, (t1.detach(), 1))
        assert torch.equal(rref.to_here(), t1.detach() + 1)
        # In flight at shutdown (graceful=False): requests this rank never waits for.
        rpc.rpc_async(world.peer(), torch.add, (t1.detach(), 2))
        rpc.remote(world.peer(), torch.add, (t1.detach(), 3))
        del rref
        world.barrier()
        if graceful:
            rpc.shutdown(timeout=SHUTDOWN_TIMEOUT_S)
        else:
            rpc.shutdown(graceful=False)
        world.barrier()


def test_rref_of_a_shut_down_session_is_refused_in_the_next(rpc_stopped):
    # RRef ids start again with each init_rpc: an RRef kept from a session that ended
    # without deleting its users (graceful=False) names another value in the next one.
    world = rpc_stopped
    rpc.init_rpc()
    old = rpc.remote(world.peer(), torch.add, (torch.ones(2), 1))
    assert torch.equal(old.to_here(), torch.full((2,), 2.0))
    world.barrier()
    rpc.shutdown(graceful=False)
    world.barrier()

    rpc.init_rpc()
    new = rpc.remote(world.peer(), torch.add, (torch.ones(2), 5))  # the same ids as ``old``
    refused = "belongs to an RPC session that has been shut down"
    with pytest.raises(RuntimeError, match=refused):
        old.to_here()
    with pytest.raises(RuntimeError, match=refused):
        rpc.rpc_sync(world.peer(), torch.add, (old, 1))
    with pytest.raises(RuntimeError, match=refused):
        old.rpc_sync().size()
    del old  # tells nobody: the fork it would delete is ``new``'s
    gc.collect()
    world.barrier()
    assert torch.equal(rpc.rpc_sync(world.peer(), fetch, (new,)), torch.full((2,), 6.0))
    assert torch.equal(new.to_here(timeout=scaled(10)), torch.full((2,), 6.0))
    world.barrier()
    rpc.shutdown(timeout=SHUTDOWN_TIMEOUT_S)
