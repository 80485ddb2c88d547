"""Distributed autograd errors: bad input (torch's texts), errors raised during the backward
pass on any worker, recovery in the same context, timeouts, and the unused-RPC case that
hangs in PyTorch's FAST mode but must raise here in a strict pass.
"""

from __future__ import annotations

import gc
import re
import time

import pytest
import torch
from _dist_utils import (
    SimulateBackwardError,
    assert_grads_match,
    assert_no_backward_pass_anywhere,
    current_context_id,
    debug_info,
    exchange,
    get_flag,
    local_grads,
    nested_udf_with_backward_error,
    set_flag,
    udf_with_backward_error,
    udf_with_slow_backward,
    wait_until,
)
from _timing import scaled

import lightning_distgrad.autograd as dist_autograd
from lightning_distgrad import rpc
from lightning_distgrad.autograd._pass import Pass

pytestmark = pytest.mark.mpi(min_size=2)

SIMULATED = "Simulate error on backward pass"


def unused_rpc_udf(t, dst):
    """Makes an RPC whose result it drops, then returns something else."""
    rpc.rpc_sync(dst, torch.add, (t, 1))
    return t * 2


def set_remote_flag(key, value):
    set_flag(key, value)


# ---------------------------------------------------------------------------
# Bad input


def test_backward_without_context(rpc_world):
    t1 = torch.rand(3, 3, requires_grad=True)
    loss = rpc.rpc_sync(rpc_world.peer(), torch.add, (t1, 1)).sum()
    msg = "Could not find autograd context with id: 100"
    with pytest.raises(RuntimeError, match=msg):
        dist_autograd.backward(100, [loss])
    for fn in (
        dist_autograd.get_gradients,
        dist_autograd._retrieve_context,
        dist_autograd._release_context,
        dist_autograd._is_valid_context,
    ):
        with pytest.raises(RuntimeError, match=msg):
            fn(100)


def test_nested_context_text(rpc_world):
    with dist_autograd.context():
        with pytest.raises(
            RuntimeError, match=r"^Already have an autograd context id for this thread\.$"
        ):
            with dist_autograd.context():
                pass


def test_current_context_without_context_text(rpc_world):
    with pytest.raises(
        RuntimeError,
        match="^Current thread doesn't have a valid autograd "
        "context. Please wrap your code using: `with ",
    ):
        dist_autograd._current_context()


def test_backward_invalid_args(rpc_world):
    with dist_autograd.context() as context_id:
        with pytest.raises(TypeError):
            dist_autograd.backward(context_id, None)
        with pytest.raises(TypeError):
            dist_autograd.backward(None, None)
        t1 = torch.rand(3, 3, requires_grad=True)
        with pytest.raises(TypeError):
            dist_autograd.backward(None, [t1.sum()])

        with pytest.raises(RuntimeError, match="No tensors provided for gradient computation."):
            dist_autograd.backward(context_id, [])

        t2 = rpc.rpc_sync(rpc_world.peer(), torch.add, (torch.rand(3, 3), 1))
        with pytest.raises(RuntimeError, match="requires_grad not set on root"):
            dist_autograd.backward(context_id, [t2.sum()])

        t3 = rpc.rpc_sync(rpc_world.peer(), torch.add, (t1, t1))
        with pytest.raises(RuntimeError, match="is not a scalar, all roots need to be scalar"):
            dist_autograd.backward(context_id, [t3])

        with pytest.raises(RuntimeError, match="does not have a valid gradient function."):
            dist_autograd.backward(context_id, [torch.rand(1, requires_grad=True)])

        # the roots are checked before anything runs: the context is usable afterwards
        dist_autograd.backward(context_id, [t3.sum()])
        torch.testing.assert_close(
            dist_autograd.get_gradients(context_id)[t1], 2 * torch.ones(3, 3)
        )


def test_context_functions_reject_none_with_type_error(rpc_world):
    for fn in (
        dist_autograd.get_gradients,
        dist_autograd._retrieve_context,
        dist_autograd._release_context,
        dist_autograd._is_valid_context,
    ):
        with pytest.raises(TypeError):
            fn(None)


