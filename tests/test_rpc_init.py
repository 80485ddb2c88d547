"""``init_rpc`` and ``shutdown``: argument checks on every rank, retries, draining.

These tests run with the shared agent stopped (the ``rpc_stopped`` fixture
restarts it afterwards), so each starts and stops its own agents.
"""

from __future__ import annotations

import builtins
import threading
import time

import pytest
import torch
from _timing import scaled
from mpi4py import MPI

from lightning_distgrad import rpc
from lightning_distgrad.rpc import BackendType, MPIRpcBackendOptions, TensorPipeRpcBackendOptions

pytestmark = pytest.mark.mpi(min_size=2)

NOT_INITIALIZED = r"^RPC has not been initialized\. Call .*init_rpc first\."
SHUT_DOWN = "RPC has been shut down on this worker; init_rpc can start it again."


# ---------------------------------------------------------------------------
# Remote functions


def world_rank():
    return MPI.COMM_WORLD.Get_rank()


def slow_add(seconds, x):
    time.sleep(seconds)
    return x + 1


_handler_started = threading.Event()


def fetch_later(rref, seconds):
    """Holds a user RRef while its worker's main thread enters shutdown, then uses it."""
    _handler_started.set()
    time.sleep(seconds)
    return rref.to_here()


def fire_and_forget(to, seconds, x):
    """Starts a nested RPC and returns without waiting for it."""
    rpc.rpc_async(to, slow_add, (seconds, x))
    return x


# ---------------------------------------------------------------------------
# Helpers


def assert_works(names: list[str]) -> None:
    for i, name in enumerate(names):
        assert rpc.rpc_sync(name, builtins.abs, (-i,)) == i


def init_error(**kwargs) -> str:
    """Run a failing ``init_rpc`` (a collective); return its message."""
    with pytest.raises(RuntimeError) as info:
        rpc.init_rpc(**kwargs)
    with pytest.raises(RuntimeError, match=NOT_INITIALIZED):
        rpc.get_worker_info()
    return str(info.value)


# ---------------------------------------------------------------------------
# Before init_rpc and after shutdown


def calls_that_need_an_agent() -> list:
    x = torch.ones(1)
    return [
        lambda: rpc.rpc_sync("worker0", torch.add, (x, 1)),
        lambda: rpc.rpc_async("worker0", torch.add, (x, 1)),
        lambda: rpc.remote("worker0", torch.add, (x, 1)),
        lambda: rpc.get_worker_info(),
        lambda: rpc.get_worker_info("worker0"),
        lambda: rpc.get_rpc_timeout(),
        lambda: rpc._set_rpc_timeout(1.0),
        lambda: rpc.shutdown(),
        lambda: rpc.RRef(3),
        lambda: rpc._rref_context_get_debug_info(),
        lambda: rpc._get_current_rpc_agent(),
    ]


def test_every_call_without_an_agent_raises_not_initialized(rpc_stopped):
    calls = calls_that_need_an_agent()
    for call in calls:
        with pytest.raises(RuntimeError, match=NOT_INITIALIZED):
            call()
    rpc.init_rpc()
    assert_works(rpc_stopped.names)
    rpc.shutdown()
    for call in calls:
        with pytest.raises(RuntimeError, match=NOT_INITIALIZED):
            call()


def test_calls_after_shutdown_say_rpc_was_shut_down(rpc_stopped):
    calls = calls_that_need_an_agent()
    for graceful in (True, False):
        rpc.init_rpc()
        assert_works(rpc_stopped.names)
        rpc_stopped.barrier()  # nothing in flight anywhere (for graceful=False)
        rpc.shutdown(graceful=graceful)
        for call in calls:
            # torch's text first: code ported from torch matches on it.
            with pytest.raises(RuntimeError, match=NOT_INITIALIZED) as info:
                call()
            assert SHUT_DOWN in str(info.value)
        rpc_stopped.barrier()
    rpc.init_rpc()  # init_rpc starts it again
    assert_works(rpc_stopped.names)
    assert rpc.get_worker_info().name == rpc_stopped.name
    rpc.shutdown()


def test_calls_before_the_first_init_rpc_do_not_say_shut_down(rpc_stopped, monkeypatch):
    from lightning_distgrad.rpc._calls import dispatch

    monkeypatch.setattr(dispatch, "_shut_down", False)  # as in a fresh process
    with pytest.raises(RuntimeError, match=NOT_INITIALIZED) as info:
        rpc.rpc_sync("worker0", torch.add, (torch.ones(1), 1))
    assert "shut down" not in str(info.value)


