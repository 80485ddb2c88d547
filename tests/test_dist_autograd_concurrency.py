"""Distributed autograd under concurrency: several threads per rank, each with its own
contexts, on the same workers at once; the thread-local current context, including in
RPC continuations that run on other threads.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from _dist_utils import (
    assert_grads_match,
    assert_no_backward_pass_anywhere,
    exchange,
    local_grads,
    owner_grad,
    wait_for_no_contexts,
)
from _timing import scaled

import lightning_distgrad.autograd as dist_autograd
from lightning_distgrad import rpc

pytestmark = pytest.mark.mpi(min_size=2)

JOIN_TIMEOUT_S = scaled(240.0)


def run_threads(n: int, target, *args) -> list[BaseException]:
    """Run ``target(i, *args)`` in ``n`` threads; returns their exceptions (fails on a hang)."""
    errors: list[BaseException] = []
    lock = threading.Lock()

    def body(i):
        try:
            target(i, *args)
        except BaseException as e:  # noqa: BLE001 - reported by the caller
            with lock:
                errors.append(e)

    threads = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    alive = sum(t.is_alive() for t in threads)
    assert alive == 0, f"{alive} of {n} threads still running after {JOIN_TIMEOUT_S} s"
    return errors


# ---------------------------------------------------------------------------
# Remote functions

_W: dict[str, torch.Tensor] = {}


def shared_weight_mul(x):
    """Uses this worker's shared leaf ``_W["w"]``: every caller's context gets its own grad."""
    return x * _W["w"]


def shared_weight_grad(context_id):
    return dist_autograd.get_gradients(context_id).get(_W["w"])


def slow_add(t1, t2):
    time.sleep(0.3)
    t3 = t1 + t2
    t3.requires_grad = True
    return t3


@rpc.functions.async_execution
def async_add_then_local_mul(t, first):
    """The continuation runs on another thread and computes locally on the RPC's result."""
    fut = rpc.rpc_async(first, torch.add, (t, 1))
    return fut.then(lambda f: f.wait() * 2)


def slow_add_one(t):
    time.sleep(0.2)
    return t + 1


_CONTINUATION: dict[str, bool] = {}


@rpc.functions.async_execution
def async_add_then_mul(t, first, second):
    """The continuation runs on another thread and makes an RPC: it must carry the context."""
    fut = rpc.rpc_async(first, slow_add_one, (t,))
    # Still running: ``then`` cannot run the callback right here, on the request's thread.
    _CONTINUATION["attached_before_done"] = not fut.done()
    return fut.then(lambda f: rpc.rpc_sync(second, torch.mul, (f.wait(), 2)))


def continuation_attached_before_done():
    return _CONTINUATION.pop("attached_before_done")


# ---------------------------------------------------------------------------


def test_thread_local_current_context(rpc_world):
    box = {}

    def other():
        try:
            dist_autograd._current_context()
            box["saw"] = "a context"
        except RuntimeError:
            box["saw"] = None
        with dist_autograd.context() as context_id:
            box["id"] = context_id
            box["current"] = dist_autograd._current_context()._context_id()

    with dist_autograd.context() as mine:
        thread = threading.Thread(target=other)
        thread.start()
        thread.join(scaled(30))
        assert box["saw"] is None, "a new thread must not inherit the current context"
        assert box["current"] == box["id"] != mine
        assert box["id"] >> 48 == rpc_world.rank
        assert dist_autograd._current_context()._context_id() == mine
    assert not thread.is_alive()