def test_bad_root_among_good_roots(rpc_world):
    t1 = torch.rand(3, 3, requires_grad=True)
    with dist_autograd.context() as context_id:
        good = rpc.rpc_sync(rpc_world.peer(), torch.mul, (t1, 2)).sum()
        with pytest.raises(RuntimeError, match="requires_grad not set on root"):
            dist_autograd.backward(context_id, [good, torch.ones(())])
        assert dist_autograd.get_gradients(context_id) == {}
        dist_autograd.backward(context_id, [good])
        torch.testing.assert_close(
            dist_autograd.get_gradients(context_id)[t1], 2 * torch.ones(3, 3)
        )


def test_get_gradients_on_released_context(rpc_world):
    t1 = torch.rand(3, 3, requires_grad=True)
    with dist_autograd.context() as context_id:
        loss = rpc.rpc_sync(rpc_world.peer(), torch.add, (t1, 1)).sum()
        dist_autograd.backward(context_id, [loss])
        assert t1 in dist_autograd.get_gradients(context_id)
    with pytest.raises(
        RuntimeError, match=f"Could not find autograd context with id: {context_id}"
    ):
        dist_autograd.get_gradients(context_id)
    with pytest.raises(
        RuntimeError, match=f"Could not find autograd context with id: {context_id}"
    ):
        dist_autograd.backward(context_id, [loss])


def test_local_backward_through_recv_is_refused(rpc_world):
    """``loss.backward()`` on a graph with RPCs cannot work; it must say so."""
    t1 = torch.rand(3, 3, requires_grad=True)
    with dist_autograd.context():
        loss = rpc.rpc_sync(rpc_world.peer(), torch.add, (t1, 1)).sum()
        with pytest.raises(RuntimeError, match="received over RPC"):
            loss.backward()


# ---------------------------------------------------------------------------
# Errors during the backward pass, and recovery


def test_backward_autograd_engine_error(rpc_world):
    """The failing node runs here, before a chain of four RPCs; its error reaches the root."""
    world = rpc_world
    others = [world.peer(d) for d in range(1, world.size)]
    t1 = torch.rand(3, 3, requires_grad=True)
    t2 = torch.rand(3, 3, requires_grad=True)
    with dist_autograd.context() as context_id:
        set_flag(("fail", context_id), True)
        tmp = (t1 + t2) * (t1 + t2)
        t3 = SimulateBackwardError.apply(tmp, context_id)
        val = rpc.rpc_sync(others[0], torch.add, (t2, t3))
        val = rpc.rpc_sync(others[1 % len(others)], torch.mul, (val, t2))
        val = rpc.rpc_sync(others[2 % len(others)], torch.matmul, (val, t2))
        val = rpc.rpc_sync(others[3 % len(others)], torch.div, (val, t2))
        with pytest.raises(RuntimeError, match=f"Error on Node {world.rank}: {SIMULATED}"):
            dist_autograd.backward(context_id, [val.sum()], retain_graph=True)
        # the cause goes away: the same context runs a complete pass
        set_flag(("fail", context_id), None)
        before = dict(dist_autograd.get_gradients(context_id))
        dist_autograd.backward(context_id, [val.sum()])
        after = dist_autograd.get_gradients(context_id)
        assert set(after) == {t1, t2}

        def loss_fn(ex, a, b):
            val = torch.add(b, SimulateBackwardError.apply((a + b) * (a + b), None))
            val = torch.div(torch.matmul(torch.mul(val, b), b), b)
            return [val.sum()]

        expected = local_grads(loss_fn, t1, t2)
        for leaf, exp in zip((t1, t2), expected, strict=True):
            torch.testing.assert_close(after[leaf] - before.get(leaf, 0), exp)
        assert_no_backward_pass_anywhere(world)


def test_backward_python_udf_error(rpc_world):
    """The failing node is in a remote UDF's graph two hops away (A -> B -> C)."""
    world = rpc_world
    t1 = torch.rand(3, 3, requires_grad=True)
    t2 = torch.rand(3, 3, requires_grad=True)
    with dist_autograd.context() as context_id:
        # the error is keyed by context id on the worker that runs the failing node
        third = world.peer(2)
        rpc.rpc_sync(third, set_remote_flag, (("fail", context_id), True))
        loss = rpc.rpc_sync(world.peer(1), nested_udf_with_backward_error, (t1, t2, third)).sum()
        node = world.peer_rank(2)
        with pytest.raises(RuntimeError, match=f"Error on Node {node}: {SIMULATED}"):
            dist_autograd.backward(context_id, [loss], retain_graph=True)
        assert dist_autograd.get_gradients(context_id) == {}
        # recovery: the same context, the cause gone
        rpc.rpc_sync(third, set_remote_flag, (("fail", context_id), None))
        dist_autograd.backward(context_id, [loss])
        expected = local_grads(lambda ex, a, b: [(((a * b) + b + (a * b) + b) * a).sum()], t1, t2)
        assert_grads_match(dist_autograd.get_gradients(context_id), [t1, t2], expected)
        assert_no_backward_pass_anywhere(world)


