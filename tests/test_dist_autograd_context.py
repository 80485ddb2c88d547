"""Distributed autograd contexts: ids, lookup, release (local and remote) and graph recording.

Torch's ``dist_autograd_test.py`` context and graph tests, ported. Every rank
runs each test at once and calls its ring neighbours; what a callee recorded is
checked on the callee, after an allgather of the callers' context ids, while
the callers still hold their contexts open.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from _dist_utils import (
    assert_contexts_released,
    debug_info,
    exchange,
    has_context,
    my_py_add,
    my_py_nested_call,
    my_scalar_add,
    torch_ones,
    wait_for_no_contexts,
)
from _timing import scaled

import lightning_distgrad.autograd as dist_autograd
from lightning_distgrad import rpc

pytestmark = pytest.mark.mpi(min_size=2)

MASK = (1 << 48) - 1


def _is_leaf_of(node, tensor) -> bool:
    return hasattr(node, "variable") and node.variable is tensor


def _sorted_values(d: dict) -> list:
    return [d[k] for k in sorted(d)]


# ---------------------------------------------------------------------------
# Ids and lookup


def test_autograd_context_ids_and_lookup(rpc_world):
    rank = rpc_world.rank
    assert dist_autograd._get_max_id() == (1 << 48) - 1 + (rank << 48)
    assert dist_autograd.is_available()
    ids = []
    for _ in range(200):
        with dist_autograd.context() as context_id:
            assert isinstance(context_id, int)
            assert context_id >> 48 == rank
            assert context_id & MASK <= MASK
            assert dist_autograd._retrieve_context(context_id)._context_id() == context_id
            assert dist_autograd._current_context()._context_id() == context_id
            assert dist_autograd._is_valid_context(context_id) is None
            ids.append(context_id)
        # released at exit: every lookup fails with torch's text
        msg = f"Could not find autograd context with id: {context_id}"
        with pytest.raises(RuntimeError, match=msg):
            dist_autograd._retrieve_context(context_id)
        with pytest.raises(RuntimeError, match=msg):
            dist_autograd._is_valid_context(context_id)
        with pytest.raises(RuntimeError, match=msg):
            dist_autograd.get_gradients(context_id)
        with pytest.raises(RuntimeError, match=msg):
            dist_autograd._release_context(context_id)
        with pytest.raises(
            RuntimeError, match="Current thread doesn't have a valid autograd context"
        ):
            dist_autograd._current_context()
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    # ids of different workers never collide
    everyone = exchange(rpc_world, ids)
    assert len({i for worker_ids in everyone for i in worker_ids}) == 200 * rpc_world.size


def test_new_and_release_context_by_hand(rpc_world):
    ctx = dist_autograd._new_context()
    context_id = ctx._context_id()
    assert dist_autograd._current_context() is dist_autograd._retrieve_context(context_id)
    with pytest.raises(RuntimeError, match="Already have an autograd context id for this thread"):
        dist_autograd._new_context()
    dist_autograd._release_context(context_id)
    assert not has_context(context_id)
    with pytest.raises(RuntimeError, match="Current thread doesn't have a valid autograd context"):
        dist_autograd._current_context()
    # the thread can open a new context afterwards
    with dist_autograd.context() as second:
        assert second > context_id


def test_nested_context_raises_and_outer_stays_usable(rpc_world):
    t1 = torch.ones(3, 3, requires_grad=True)
    with dist_autograd.context() as context_id:
        with pytest.raises(
            RuntimeError, match="Already have an autograd context id for this thread"
        ):
            with dist_autograd.context():
                pass
        assert dist_autograd._current_context()._context_id() == context_id
        loss = rpc.rpc_sync(rpc_world.peer(), torch.add, (t1, 1)).sum()
        dist_autograd.backward(context_id, [loss])
        torch.testing.assert_close(dist_autograd.get_gradients(context_id)[t1], torch.ones(3, 3))


def test_release_of_a_context_owned_by_another_thread(rpc_world):
    """``_release_context`` works from any thread; only the owner's current id is reset."""
    box = {}

    def make():
        box["id"] = dist_autograd._new_context()._context_id()

    thread = threading.Thread(target=make)
    thread.start()
    thread.join(scaled(30))
    assert has_context(box["id"])
    with dist_autograd.context() as mine:
        dist_autograd._release_context(box["id"])
        assert not has_context(box["id"])
        assert dist_autograd._current_context()._context_id() == mine