def _workload(i, world, iterations):
    """torch's ``_workload_thread``: four RPCs, then backward, in a fresh context each time."""
    for it in range(iterations):
        dst = world.names[(world.rank + 1 + i + it) % world.size]
        t1 = torch.rand(3, 3, requires_grad=True)
        t2 = torch.rand(3, 3, requires_grad=True)

        def forward(ex, t1, t2):
            t3 = ex(torch.add, t1, t2)
            t4 = ex(torch.mul, t2, t3)
            t5 = ex(torch.matmul, t3, t4)
            t6 = ex(torch.add, t4, t5)
            return [t6.sum()]

        expected = local_grads(forward, t1, t2)
        with dist_autograd.context() as context_id:
            roots = forward(lambda fn, *a, dst=dst: rpc.rpc_sync(dst, fn, a), t1, t2)
            dist_autograd.backward(context_id, roots)
            assert_grads_match(dist_autograd.get_gradients(context_id), [t1, t2], expected)


def test_async_dist_autograd(rpc_world):
    """Threads on every rank run their own contexts against the same workers at once."""
    errors = run_threads(8, _workload, rpc_world, 3)
    assert not errors, f"{len(errors)} thread(s) failed; first: {errors[0]!r}"
    assert_no_backward_pass_anywhere(rpc_world)
    wait_for_no_contexts(rpc_world)


def test_async_dist_autograd_to_one_worker(rpc_world):
    """All threads of all ranks use worker0 (torch's version of the test)."""

    def workload(i):
        t1 = torch.rand(3, 3, requires_grad=True)
        t2 = torch.rand(3, 3, requires_grad=True)
        expected = local_grads(
            lambda ex, a, b: [ex(torch.mul, ex(torch.add, a, b), b).sum()], t1, t2
        )
        with dist_autograd.context() as context_id:
            t3 = rpc.rpc_sync("worker0", torch.add, (t1, t2))
            t4 = rpc.rpc_sync("worker0", torch.mul, (t3, t2))
            dist_autograd.backward(context_id, [t4.sum()])
            assert_grads_match(dist_autograd.get_gradients(context_id), [t1, t2], expected)

    errors = run_threads(10, workload)
    assert not errors, f"{len(errors)} thread(s) failed; first: {errors[0]!r}"


def test_concurrent_contexts_share_a_remote_parameter(rpc_world):
    """Threads of every rank use the same leaf on their peer; each context holds its own grad
    of it, and the leaf's ``.grad`` stays untouched."""
    world = rpc_world
    _W["w"] = torch.full((4,), 0.5, requires_grad=True)
    world.barrier()

    def workload(i):
        for _ in range(3):
            x = torch.rand(4, requires_grad=True)
            with dist_autograd.context() as context_id:
                y = rpc.rpc_sync(world.peer(), shared_weight_mul, (x,))
                dist_autograd.backward(context_id, [(y * y).sum()])
                grads = dist_autograd.get_gradients(context_id)
                torch.testing.assert_close(grads[x], 2 * x.detach() * 0.25)
                w_grad = rpc.rpc_sync(world.peer(), shared_weight_grad, (context_id,))
                torch.testing.assert_close(w_grad, 2 * x.detach() ** 2 * 0.5)

    errors = run_threads(6, workload)
    assert not errors, f"{len(errors)} thread(s) failed; first: {errors[0]!r}"
    world.barrier()
    assert _W["w"].grad is None
    world.barrier()
    _W.clear()


def test_thread_local_context_id(rpc_world):
    """The RRef comes from a slow remote() made outside the context; its to_here() inside the
    context completes on an RPC thread, which must still record into the context."""
    world = rpc_world
    t1 = torch.rand(3, 3)
    t2 = torch.rand(3, 3)
    t3 = t1 + t2
    t3.requires_grad = True
    t3.sum().backward()
    rref = rpc.remote(world.peer(), slow_add, (t1, t2))
    with dist_autograd.context() as context_id:
        loss = rref.to_here().sum()
        dist_autograd.backward(context_id, [loss])
        grad = rpc.rpc_sync(world.peer(), owner_grad, (context_id, rref))
        assert grad is not None
        torch.testing.assert_close(grad, t3.grad)