@pytest.fixture
def collected_by_hand():
    """Automatic garbage collection is off during the test (on every thread of this
    process); yields a function that collects and returns the objects found only in
    reference cycles."""

    def collect() -> list:
        gc.set_debug(gc.DEBUG_SAVEALL)  # what a collection finds goes to gc.garbage
        try:
            gc.collect()
            return list(gc.garbage)
        finally:
            gc.set_debug(0)
            gc.garbage.clear()

    gc.collect()
    gc.disable()
    try:
        yield collect
    finally:
        gc.enable()


def test_a_failed_pass_is_freed_without_the_garbage_collector(rpc_world, collected_by_hand):
    """The error of a failed pass, whose traceback holds the pass, does not keep the pass in
    a reference cycle: a collection running on another thread while the next pass of the
    context starts would clear the node objects that pass takes up (see ``Pass.close``)."""
    world = rpc_world
    t1 = torch.rand(3, 3, requires_grad=True)
    t2 = torch.rand(3, 3, requires_grad=True)
    with dist_autograd.context() as context_id:
        rpc.rpc_sync(world.peer(), set_remote_flag, (("fail", context_id), True))
        loss = rpc.rpc_sync(world.peer(), udf_with_backward_error, (t1, t2)).sum()
        try:
            dist_autograd.backward(context_id, [loss], retain_graph=True)
        except RuntimeError as e:
            error = str(e)
        else:
            error = "no error"
        assert SIMULATED in error
        rpc.rpc_sync(world.peer(), set_remote_flag, (("fail", context_id), None))
        in_cycles = [o for o in collected_by_hand() if isinstance(o, Pass)]
        assert not in_cycles, f"passes left in reference cycles: {in_cycles}"
        dist_autograd.backward(context_id, [loss])
        world.barrier()


def test_multiple_backward_with_errors(rpc_world):
    """Passes fail while the remote node raises, then succeed in the same context."""
    world = rpc_world
    t1 = torch.rand(3, 3, requires_grad=True, dtype=torch.float64)
    t2 = torch.rand(3, 3, requires_grad=True, dtype=torch.float64)
    expected = local_grads(lambda ex, a, b: [((a + b) + (a + b)).sum()], t1, t2)
    with dist_autograd.context() as context_id:
        key = ("fail", context_id)
        rpc.rpc_sync(world.peer(), set_remote_flag, (key, True))
        loss = rpc.rpc_sync(world.peer(), udf_with_backward_error, (t1, t2)).sum()
        for _ in range(5):
            with pytest.raises(
                RuntimeError, match=f"Error on Node {world.peer_rank()}: {SIMULATED}"
            ):
                dist_autograd.backward(context_id, [loss], retain_graph=True)
            assert dist_autograd.get_gradients(context_id) == {}
        rpc.rpc_sync(world.peer(), set_remote_flag, (key, None))
        for i in range(1, 6):
            dist_autograd.backward(context_id, [loss], retain_graph=True)
            assert_grads_match(
                dist_autograd.get_gradients(context_id), [t1, t2], [i * e for e in expected]
            )
        assert_no_backward_pass_anywhere(world)


def test_error_in_one_of_several_branches(rpc_world):
    """Two independent RPC branches; one fails remotely. The root gets the error, and no
    worker is left running the other branch."""
    world = rpc_world
    t1 = torch.rand(3, 3, requires_grad=True)
    with dist_autograd.context() as context_id:
        rpc.rpc_sync(world.peer(1), set_remote_flag, (("fail", context_id), True))
        bad = rpc.rpc_sync(world.peer(1), udf_with_backward_error, (t1, t1))
        good = rpc.rpc_sync(world.peer(-1), torch.mul, (t1, 3))
        with pytest.raises(RuntimeError, match=SIMULATED):
            dist_autograd.backward(context_id, [bad.sum(), good.sum()], retain_graph=True)
        rpc.rpc_sync(world.peer(1), set_remote_flag, (("fail", context_id), None))
        before = dist_autograd.get_gradients(context_id).get(t1, torch.zeros(3, 3))
        dist_autograd.backward(context_id, [bad.sum(), good.sum()])
        torch.testing.assert_close(
            dist_autograd.get_gradients(context_id)[t1] - before, torch.full((3, 3), 7.0)
        )
        assert_no_backward_pass_anywhere(world)