def test_debug_info_keys_and_counts(rpc_world):
    info = wait_for_no_contexts(rpc_world)
    assert set(info) == {"num_current_backward_passes", "num_autograd_contexts"}
    assert info == {"num_current_backward_passes": 0, "num_autograd_contexts": 0}
    t1 = torch.rand(3, 3, requires_grad=True)
    with dist_autograd.context() as context_id:
        assert debug_info()["num_autograd_contexts"] >= 1
        loss = t1
        for d in range(1, rpc_world.size):
            loss = rpc.rpc_sync(rpc_world.peer(d), torch.add, (loss, 1))
        ids = exchange(rpc_world, context_id)
        # this worker's context plus the one of every other rank (all reached it)
        assert debug_info()["num_autograd_contexts"] == rpc_world.size
        dist_autograd.backward(context_id, [loss.sum()])
        rpc_world.barrier()
        assert debug_info() == {
            "num_current_backward_passes": 0,
            "num_autograd_contexts": rpc_world.size,
        }
        rpc_world.barrier()  # nobody releases before everyone has counted
    assert_contexts_released(rpc_world, ids)
    assert debug_info() == {"num_current_backward_passes": 0, "num_autograd_contexts": 0}


# ---------------------------------------------------------------------------
# Graph structure


def _verify_first_rpc_call(ctx, t1, t2, ret, rank: int, peer_rank: int) -> None:
    """Caller: 1 send over AccumulateGrad(t1), AccumulateGrad(t2); 1 recv that is ret.grad_fn."""
    sends, recvs = ctx._send_functions(), ctx._recv_functions()
    assert len(sends) == 1 and len(recvs) == 1
    (send_id, send), (recv_id, recv) = next(iter(sends.items())), next(iter(recvs.items()))
    assert send_id >> 48 == rank, "a message id carries its sender's worker id"
    assert recv_id >> 48 == peer_rank, "a message id carries its sender's worker id"
    nf = send.next_functions
    assert len(nf) == 2
    assert _is_leaf_of(nf[0][0], t1) and nf[0][1] == 0
    assert _is_leaf_of(nf[1][0], t2) and nf[1][1] == 0
    assert recv is ret.grad_fn
    assert ctx._known_worker_ids() == {peer_rank}


def _verify_rpc_call_exec(send) -> None:
    """Callee of an add: send -> AddBackward0 -> two edges to one recv node."""
    nf = send.next_functions
    assert len(nf) == 1
    add = nf[0][0]
    assert add.name() == "AddBackward0"
    add_nf = add.next_functions
    assert len(add_nf) == 2
    assert add_nf[0][0] is add_nf[1][0]
    return add_nf[0][0]


def _graph_for_call(world, call) -> None:
    t1 = torch.ones(3, 3, requires_grad=True)
    t2 = torch.zeros(3, 3, requires_grad=True)
    peer_rank, prev_rank = world.peer_rank(1), world.peer_rank(-1)
    with dist_autograd.context() as context_id:
        ret = call(world.peer(), t1, t2)
        torch.testing.assert_close(ret, t1 + t2)
        _verify_first_rpc_call(dist_autograd._current_context(), t1, t2, ret, world.rank, peer_rank)
        ids = exchange(world, context_id)
        # the context of the rank before us, as this callee recorded it
        ctx = dist_autograd._retrieve_context(ids[prev_rank])
        sends, recvs = ctx._send_functions(), ctx._recv_functions()
        assert len(sends) == 1 and len(recvs) == 1
        (send_id, send), (recv_id, recv) = next(iter(sends.items())), next(iter(recvs.items()))
        assert send_id >> 48 == world.rank and recv_id >> 48 == prev_rank
        assert _verify_rpc_call_exec(send) is recv
        assert ctx._known_worker_ids() == {prev_rank}
        world.barrier()
    for context in (
        lambda: dist_autograd._retrieve_context(context_id),
        dist_autograd._current_context,
    ):
        with pytest.raises(RuntimeError):
            context()
    assert_contexts_released(world, ids)


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda to, a, b: rpc.rpc_sync(to, torch.add, (a, b)), id="builtin_rpc_sync"),
        pytest.param(lambda to, a, b: rpc.rpc_sync(to, my_py_add, (a, b)), id="python_rpc_sync"),
        pytest.param(
            lambda to, a, b: rpc.rpc_async(to, torch.add, (a, b)).wait(), id="builtin_rpc_async"
        ),
        pytest.param(
            lambda to, a, b: rpc.remote(to, torch.add, (a, b)).to_here(), id="builtin_remote"
        ),
        pytest.param(
            lambda to, a, b: rpc.remote(to, my_py_add, (a, b)).to_here(), id="python_remote"
        ),
    ],
)
def test_graph_for_call(rpc_world, call):
    _graph_for_call(rpc_world, call)