def test_async_udf_continuation_result_carries_gradients(rpc_world):
    """An ``@async_execution`` UDF whose continuation computes on a nested RPC's result: the
    answer (sent from the continuation's thread) is still recorded in the caller's context."""
    world = rpc_world
    t = torch.rand(3, 3, requires_grad=True)
    with dist_autograd.context() as context_id:
        ret = rpc.rpc_sync(world.peer(1), async_add_then_local_mul, (t, world.peer(2)))
        torch.testing.assert_close(ret, (t.detach() + 1) * 2)
        assert ret.requires_grad
        dist_autograd.backward(context_id, [ret.sum()])
        torch.testing.assert_close(
            dist_autograd.get_gradients(context_id)[t], torch.full((3, 3), 2.0)
        )


def test_context_in_async_udf_continuation(rpc_world):
    """An ``@async_execution`` UDF whose ``then`` callback makes a nested RPC on another thread:
    the callback runs in the context of the RPC it continues, so the gradient chain holds."""
    world = rpc_world
    t = torch.rand(3, 3, requires_grad=True)
    with dist_autograd.context() as context_id:
        ret = rpc.rpc_sync(world.peer(1), async_add_then_mul, (t, world.peer(2), world.peer(1)))
        assert rpc.rpc_sync(world.peer(1), continuation_attached_before_done)
        torch.testing.assert_close(ret, (t.detach() + 1) * 2)
        assert ret.requires_grad
        dist_autograd.backward(context_id, [ret.sum()])
        torch.testing.assert_close(
            dist_autograd.get_gradients(context_id)[t], torch.full((3, 3), 2.0)
        )


def test_threads_with_nested_calls_and_exchange(rpc_world):
    """Threads run nested UDF chains while the main thread waits in a collective: requests
    keep being served, and every context reaches and leaves every worker it used."""
    from _dist_utils import my_py_nested_call

    world = rpc_world
    ids: list[int] = []
    lock = threading.Lock()

    def workload(i):
        t1 = torch.rand(2, requires_grad=True)
        t2 = torch.rand(2, requires_grad=True)
        with dist_autograd.context() as context_id:
            with lock:
                ids.append(context_id)
            path = [world.peer(2), world.peer(3)]
            ret = rpc.rpc_sync(world.peer(1), my_py_nested_call, (t1, t2, path))
            dist_autograd.backward(context_id, [ret.sum()])
            grads = dist_autograd.get_gradients(context_id)
            torch.testing.assert_close(grads[t1], torch.ones(2))
            torch.testing.assert_close(grads[t2], torch.ones(2))

    errors = run_threads(4, workload)
    assert not errors, f"{len(errors)} thread(s) failed; first: {errors[0]!r}"
    everyone = exchange(world, ids)
    assert all(len(x) == 4 for x in everyone)
    wait_for_no_contexts(world)


# Last in the file: a lock-up here would leave a rank's RPC progress thread stuck.
def test_concurrent_passes_many_gradient_messages(rpc_world):
    """Many RPCs whose gradients flow back at the same time (several roots, fan-out to every
    worker, async calls). With a short RPC timeout a lock-up fails fast instead of hanging."""
    world = rpc_world
    old = rpc.get_rpc_timeout()
    world.barrier()
    rpc._set_rpc_timeout(20)
    ops = [torch.add, torch.mul, torch.div, torch.sub]

    def local_forward(ex, a, b):
        return [op(a, b).sum() for _ in range(world.size) for op in ops]

    try:
        for _ in range(15):
            t1 = torch.rand(3, 3, requires_grad=True)
            t2 = torch.rand(3, 3, requires_grad=True)
            expected = local_grads(local_forward, t1, t2)
            with dist_autograd.context() as context_id:
                futs = [
                    rpc.rpc_async(world.names[d], op, (t1, t2))
                    for d in range(world.size)
                    for op in ops
                ]
                roots = [f.wait().sum() for f in futs]
                dist_autograd.backward(context_id, roots)
                assert_grads_match(dist_autograd.get_gradients(context_id), [t1, t2], expected)
    finally:
        rpc._set_rpc_timeout(old)
    world.barrier()