@pytest.mark.parametrize("case", ["local_error", "remote_udf_error", "unused_remote_send"])
def test_no_backward_pass_left_running_after_a_failed_pass(rpc_world, case):
    """When backward() has raised, the pass is over on every worker."""
    world = rpc_world
    t1 = torch.rand(3, 3, requires_grad=True)
    with dist_autograd.context() as context_id:
        if case == "local_error":
            set_flag(("fail", context_id), True)
            x = SimulateBackwardError.apply(t1 * 2, context_id)
            x = rpc.rpc_sync(world.peer(), torch.mul, (x, t1))
            loss = rpc.rpc_sync(world.peer(), torch.add, (x, t1)).sum()
        elif case == "remote_udf_error":
            rpc.rpc_sync(world.peer(), set_remote_flag, (("fail", context_id), True))
            loss = rpc.rpc_sync(world.peer(), udf_with_backward_error, (t1, t1)).sum()
        else:
            loss = rpc.rpc_sync(world.peer(1), unused_rpc_udf, (t1, world.peer(2))).sum()
        with pytest.raises(RuntimeError):
            dist_autograd.backward(context_id, [loss], strict=True)
        try:
            assert_no_backward_pass_anywhere(world, timeout=2.0)
        finally:
            set_flag(("fail", context_id), None)
            rpc.rpc_sync(world.peer(), set_remote_flag, (("fail", context_id), None))
            world.barrier()


# ---------------------------------------------------------------------------
# Timeouts


def test_timeout_during_backward(rpc_world):
    """A remote node's backward runs past the RPC timeout: backward raises the timeout
    error while that node still runs; afterwards (timeout restored) the context works again."""
    world = rpc_world
    timeout_s = 0.5
    t1 = torch.rand(3, 3, requires_grad=True)
    t2 = torch.rand(3, 3, requires_grad=True)
    expected = local_grads(lambda ex, a, b: [(a * b).sum()], t1, t2)
    with dist_autograd.context() as context_id:
        # The peer's node waits until the peer lets it go (after this rank's pass timed out).
        rpc.rpc_sync(world.peer(), set_remote_flag, (("hold", context_id), True))
        loss = rpc.rpc_sync(world.peer(), udf_with_slow_backward, (t1, t2)).sum()
        old = rpc.get_rpc_timeout()
        world.barrier()
        rpc._set_rpc_timeout(timeout_s)
        try:
            start = time.monotonic()
            with pytest.raises(RuntimeError, match="RPC ran for more than set timeout"):
                dist_autograd.backward(context_id, [loss], retain_graph=True)
            elapsed = time.monotonic() - start
        finally:
            rpc._set_rpc_timeout(old)
        assert elapsed >= timeout_s * 0.9, elapsed  # not before the timeout
        # The node of the previous rank's pass runs here, maybe on the progress thread
        # (which then answers no RPC): it ran, and still runs, after that pass timed out.
        held = exchange(world, context_id)[world.peer_rank(-1)]
        assert get_flag(("running", held)), "the slow node of the timed-out pass never ran"
        set_flag(("hold", held), None)
        # the slow node finishes now; its pass must end everywhere
        ok = wait_until(lambda: debug_info()["num_current_backward_passes"] == 0)
        assert ok, f"rank {world.rank}: backward pass still running: {debug_info()}"
        world.barrier()
        before = dict(dist_autograd.get_gradients(context_id))
        dist_autograd.backward(context_id, [loss])
        after = dist_autograd.get_gradients(context_id)
        for leaf, exp in zip((t1, t2), expected, strict=True):
            torch.testing.assert_close(after[leaf] - before.get(leaf, torch.zeros(3, 3)), exp)
        world.barrier()