def _verify_forwarder(ctx, prev_rank: int, next_rank: int) -> None:
    """A hop that only forwards: 2 sends, the first with 2 edges to one recv, the
    second (the response) with 1 edge to the other recv."""
    sends, recvs = ctx._send_functions(), ctx._recv_functions()
    assert len(sends) == 2 and len(recvs) == 2
    first, second = _sorted_values(sends)
    recv_ids = sorted(recvs)
    in_recv = recvs[[i for i in recv_ids if i >> 48 == prev_rank][0]]
    back_recv = recvs[[i for i in recv_ids if i >> 48 == next_rank][-1]]
    assert len(first.next_functions) == 2
    assert first.next_functions[0][0] is in_recv and first.next_functions[1][0] is in_recv
    assert len(second.next_functions) == 1 and second.next_functions[0][0] is back_recv
    assert ctx._known_worker_ids() == {prev_rank, next_rank}


@pytest.mark.mpi(min_size=4)
def test_graph_for_py_nested_call(rpc_world):
    """rank -> rank+1 -> rank+2 -> rank+3 (runs the add): four graphs on four workers."""
    world = rpc_world
    t1 = torch.ones(3, 3, requires_grad=True)
    t2 = torch.zeros(3, 3, requires_grad=True)
    with dist_autograd.context() as context_id:
        path = [world.peer(2), world.peer(3)]
        ret = rpc.rpc_sync(world.peer(1), my_py_nested_call, (t1, t2, path))
        torch.testing.assert_close(ret, t1 + t2)
        _verify_first_rpc_call(
            dist_autograd._current_context(), t1, t2, ret, world.rank, world.peer_rank(1)
        )
        ids = exchange(world, context_id)
        # first forwarder for rank-1, second forwarder for rank-2, executor for rank-3
        r1, r2, r3 = world.peer_rank(-1), world.peer_rank(-2), world.peer_rank(-3)
        _verify_forwarder(dist_autograd._retrieve_context(ids[r1]), r1, world.peer_rank(1))
        _verify_forwarder(dist_autograd._retrieve_context(ids[r2]), r1, world.peer_rank(1))
        ctx = dist_autograd._retrieve_context(ids[r3])
        sends, recvs = ctx._send_functions(), ctx._recv_functions()
        assert len(sends) == 1 and len(recvs) == 1
        assert _verify_rpc_call_exec(next(iter(sends.values()))) is next(iter(recvs.values()))
        assert ctx._known_worker_ids() == {r1}
        world.barrier()
    assert_contexts_released(world, ids)