def test_bad_shutdown_timeout_raises_before_shutting_down(rpc_stopped):
    rpc.init_rpc()
    for bad in (-5, -0.001, rpc.UNSET_RPC_TIMEOUT, float("nan"), "1", None):
        with pytest.raises(
            TypeError if bad in ("1", None) else ValueError,
            match=r"^timeout must be a number of seconds >= 0 "
            r"\(0: no timeout\); got ",
        ):
            rpc.shutdown(timeout=bad)
    assert_works(rpc_stopped.names)  # still running
    rpc.shutdown(timeout=scaled(30))


def test_rref_used_after_shutdown_raises(rpc_stopped):
    rpc.init_rpc()
    rref = rpc.remote(rpc_stopped.peer(), torch.add, (torch.ones(1), 1))
    assert torch.equal(rref.to_here(), torch.full((1,), 2.0))
    rpc.shutdown()
    with pytest.raises(RuntimeError, match="has been deleted. Cannot call to_here"):
        rref.to_here()


# ---------------------------------------------------------------------------
# Argument checks: the same error on every rank, then a corrected retry works


@pytest.mark.parametrize(
    "bad_name, problem",
    [
        ("bad*name", "Worker name must match"),
        ("has space", "Worker name must match"),
        ("", "must be non-empty"),
        ("w" * 128, "shorter than 128"),
        (42, "must be a str"),
    ],
)
def test_malformed_name_on_one_rank_fails_init_everywhere(rpc_stopped, bad_name, problem):
    last = rpc_stopped.size - 1
    name = bad_name if rpc_stopped.rank == last else None
    message = init_error(name=name)
    assert problem in message
    assert f"rank {last}" in message
    rpc.init_rpc()
    assert_works(rpc_stopped.names)
    rpc.shutdown()


def test_duplicate_name_fails_init_everywhere(rpc_stopped):
    # Rank 1 takes rank 0's default name.
    name = "worker0" if rpc_stopped.rank == 1 else None
    message = init_error(name=name)
    assert "'worker0' is not unique" in message and "ranks 0 and 1" in message
    message = init_error(name="same")
    assert "'same' is not unique" in message
    rpc.init_rpc(name=f"trainer{rpc_stopped.rank}")
    assert_works([f"trainer{r}" for r in range(rpc_stopped.size)])
    rpc.shutdown()


def test_rank_that_disagrees_with_mpi_fails_init_everywhere(rpc_stopped):
    rank = (rpc_stopped.rank + 1) % rpc_stopped.size if rpc_stopped.rank == 0 else -1
    message = init_error(rank=rank)
    assert "rank=1 was passed but MPI says this process is rank 0" in message
    rpc.init_rpc(rank=rpc_stopped.rank)
    assert_works(rpc_stopped.names)
    rpc.shutdown()


def test_world_size_that_disagrees_with_mpi_fails_init_everywhere(rpc_stopped):
    size = rpc_stopped.size
    message = init_error(world_size=size + 1)
    assert f"world_size={size + 1} was passed but the MPI job has {size} ranks" in message
    # One rank's wrong world_size fails init on every rank (1 would start RPC alone).
    message = init_error(world_size=size + 2 if rpc_stopped.rank == 0 else size)
    assert "rank 0" in message
    rpc.init_rpc(world_size=size)
    assert_works(rpc_stopped.names)
    rpc.shutdown()


def test_a_rank_with_another_torch_fails_init_everywhere(rpc_stopped, monkeypatch):
    # Frames carry dtypes as indices into torch's dtype list: a rank whose list
    # differs would read float32 tensors as something else.
    from lightning_distgrad.rpc import _lifecycle

    if rpc_stopped.rank == 1:
        monkeypatch.setattr(_lifecycle, "DTYPE_TABLE", _lifecycle.DTYPE_TABLE + ("torch.float128",))
    message = init_error()
    assert "rank 1 ('worker1'): its torch" in message
    assert "install the same torch version on every rank" in message
    monkeypatch.undo()
    rpc.init_rpc()
    assert_works(rpc_stopped.names)
    rpc.shutdown()


