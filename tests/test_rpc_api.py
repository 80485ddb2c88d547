"""The RPC API on a running agent: destinations, calls, futures, nesting, timeouts.

Every rank runs each test at the same time and calls its neighbours, so the
agents serve and issue requests concurrently. Remote functions are module
level: the callee imports them by name.
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import os
import threading
import time

import pytest
import torch
from _busy_core import busy_core, pinned, preempted_for
from _dist_utils import wait_until
from _timing import scaled

from lightning_distgrad import rpc
from lightning_distgrad.rpc import WorkerInfo
from lightning_distgrad.rpc._calls.inlining import BUDGET_S

pytestmark = pytest.mark.mpi(min_size=2)


# ---------------------------------------------------------------------------
# Remote functions


def add_kwargs(x, *, y=0, z=0):
    return x + y + z


def whoami():
    return rpc.get_worker_info()


def echo(obj):
    return obj


def nothing():
    return None


def rpc_back(to, x):
    """Nested RPC: called remotely, makes its own RPC to ``to``."""
    return rpc.rpc_sync(to, torch.add, (x, 1))


def chain(path, x):
    """Hop along ``path`` (a list of worker names) adding 1 per hop."""
    if not path:
        return x
    return rpc.rpc_sync(path[0], chain, (path[1:], x + 1))


def nested_remote(to, x):
    """Creates an RRef on ``to`` from inside a remote function and fetches it."""
    return rpc.remote(to, torch.mul, (x, 2)).to_here()


_RELEASES: dict[str, threading.Event] = {}
RELEASE_TIMEOUT_S = scaled(20.0)


def served_on_the_pool(fn):
    """``fn`` as an ``async_execution`` function, which always runs on the worker pool: a
    helper that reads counts or releases a request must not move them itself (an inline run
    that the machine preempts for long enough hands the progress role over, and one that
    outlasts the budget sends its function's next requests to the pool)."""

    @rpc.functions.async_execution
    @functools.wraps(fn)
    def on_the_pool(*args):
        answer = torch.futures.Future()
        answer.set_result(fn(*args))
        return answer

    return on_the_pool


def wait_for_release(key):
    """Blocks the thread that serves it until a later request runs ``release(key)``."""
    return _RELEASES.setdefault(key, threading.Event()).wait(RELEASE_TIMEOUT_S)


@served_on_the_pool
def is_waiting(key):
    return key in _RELEASES


@served_on_the_pool
def release(key):
    _RELEASES.setdefault(key, threading.Event()).set()


def serving_thread_name():
    return threading.current_thread().name


@served_on_the_pool
def where_requests_ran():
    """The counts of ``_get_debug_info`` that say where this worker's requests ran (this
    request already counted on the pool)."""
    info = rpc.api._get_debug_info()
    return {k: info[k] for k in ("requests_run_inline", "requests_run_on_pool")} | {
        "handoffs": info["progress_handoffs"]
    }


_BUSY_CORE = contextlib.ExitStack()
_BUSY_CORE_STOPPED = threading.Event()


@served_on_the_pool
def share_progress_threads_core_with_a_busy_process():
    """Pins this worker's progress threads to one core beside a process that computes all
    along (before they run anything measured: a move to another core makes a thread wait)."""
    core = _BUSY_CORE.enter_context(busy_core())
    threads = [t.native_id for t in threading.enumerate() if t.name == "distgrad-progress"]
    _BUSY_CORE.enter_context(pinned(threads, core))


@served_on_the_pool
def stop_busy_process():
    _BUSY_CORE.close()
    _BUSY_CORE_STOPPED.set()


def preempted_past_the_budget():
    """Waits for a core, and for nothing else, past the inline budget; the thread's name."""
    preempted_for(3 * BUDGET_S)
    return threading.current_thread().name


def compute_until_released(key):
    """Keeps the thread that serves it computing (holding the GIL most of the time) until a
    later request runs ``release(key)``; its thread's name, and whether it was released."""
    released = _RELEASES.setdefault(key, threading.Event())
    end = time.monotonic() + RELEASE_TIMEOUT_S
    while not released.is_set() and time.monotonic() < end:
        sum(range(1000))
    return threading.current_thread().name, released.is_set()


def released_by_a_later_request(peer, fn, key):
    """Sends ``fn(key)`` to ``peer``, waits until it runs there, then releases it with a
    second request: ``fn``'s answer, and the peer's counts of where requests ran before and
    after."""
    before = rpc.rpc_sync(peer, where_requests_ran)
    pending = rpc.rpc_async(peer, fn, (key,))
    assert wait_until(lambda: rpc.rpc_sync(peer, is_waiting, (key,)))
    rpc.rpc_sync(peer, release, (key,))
    answer = pending.wait()
    return answer, before, rpc.rpc_sync(peer, where_requests_ran)


def thread_name_after_rpc_back(to, x):
    """The thread that ran this request, and the answer of a nested RPC it waited for."""
    return threading.current_thread().name, rpc.rpc_sync(to, torch.add, (x, 1))


@rpc.functions.async_execution
def async_add(to, x, y):
    return rpc.rpc_async(to, torch.add, (x, y)).then(lambda fut: fut.wait() + 1)


@rpc.functions.async_execution
def async_chain(first, second, x):
    """Two nested async RPCs chained without tying up a worker thread."""
    fut = rpc.rpc_async(first, torch.add, (x, 1))
    return fut.then(lambda f: rpc.rpc_sync(second, torch.add, (f.wait(), 10)))


@rpc.functions.async_execution
def async_fanout(names, x):
    futs = [rpc.rpc_async(n, torch.add, (x, 1)) for n in names]
    return torch.futures.collect_all(futs).then(lambda f: sum(g.wait() for g in f.wait()))


@rpc.functions.async_execution
def async_not_a_future():
    return 3


class Counter:
    """A class used remotely: constructor, methods and a static method."""

    def __init__(self, start):
        self.value = start

    def add(self, n):
        self.value += n
        return self.value

    @staticmethod
    def double(x):
        return 2 * x

    @classmethod
    def make(cls, start):
        return cls(start)


# ---------------------------------------------------------------------------
# Worker identity


def test_default_worker_names_and_ids_come_from_mpi(rpc_world):
    me = rpc.get_worker_info()
    assert me == WorkerInfo(f"worker{rpc_world.rank}", rpc_world.rank)
    assert (me.name, me.id) == (rpc_world.name, rpc_world.rank)
    for rank, name in enumerate(rpc_world.names):
        info = rpc.get_worker_info(name)
        assert (info.name, info.id) == (name, rank)


def test_worker_info_equality_hash_and_repr():
    a, b = WorkerInfo("worker1", 1), WorkerInfo("worker1", 1)
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a != WorkerInfo("worker1", 2) and a != WorkerInfo("worker2", 1)
    assert repr(a) == "WorkerInfo(id=1, name=worker1)"


def test_worker_info_round_trips_through_rpc(rpc_world):
    peer = rpc.get_worker_info(rpc_world.peer())
    assert rpc.rpc_sync(peer, whoami) == peer
    mine = rpc.get_worker_info()
    assert rpc.rpc_sync(peer, echo, (mine,)) == mine


def test_destination_may_be_name_rank_or_worker_info(rpc_world):
    peer_rank = rpc_world.peer_rank()
    x = torch.arange(4.0)
    for to in (rpc_world.peer(), peer_rank, rpc.get_worker_info(rpc_world.peer())):
        assert torch.equal(rpc.rpc_sync(to, torch.add, (x, 1)), x + 1)
        assert rpc.rpc_sync(to, whoami).id == peer_rank
        assert torch.equal(rpc.rpc_async(to, torch.add, (x, 2)).wait(), x + 2)
        assert torch.equal(rpc.remote(to, torch.add, (x, 3)).to_here(), x + 3)


# ---------------------------------------------------------------------------
# Calls


def test_builtin_torch_op_runs_remotely(rpc_world):
    a, b = torch.ones(2, 3), torch.full((2, 3), 2.0)
    assert torch.equal(rpc.rpc_sync(rpc_world.peer(), torch.add, (a, b)), a + b)
    assert torch.equal(rpc.rpc_sync(rpc_world.peer(), torch.add, (a, 3)), a + 3)
    assert torch.equal(rpc.rpc_sync(rpc_world.peer(), torch.matmul, (a, b.t())), a @ b.t())
    assert rpc.rpc_sync(
        rpc_world.peer(), torch.nonzero, (torch.tensor([0, 1, 0, 1]),)
    ).tolist() == [[1], [3]]


def test_python_builtin_and_user_function_with_kwargs(rpc_world):
    assert rpc.rpc_sync(rpc_world.peer(), builtins.min, (4, 2, 7)) == 2
    assert rpc.rpc_sync(rpc_world.peer(), add_kwargs, (1,), {"y": 2, "z": 3}) == 6
    assert rpc.rpc_sync(rpc_world.peer(), add_kwargs, kwargs={"x": 1, "z": 5}) == 6


def test_function_without_return_value_gives_none(rpc_world):
    assert rpc.rpc_sync(rpc_world.peer(), nothing) is None
    assert rpc.rpc_async(rpc_world.peer(), nothing).wait() is None


def test_class_constructor_static_and_class_methods(rpc_world):
    obj = rpc.rpc_sync(rpc_world.peer(), Counter, (5,))
    assert isinstance(obj, Counter) and obj.value == 5
    assert rpc.rpc_sync(rpc_world.peer(), Counter.double, (21,)) == 42
    assert rpc.rpc_sync(rpc_world.peer(), Counter.make, (7,)).value == 7


def test_rpc_async_returns_torch_future_with_working_then(rpc_world):
    fut = rpc.rpc_async(rpc_world.peer(), torch.add, (torch.ones(2), 1))
    assert isinstance(fut, torch.futures.Future)
    chained = fut.then(lambda f: f.wait() * 10)
    assert torch.equal(chained.wait(), torch.full((2,), 20.0))
    assert torch.equal(fut.wait(), torch.full((2,), 2.0))  # waiting twice is fine
    done = threading.Event()
    fut.add_done_callback(lambda f: done.set())
    assert done.wait(scaled(10))


def test_a_then_callback_may_wait_for_another_rpc_async(rpc_world):
    """The callback runs on the agent's callback thread; the future it waits for completes
    on that thread too (wait() drives progress), not behind the callback itself."""
    x = torch.ones(2)
    peer = rpc_world.peer()
    fut = rpc.rpc_async(peer, torch.add, (x, 1)).then(
        lambda f: rpc.rpc_async(peer, torch.add, (f.wait(), 1)).wait()
    )
    assert torch.equal(fut.wait(), x + 2)


def test_waiting_on_an_rpc_async_whose_callback_makes_an_rpc(rpc_world):
    """wait() drives progress; the future completes (and its callbacks run) only after
    the waiting thread stopped driving, so a callback that waits for an RPC of its own
    can drive in turn (run inside the delivery, it would wait forever)."""
    x = torch.ones(2)
    peer = rpc_world.peer()
    for _ in range(20):  # the callback is registered before or after the response
        fut = rpc.rpc_async(peer, torch.add, (x, 1))
        chained = fut.then(lambda f: rpc.rpc_sync(peer, torch.add, (f.wait(), 1)))
        assert torch.equal(fut.wait(), x + 1)
        assert torch.equal(chained.wait(), x + 2)


def test_many_rpc_async_collected_together(rpc_world):
    futs = [
        rpc.rpc_async(rpc_world.names[i % rpc_world.size], torch.add, (torch.ones(3), i))
        for i in range(50)
    ]
    results = torch.futures.wait_all(futs)
    for i, r in enumerate(results):
        assert torch.equal(r, torch.full((3,), 1.0 + i))


def test_rpc_to_self(rpc_world):
    me = rpc_world.name
    x = torch.arange(3.0)
    assert torch.equal(rpc.rpc_sync(me, torch.add, (x, 1)), x + 1)
    assert torch.equal(rpc.rpc_sync(rpc_world.rank, torch.add, (x, 1)), x + 1)
    assert rpc.rpc_sync(me, whoami) == rpc.get_worker_info()
    assert torch.equal(rpc.rpc_async(me, torch.mul, (x, 2)).wait(), x * 2)
    rref = rpc.remote(me, torch.mul, (x, 3))
    assert rref.is_owner()
    assert torch.equal(rref.to_here(), x * 3)
    assert torch.equal(rref.local_value(), x * 3)


# ---------------------------------------------------------------------------
# Nesting


def test_nested_rpc_from_inside_remote_function(rpc_world):
    x = torch.ones(2)
    # The peer calls back into this worker while this worker waits for it.
    assert torch.equal(rpc.rpc_sync(rpc_world.peer(), rpc_back, (rpc_world.name, x)), x + 1)
    third = rpc_world.peer(2)  # itself on 2 ranks
    assert torch.equal(rpc.rpc_sync(rpc_world.peer(), rpc_back, (third, x)), x + 1)
    assert torch.equal(rpc.rpc_sync(rpc_world.peer(), nested_remote, (third, x)), x * 2)


def test_a_short_request_runs_where_it_is_delivered(rpc_world):
    """The peer's main thread waits in a barrier, polling nothing: its progress thread
    delivers the request and, the function being short, runs it there (no hand-off)."""
    if rpc_world.rank == 0:
        assert rpc.rpc_sync(rpc_world.peer(), serving_thread_name) == "distgrad-progress"


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs CPU affinity (Linux)")
def test_a_request_preempted_past_the_budget_still_runs_where_it_is_delivered(rpc_world):
    """On a crowded core an inline run may wait for the core past the budget; its function
    did nothing long, so its next requests run inline too (not on the pool)."""
    if rpc_world.rank == 0:
        peer = rpc_world.peer()
        before = rpc.rpc_sync(peer, where_requests_ran)
        rpc.rpc_sync(peer, share_progress_threads_core_with_a_busy_process)
        try:
            names = [rpc.rpc_sync(peer, preempted_past_the_budget) for _ in range(3)]
        finally:
            rpc.rpc_sync(peer, stop_busy_process)
        after = rpc.rpc_sync(peer, where_requests_ran)
        assert names == ["distgrad-progress"] * 3, names
        # Only the helpers, which run on the pool by design: the 3 requests ran inline.
        assert after["requests_run_inline"] - before["requests_run_inline"] == 3, (before, after)
    elif rpc_world.rank == 1:
        # The served rank's main thread waits without taking the GIL meanwhile (a barrier
        # would take it between its tests): a preempted run must not then wait for the GIL.
        assert _BUSY_CORE_STOPPED.wait(scaled(60.0))


def test_a_request_that_waits_hands_the_receiving_over_and_its_next_ones_run_on_the_pool(
    rpc_world,
):
    """A request waiting for a nested RPC first leaves the progress role to another thread
    of its worker (which receives the nested call's answer); the same function's next two
    requests run on the worker pool, the one after that on the progress thread again."""
    if rpc_world.rank == 0:
        peer, x = rpc_world.peer(), torch.ones(2)
        before = rpc.rpc_sync(peer, where_requests_ran)
        names = []
        for _ in range(4):
            name, answer = rpc.rpc_sync(peer, thread_name_after_rpc_back, (rpc_world.name, x))
            assert torch.equal(answer, x + 1)
            names.append(name)
        after = rpc.rpc_sync(peer, where_requests_ran)
        assert names[0] == names[3] == "distgrad-progress", names
        assert names[1].startswith("distgrad-worker") and names[2].startswith("distgrad-worker")
        # The first and the fourth each handed the role over once; on a crowded machine the
        # standby may also take it from an inline run that waited for the GIL (WATCH_S).
        assert after["handoffs"] - before["handoffs"] >= 2, (before, after)
        # The second and third, and the request that read ``after``.
        assert after["requests_run_on_pool"] - before["requests_run_on_pool"] == 3


def test_a_long_computation_leaves_the_receiving_to_another_thread(rpc_world):
    """A request that computes where it was delivered, without waiting for anything: after
    some milliseconds another thread of its worker takes over the progress role and serves
    the second request, which ends the computation."""
    if rpc_world.rank == 0:
        answer, before, after = released_by_a_later_request(
            rpc_world.peer(), compute_until_released, "computing"
        )
        assert answer == ("distgrad-progress", True), "not released while it computed"
        # At least once: while the computation holds the GIL, the new holder's own short runs
        # wait for the GIL too, and the standby may take the role from one of them in turn.
        assert after["handoffs"] - before["handoffs"] >= 1, (before, after)


def test_a_request_may_block_until_a_later_request_releases_it(rpc_world):
    """The first request blocks where it runs (on the progress thread that delivered it,
    a function's first request runs there), not on an RPC: after a few milliseconds another
    thread of its worker takes over the progress role, receives the second request, which
    releases the first."""
    if rpc_world.rank == 0:
        answer, before, after = released_by_a_later_request(
            rpc_world.peer(), wait_for_release, "first"
        )
        assert answer is True, "the releasing request was not served in time"
        # Once at least (a crowded machine may add takeovers, see above).
        assert after["handoffs"] - before["handoffs"] >= 1, (before, after)


def test_nested_rpc_chain_through_every_worker(rpc_world):
    path = [rpc_world.peer(k) for k in range(1, 2 * rpc_world.size + 1)]
    assert rpc.rpc_sync(path[0], chain, (path[1:], 0)) == len(path) - 1


def test_async_execution_answers_when_its_future_completes(rpc_world):
    x = torch.ones(2)
    out = rpc.rpc_sync(rpc_world.peer(), async_add, (rpc_world.name, x, 2))
    assert torch.equal(out, x + 3)
    out = rpc.rpc_async(rpc_world.peer(), async_chain, (rpc_world.peer(2), rpc_world.name, x))
    assert torch.equal(out.wait(), x + 11)
    assert torch.equal(
        rpc.remote(rpc_world.peer(), async_add, (rpc_world.peer(2), x, 1)).to_here(), x + 2
    )
    out = rpc.rpc_sync(rpc_world.peer(), async_fanout, (rpc_world.names, x))
    assert torch.equal(out, (x + 1) * rpc_world.size)


def test_async_execution_keeps_wrapped_function():
    assert async_add._wrapped_async_rpc_function is not None
    assert async_add.__name__ == "async_add"


def test_async_execution_without_future_raises_runtime_error(rpc_world):
    # torch's type and text, whichever way the function is called.
    wrong = "Functions decorated with @rpc.async_function must return a torch.futures.Future"
    with pytest.raises(RuntimeError, match=wrong):
        rpc.rpc_sync(rpc_world.peer(), async_not_a_future)
    with pytest.raises(RuntimeError, match=wrong):
        rpc.rpc_async(rpc_world.peer(), async_not_a_future).wait()
    rref = rpc.remote(rpc_world.peer(), async_not_a_future)
    with pytest.raises(RuntimeError, match=wrong):
        rref.to_here()
    with pytest.raises(RuntimeError, match=wrong):
        rpc.remote(rpc_world.name, async_not_a_future).to_here()  # owned here
    assert rpc.rpc_sync(rpc_world.peer(), builtins.max, (1, 2)) == 2


# ---------------------------------------------------------------------------
# Timeouts and re-initialisation


def test_default_timeout_is_60s_and_settable(rpc_world):
    assert rpc.get_rpc_timeout() == 60.0
    try:
        rpc._set_rpc_timeout(12.5)
        assert rpc.get_rpc_timeout() == 12.5
        assert rpc.rpc_sync(rpc_world.peer(), builtins.abs, (-3,)) == 3
    finally:
        rpc._set_rpc_timeout(60.0)
    assert rpc.get_rpc_timeout() == 60.0


def test_explicit_and_zero_timeouts_allow_quick_calls(rpc_world):
    assert rpc.rpc_sync(rpc_world.peer(), builtins.abs, (-3,), timeout=0) == 3
    assert rpc.rpc_async(rpc_world.peer(), builtins.abs, (-4,), timeout=5).wait() == 4
    assert rpc.remote(rpc_world.peer(), builtins.abs, (-5,), timeout=0).to_here() == 5


def test_second_init_rpc_raises_and_agent_keeps_working(rpc_world):
    with pytest.raises(RuntimeError, match="RPC is already initialized"):
        rpc.init_rpc()
    with pytest.raises(RuntimeError, match="RPC is already initialized"):
        rpc.init_rpc(name=rpc_world.name, rank=rpc_world.rank, world_size=rpc_world.size)
    assert rpc.rpc_sync(rpc_world.peer(), builtins.abs, (-1,)) == 1


def test_debug_info_counts_traffic_per_peer(rpc_world):
    """``_get_debug_info`` merges RRef, agent and autograd figures, with per-peer traffic."""
    peer = rpc_world.peer()
    before = rpc.api._get_debug_info()
    assert {
        "num_owner_rrefs",
        "num_pending_requests",
        "handler_queue_depth",
        "num_handlers_running",
        "num_autograd_contexts",
        "peers",
    } <= set(before)
    assert set(before["peers"]) == set(rpc_world.names)
    payload = torch.zeros(100_000, dtype=torch.uint8)  # sent as a buffer, not inline
    for _ in range(3):
        rpc.rpc_sync(peer, torch.add, (payload, 1))
    after = rpc.api._get_debug_info()["peers"][peer]
    was = before["peers"][peer]
    assert after["messages_sent"] >= was["messages_sent"] + 3
    assert after["bytes_sent"] >= was["bytes_sent"] + 3 * payload.nbytes
    assert after["messages_received"] >= was["messages_received"] + 3
    assert after["bytes_received"] >= was["bytes_received"] + 3 * payload.nbytes
    assert rpc.api._get_debug_info()["num_pending_requests"] == 0