def test_graph_for_py_nested_call_itself(rpc_world):
    """rank -> rank+1 -> back to rank, which runs the add: 2 sends and 2 recvs here."""
    world = rpc_world
    t1 = torch.ones(3, 3, requires_grad=True)
    t2 = torch.zeros(3, 3, requires_grad=True)
    with dist_autograd.context() as context_id:
        ret = rpc.rpc_sync(world.peer(1), my_py_nested_call, (t1, t2, [world.name]))
        torch.testing.assert_close(ret, t1 + t2)
        ctx = dist_autograd._current_context()
        sends, recvs = ctx._send_functions(), ctx._recv_functions()
        assert len(sends) == 2 and len(recvs) == 2
        first_send, exec_send = _sorted_values(sends)
        # insertion order: the forwarded (t1, t2) arrive before the final result
        in_recv, ret_recv = list(recvs.values())
        assert ret_recv is ret.grad_fn
        assert _is_leaf_of(first_send.next_functions[0][0], t1)
        assert _is_leaf_of(first_send.next_functions[1][0], t2)
        assert _verify_rpc_call_exec(exec_send) is in_recv
        assert ctx._known_worker_ids() == {world.peer_rank(1)}
        ids = exchange(world, context_id)
        prev = world.peer_rank(-1)
        _verify_forwarder(dist_autograd._retrieve_context(ids[prev]), prev, prev)
        world.barrier()
    assert_contexts_released(world, ids)


@pytest.mark.parametrize("remote", [False, True], ids=["rpc_sync", "remote"])
def test_no_graph_with_tensors_not_require_grad(rpc_world, remote):
    """Builtins on tensors without grad carry no context at all: nothing is recorded."""
    world = rpc_world
    t1, t2 = torch.ones(3, 3), torch.zeros(3, 3)
    with dist_autograd.context() as context_id:
        if remote:
            ret = rpc.remote(world.peer(), torch.add, (t1, t2)).to_here()
        else:
            ret = rpc.rpc_sync(world.peer(), torch.add, (t1, t2))
        assert not ret.requires_grad and ret.grad_fn is None
        ctx = dist_autograd._current_context()
        assert len(ctx._send_functions()) == 0
        assert len(ctx._recv_functions()) == 0
        ids = exchange(world, context_id)
        prev = dist_autograd._retrieve_context(ids[world.peer_rank(-1)]) if remote else None
        if remote:  # to_here() always carries the context, but records nothing here
            assert len(prev._send_functions()) == 0 and len(prev._recv_functions()) == 0
        else:  # the callee never heard of the context
            assert not has_context(ids[world.peer_rank(-1)])
        world.barrier()
    assert_contexts_released(world, ids)


def test_python_udf_without_grad_carries_context_but_records_nothing(rpc_world):
    world = rpc_world
    t1, t2 = torch.ones(3, 3), torch.zeros(3, 3)
    with dist_autograd.context() as context_id:
        ret = rpc.rpc_sync(world.peer(), my_py_add, (t1, t2))
        assert not ret.requires_grad
        ctx = dist_autograd._current_context()
        assert len(ctx._send_functions()) == 0 and len(ctx._recv_functions()) == 0
        assert ctx._known_worker_ids() == {world.peer_rank()}
        ids = exchange(world, context_id)
        callee = dist_autograd._retrieve_context(ids[world.peer_rank(-1)])
        assert len(callee._send_functions()) == 0 and len(callee._recv_functions()) == 0
        world.barrier()
    assert_contexts_released(world, ids)


def test_nothing_recorded_under_no_grad(rpc_world):
    t1 = torch.ones(3, 3, requires_grad=True)
    with dist_autograd.context():
        with torch.no_grad():
            ret = rpc.rpc_sync(rpc_world.peer(), torch.add, (t1, 1))
        assert not ret.requires_grad
        ctx = dist_autograd._current_context()
        assert len(ctx._send_functions()) == 0 and len(ctx._recv_functions()) == 0


def switch_grad_off() -> bool:
    """A careless remote function: leaves grad mode off on the thread it ran on."""
    torch.set_grad_enabled(False)
    return True


def test_grad_mode_left_off_by_a_remote_function_does_not_leak(rpc_world):
    # Enough calls to visit every pool thread of the peer.
    for _ in range(4 * 16):
        rpc.rpc_sync(rpc_world.peer(), switch_grad_off)
    t1 = torch.ones(3, 3, requires_grad=True)
    with dist_autograd.context() as context_id:
        loss = 0
        for func in (my_py_add, torch.add):  # pool thread, and inline for small operators
            ret = rpc.rpc_sync(rpc_world.peer(), func, (t1, t1))
            assert ret.requires_grad, func
            loss = loss + ret.sum()
        dist_autograd.backward(context_id, [loss])
        assert torch.equal(dist_autograd.get_gradients(context_id)[t1], torch.full((3, 3), 4.0))
    rpc_world.barrier()