def test_slow_backward_within_timeout_succeeds(rpc_world):
    """A slow remote node that stays under the timeout is just slow."""
    world = rpc_world
    t1 = torch.rand(3, 3, requires_grad=True)
    t2 = torch.rand(3, 3, requires_grad=True)
    expected = local_grads(lambda ex, a, b: [(a * b).sum()], t1, t2)
    with dist_autograd.context() as context_id:
        key = ("sleep", context_id)
        rpc.rpc_sync(world.peer(), set_remote_flag, (key, 0.5))
        loss = rpc.rpc_sync(world.peer(), udf_with_slow_backward, (t1, t2)).sum()
        start = time.monotonic()
        dist_autograd.backward(context_id, [loss])
        assert time.monotonic() - start >= 0.45
        assert_grads_match(dist_autograd.get_gradients(context_id), [t1, t2], expected)
        rpc.rpc_sync(world.peer(), set_remote_flag, (key, None))


# ---------------------------------------------------------------------------
# RPC results that never reach the loss (PyTorch's FAST mode hangs here)

#: A bound on "raises instead of hanging" (it takes a fraction of a second).
UNUSED_TIME_BOUND_S = scaled(20.0)


def test_backward_unused_send_function(rpc_world):
    world = rpc_world
    t1 = torch.rand(3, 3, requires_grad=True)
    t2 = torch.rand(3, 3, requires_grad=True)
    with dist_autograd.context() as context_id:
        rpc.rpc_sync(world.peer(), torch.add, (t1, t2))  # result unused
        loss = torch.mul(t1, t2).sum()
        (msg_id,) = dist_autograd._current_context()._send_functions()
        start = time.monotonic()
        with pytest.raises(RuntimeError) as info:
            dist_autograd.backward(context_id, [loss], strict=True)
        elapsed = time.monotonic() - start
        text = str(info.value)
        assert f"autograd message {msg_id} " in text
        assert f"worker {world.rank} -> worker {world.peer_rank()}" in text
        assert "got no gradient" in text
        assert elapsed < UNUSED_TIME_BOUND_S
        assert_no_backward_pass_anywhere(world)


def test_backward_unused_send_function_on_a_remote_worker(rpc_world):
    """The unused RPC is made by a remote UDF (callee -> third worker): the root's error
    names that message and those two workers (strictness set on the context)."""
    world = rpc_world
    t1 = torch.rand(3, 3, requires_grad=True)
    with dist_autograd.context(strict=True) as context_id:
        ret = rpc.rpc_sync(world.peer(1), unused_rpc_udf, (t1, world.peer(2)))
        start = time.monotonic()
        with pytest.raises(RuntimeError) as info:
            dist_autograd.backward(context_id, [ret.sum()])
        elapsed = time.monotonic() - start
        text = str(info.value)
        assert f"worker {world.peer_rank(1)} -> worker {world.peer_rank(2)}" in text
        assert "got no gradient" in text
        assert elapsed < UNUSED_TIME_BOUND_S
        # the id named is a send function of this context on the callee
        ids = exchange(world, context_id)
        prev = world.peer_rank(-1)
        sends = dist_autograd._retrieve_context(ids[prev])._send_functions()
        named = [int(m) for m in re.findall(r"autograd message (\d+)", text)]
        mine = [m for m in named if m >> 48 == world.peer_rank(1)]
        assert len(mine) == 1
        world.barrier()
        # the message named by the previous rank's error is one of this rank's sends
        everyone = world.comm.allgather(mine[0])
        assert everyone[prev] in sends
        world.barrier()


def test_unused_rpc_without_grad_is_fine(rpc_world):
    """RPCs whose arguments do not require grad record no send: backward is not affected."""
    t1 = torch.rand(3, 3, requires_grad=True)
    with dist_autograd.context() as context_id:
        rpc.rpc_sync(rpc_world.peer(), torch.add, (t1.detach(), 1))
        with torch.no_grad():
            rpc.rpc_sync(rpc_world.peer(), torch.add, (t1, 1))
        loss = rpc.rpc_sync(rpc_world.peer(), torch.mul, (t1, 2)).sum()
        dist_autograd.backward(context_id, [loss])
        torch.testing.assert_close(
            dist_autograd.get_gradients(context_id)[t1], torch.full((3, 3), 2.0)
        )


def test_current_context_id_helper(rpc_world):
    with dist_autograd.context() as context_id:
        assert current_context_id() == context_id