def test_init_with_default_names_sends_the_same_few_bytes_at_any_size(rpc_stopped, monkeypatch):
    # The usual init (names worker{rank}, no device maps, one torch): one allreduce of three
    # int64 numbers, nothing gathered; a chosen name on one rank gathers every rank's.
    from lightning_distgrad.rpc import _lifecycle

    agreed, gathered = [], []
    agree, exchange = _lifecycle.agree, _lifecycle.exchange

    def counting_agree(comm, values, timeout):
        agreed.append(8 * len(values))  # bytes this rank sends and receives
        return agree(comm, values, timeout)

    def counting_exchange(comm, value, timeout, met=False):
        gathered.append(value)
        return exchange(comm, value, timeout, met)

    monkeypatch.setattr(_lifecycle, "agree", counting_agree)
    monkeypatch.setattr(_lifecycle, "exchange", counting_exchange)
    rpc.init_rpc()
    assert (agreed, gathered) == ([24], [])
    assert_works(rpc_stopped.names)
    rpc.shutdown()
    names = [f"worker{r}" for r in range(rpc_stopped.size)]
    names[-1] = "last"
    rpc.init_rpc(name=names[rpc_stopped.rank])
    assert len(agreed) == 2 and len(gathered) == 1 and gathered[0][0] == names[rpc_stopped.rank]
    assert_works(names)
    rpc.shutdown()


def test_wrong_argument_types_raise_type_error(rpc_stopped):
    with pytest.raises(TypeError, match="backend must be a member of BackendType"):
        rpc.init_rpc(backend="mpi")
    with pytest.raises(TypeError, match="Argument rpc_backend_options must be an instance"):
        rpc.init_rpc(rpc_backend_options={"rpc_timeout": 1})
    with pytest.raises(RuntimeError, match=NOT_INITIALIZED):
        rpc.get_worker_info()


def test_explicit_arguments_and_options(rpc_stopped):
    rank, size = rpc_stopped.rank, rpc_stopped.size
    options = MPIRpcBackendOptions(rpc_timeout=7, num_worker_threads=2)
    rpc.init_rpc(f"trainer{rank}", BackendType.MPI, rank, size, options)
    assert rpc.get_rpc_timeout() == 7
    me = rpc.get_worker_info()
    assert (me.name, me.id) == (f"trainer{rank}", rank)
    names = [f"trainer{r}" for r in range(size)]
    assert_works(names)
    # Two worker threads still serve nested calls that come back here.
    assert rpc.rpc_sync(names[(rank + 1) % size], fire_and_forget, (me.name, 0.0, 5)) == 5
    rpc.shutdown()
    # torch's names for the same things work too.
    rpc.init_rpc(
        name=None,
        backend=BackendType.TENSORPIPE,
        rpc_backend_options=TensorPipeRpcBackendOptions(rpc_timeout=0),
    )
    assert rpc.get_rpc_timeout() == 0
    assert_works(rpc_stopped.names)
    rpc.shutdown()


def test_init_on_a_sub_communicator_uses_its_ranks(rpc_stopped):
    color = rpc_stopped.rank % 2
    sub = rpc_stopped.comm.Split(color, rpc_stopped.rank)
    try:
        rpc.init_rpc(rpc_backend_options=MPIRpcBackendOptions(comm=sub))
        me, n = rpc.get_worker_info(), sub.Get_size()
        assert (me.name, me.id) == (f"worker{sub.Get_rank()}", sub.Get_rank())
        members = [r for r in range(rpc_stopped.size) if r % 2 == color]
        for i in range(n):
            assert rpc.rpc_sync(i, world_rank) == members[i]
        with pytest.raises(RuntimeError, match="could not find destination"):
            rpc.get_worker_info(f"worker{n}")
        rpc.shutdown()
    finally:
        sub.Free()


def test_requests_right_after_init_rpc_are_served(rpc_stopped):
    # Peers leave init_rpc at different times; requests that reach a worker
    # still inside init_rpc must be served normally, in every round.
    for i in range(5):
        rpc.init_rpc(name=f"round{i}-{rpc_stopped.rank}")
        names = [f"round{i}-{r}" for r in range(rpc_stopped.size)]
        rrefs = [rpc.remote(n, torch.add, (torch.ones(1), r)) for r, n in enumerate(names)]
        futs = [rpc.rpc_async(n, world_rank) for n in names]
        assert [f.wait() for f in futs] == list(range(rpc_stopped.size))
        assert [int(r.to_here(timeout=scaled(30)).item()) for r in rrefs] == [
            1 + r for r in range(rpc_stopped.size)
        ]
        del rrefs
        rpc.shutdown()