def test_requests_served_while_the_callee_waits_under_no_grad_record(rpc_world):
    """A thread waiting inside torch.no_grad() may hand over other ranks' requests
    itself; they still run with grad mode on (a 4-rank CI failure)."""

    def call_with_grad() -> torch.Tensor:
        t1 = torch.ones(2, requires_grad=True)
        with dist_autograd.context() as context_id:
            results = [rpc.rpc_sync(rpc_world.peer(-1), torch.mul, (t1, 2)) for _ in range(50)]
            lost = sum(not r.requires_grad for r in results)
            assert lost == 0, f"{lost} of 50 results lost their recv function"
            dist_autograd.backward(context_id, [torch.stack(results).sum()])
            return dist_autograd.get_gradients(context_id)[t1]

    with ThreadPoolExecutor(1) as pool:
        caller = pool.submit(call_with_grad)
        with torch.no_grad():
            while not caller.done():
                rpc.rpc_sync(rpc_world.peer(), time.sleep, (0.01,))
    rpc_world.barrier()
    assert torch.equal(caller.result(), torch.full((2,), 100.0))


@pytest.mark.parametrize("mode", ["inference_mode", "autocast"])
def test_requests_served_by_a_thread_in_inference_or_autocast_mode_are_unaffected(rpc_world, mode):
    """Thread-local modes of the thread that hands frames over do not reach the requests it
    serves nor the responses it records (torch's server threads start in default modes)."""
    a = torch.ones(4, 4, requires_grad=True)

    def call_with_grad() -> torch.Tensor:
        with dist_autograd.context() as context_id:
            results = [rpc.rpc_sync(rpc_world.peer(-1), torch.mm, (a, a)) for _ in range(50)]
            kinds = {(r.dtype, r.requires_grad) for r in results}
            assert kinds == {(torch.float32, True)}, kinds
            dist_autograd.backward(context_id, [torch.stack(results).sum()])
            return dist_autograd.get_gradients(context_id)[a]

    modal = (
        torch.inference_mode()
        if mode == "inference_mode"
        else torch.autocast("cpu", dtype=torch.bfloat16)
    )
    with ThreadPoolExecutor(1) as pool:
        caller = pool.submit(call_with_grad)
        with modal:
            while not caller.done():
                rpc.rpc_sync(rpc_world.peer(), time.sleep, (0.01,))
    rpc_world.barrier()
    assert torch.equal(caller.result(), torch.full((4, 4), 50 * 2 * 4.0))


def test_nothing_recorded_outside_a_context(rpc_world):
    t1 = torch.ones(3, 3, requires_grad=True)
    ret = rpc.rpc_sync(rpc_world.peer(), torch.add, (t1, 1))
    # without a context the result is a plain tensor: no recv node
    assert not ret.requires_grad
    wait_for_no_contexts(rpc_world)


def test_rpc_complex_args(rpc_world):
    world = rpc_world
    tensors = [torch.ones(3, 3) * i for i in range(10)]
    for i in range(0, 10, 2):
        tensors[i].requires_grad_(True)
    with dist_autograd.context():
        ret = rpc.rpc_sync(world.peer(), torch.stack, (tensors,))
        torch.testing.assert_close(ret, torch.stack(tensors))
        ctx = dist_autograd._current_context()
        sends = ctx._send_functions()
        assert len(sends) == 1
        nf = next(iter(sends.values())).next_functions
        assert len(nf) == 5
        for k, (node, _) in enumerate(nf):
            assert _is_leaf_of(node, tensors[2 * k])
        assert ret.grad_fn is next(iter(ctx._recv_functions().values()))
        assert ctx._known_worker_ids() == {world.peer_rank()}


def test_worker_ids_recorded(rpc_world):
    world = rpc_world
    others = {r for r in range(world.size) if r != world.rank}
    with dist_autograd.context():
        # no tensor requires grad, but Python UDFs still carry the context
        for r in others:
            rpc.rpc_sync(world.names[r], my_py_add, (torch.ones(2), torch.ones(2)))
        ctx = dist_autograd._current_context()
        assert ctx._known_worker_ids() == others
        assert len(ctx._send_functions()) == 0
    with dist_autograd.context():
        t1 = torch.ones(2, requires_grad=True)
        for r in others:
            rpc.rpc_sync(world.names[r], torch.add, (t1, 1))
        ctx = dist_autograd._current_context()
        assert ctx._known_worker_ids() == others
        assert len(ctx._send_functions()) == len(others)


def test_error_in_context(rpc_world):
    with dist_autograd.context() as context_id:
        t1 = torch.rand(3, 3, requires_grad=True)
        t2 = torch.rand(6, 6, requires_grad=True)
        with pytest.raises(RuntimeError):
            rpc.rpc_sync(rpc_world.peer(), torch.matmul, (t1, t2))
    assert not has_context(context_id)


# ---------------------------------------------------------------------------
# Cleanup on every worker the context reached


def _cleanup_case(world, call, expect_on: list[int]) -> None:
    """Run ``call`` in a context; the context must reach the ranks ``expect_on``
    (distances back to the callers) and, after exit, be gone everywhere."""
    with dist_autograd.context() as context_id:
        call()
        ids = exchange(world, context_id)
        for d in expect_on:
            assert has_context(ids[world.peer_rank(-d)]), (
                f"rank {world.rank}: the context of rank {world.peer_rank(-d)} did not reach it"
            )
        world.barrier()
    assert not has_context(context_id)
    assert_contexts_released(world, ids)


def test_context_cleanup_tensor_with_grad(rpc_world):
    t1 = torch.ones(3, 3, requires_grad=True)
    _cleanup_case(rpc_world, lambda: rpc.rpc_sync(rpc_world.peer(), torch.add, (t1, t1)), [1])


def test_context_cleanup_tensor_no_grad(rpc_world):
    t1 = torch.ones(3, 3)
    _cleanup_case(rpc_world, lambda: rpc.rpc_sync(rpc_world.peer(), my_py_add, (t1, t1)), [1])


def test_context_cleanup_no_tensors(rpc_world):
    _cleanup_case(rpc_world, lambda: rpc.rpc_sync(rpc_world.peer(), my_scalar_add, (1, 1)), [1])


def test_context_cleanup_after_backward_and_remote(rpc_world):
    t1 = torch.ones(3, 3, requires_grad=True)

    def call():
        rref = rpc.remote(rpc_world.peer(), torch_ones, ((3, 3),), {"requires_grad": False})
        loss = rpc.rpc_sync(rpc_world.peer(), torch.mul, (t1, rref.to_here())).sum()
        dist_autograd.backward(dist_autograd._current_context()._context_id(), [loss])

    _cleanup_case(rpc_world, call, [1])


@pytest.mark.mpi(min_size=3)
def test_context_cleanup_nested_rpc(rpc_world):
    """rank -> rank+1 -> rank+2: rank+2 only knows the context through rank+1, and is
    cleaned up transitively."""
    world = rpc_world
    t1 = torch.ones(3, 3, requires_grad=True)
    t2 = torch.zeros(3, 3, requires_grad=True)

    def call():
        ret = rpc.rpc_sync(world.peer(1), my_py_nested_call, (t1, t2, [world.peer(2)]))
        torch.testing.assert_close(ret, t1 + t2)

    _cleanup_case(world, call, [1, 2])


@pytest.mark.mpi(min_size=3)
def test_context_cleanup_nested_rpc_without_grad(rpc_world):
    world = rpc_world

    def call():
        ret = rpc.rpc_sync(
            world.peer(1), my_py_nested_call, (torch.ones(2), torch.ones(2), [world.peer(2)])
        )
        torch.testing.assert_close(ret, torch.full((2,), 2.0))

    _cleanup_case(world, call, [1, 2])