# ---------------------------------------------------------------------------
# Shutdown


def test_graceful_shutdown_drains_in_flight_work(rpc_stopped):
    rpc.init_rpc()
    peer = rpc_stopped.peer()
    futs = [rpc.rpc_async(peer, slow_add, (0.05, i)) for i in range(40)]
    rrefs = [rpc.remote(peer, slow_add, (0.05, i)) for i in range(10)]
    rpc.shutdown()  # at once, with all of that in flight
    assert all(fut.done() for fut in futs)
    assert [fut.wait() for fut in futs] == [i + 1 for i in range(40)]
    for rref in rrefs:
        assert rref._get_future().done()
        rref._get_future().wait()  # created without error


def test_graceful_shutdown_with_uneven_workload(rpc_stopped):
    rpc.init_rpc()
    futs = []
    if rpc_stopped.rank == 0:  # the others shut down at once, with nothing of their own
        futs = [
            rpc.rpc_async(rpc_stopped.names[1 + i % (rpc_stopped.size - 1)], slow_add, (0.02, i))
            for i in range(60)
        ]
    rpc.shutdown()
    assert [fut.wait() for fut in futs] == [i + 1 for i in range(len(futs))]


def test_user_rrefs_stay_valid_until_every_worker_called_shutdown(rpc_stopped):
    # As in the DDP+RPC tutorial, a worker calls shutdown at once and serves work that
    # uses RRefs meanwhile: torch deletes user RRefs only once every worker is in
    # shutdown. Deleting them at once failed the trainer with "after deletion".
    _handler_started.clear()
    rpc.init_rpc()
    fut = None
    if rpc_stopped.rank == 0:
        fut = rpc.rpc_async(rpc_stopped.names[1], fetch_later, (rpc.RRef(torch.ones(2)), 0.5))
    elif rpc_stopped.rank == 1:
        assert _handler_started.wait(scaled(60))  # the request (and its user RRef) is here
    rpc_stopped.barrier()
    if fut is not None:
        assert torch.equal(fut.wait(), torch.ones(2))
    rpc.shutdown()


def test_graceful_shutdown_waits_for_fire_and_forget_chains(rpc_stopped):
    rpc.init_rpc()
    futs = [
        rpc.rpc_async(rpc_stopped.peer(), fire_and_forget, (rpc_stopped.peer(2), 0.2, i))
        for i in range(5)
    ]
    assert [fut.wait() for fut in futs] == list(range(5))
    rpc.shutdown()  # the nested calls are still running on peer(2)


def test_local_shutdown(rpc_stopped):
    rpc.init_rpc()
    assert_works(rpc_stopped.names)
    rpc_stopped.barrier()  # nothing in flight anywhere
    rpc.shutdown(graceful=False)
    with pytest.raises(RuntimeError, match=NOT_INITIALIZED):
        rpc.rpc_sync(rpc_stopped.peer(), builtins.abs, (1,))
    rpc_stopped.barrier()
    rpc.init_rpc()
    assert_works(rpc_stopped.names)
    rpc.shutdown()


def test_a_rank_in_its_first_mpi4py_object_reduction_still_serves_calls(rpc_stopped):
    # mpi4py duplicates a communicator, holding the GIL until every rank is there, in the
    # first reduction of Python objects on it: rank 0 waits there while the others still
    # need its answers to get there. init_rpc made that first reduction already.
    comm = MPI.COMM_WORLD.Dup()  # no object reduction has run on it yet
    options = MPIRpcBackendOptions(comm=comm, rpc_timeout=scaled(30))
    rpc.init_rpc(rank=rpc_stopped.rank, world_size=rpc_stopped.size, rpc_backend_options=options)
    try:
        if rpc_stopped.rank != 0:
            for i in range(20):
                answer = rpc.rpc_sync("worker0", torch.add, (torch.ones(2), i))
                assert answer.tolist() == [i + 1.0] * 2
        assert comm.allreduce(rpc_stopped.rank) == sum(range(rpc_stopped.size))
    finally:
        rpc.shutdown()
        comm.Free()
