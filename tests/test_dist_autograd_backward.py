"""Distributed backward: gradients in the context equal those of plain local autograd.

Each test runs the same computation with the RPCs replaced by local calls on
clones of the leaves (``_dist_utils.local_grads``) and compares. Ported from
torch's ``DistAutogradTest`` (gradient, accumulation, hook and RRef tests) plus
the cases the design notes add (retain_graph on every worker, hooks that see
gradients both locally and through RPCs).
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from _dist_utils import (
    REMOTE_MODES,
    ExecMode,
    Rotation,
    assert_grads_match,
    check_against_local,
    exchange,
    exec_func,
    local_grads,
    my_nested_rref_add,
    my_py_add,
    my_rref_add,
    owner_grad,
    torch_ones,
)
from _timing import scaled

import lightning_distgrad.autograd as dist_autograd
from lightning_distgrad import rpc

pytestmark = pytest.mark.mpi(min_size=2)

SECOND_TIME = "Trying to backward through the graph a second time"


# ---------------------------------------------------------------------------
# Remote functions


def complex_python_udf(t1, t2):
    t3 = F.linear(t1, t2)
    t4 = F.linear(t2, t3)
    t5 = F.linear(t3, t4)
    return torch.linalg.multi_dot([t1, t2, t3, t4, t5])


def nested_python_udf(t1, t2, dst):
    t3 = t1 * t2
    t4 = t1 + t2
    res = rpc.rpc_sync(dst, my_py_add, (t3, t4)) if dst is not None else my_py_add(t3, t4)
    return t1 * t2 * t3 * t4 * res


def mixed_requires_grad_op(t1, t2):
    # the callee must see exactly the requires_grad flags of the caller
    if t2.requires_grad:
        return t1 - t2
    return t1 * t2


_REQUIRES_GRAD_TENSOR = torch.ones(3, 3, requires_grad=True)


def ret_requires_grad():
    return _REQUIRES_GRAD_TENSOR


def callee_grads_of_return_value(context_id):
    grads = dist_autograd.get_gradients(context_id)
    return len(grads), grads.get(_REQUIRES_GRAD_TENSOR), _REQUIRES_GRAD_TENSOR.grad is None


def multi_output(t):
    """Several outputs; the caller uses only some of them."""
    return t * 2, t * 3, (t**2).sum(), t + 1


_PS_PARAM: dict[str, torch.Tensor] = {}


def ps_param():
    return _PS_PARAM["w"]


def ps_grad(context_id):
    return dist_autograd.get_gradients(context_id).get(_PS_PARAM["w"])


def rref_sum(x):
    return x.sum()


def identity(x):
    return x


def mul_udf(t1, t2):
    return t1 * t2


# ---------------------------------------------------------------------------
# Simple calls, every way of calling, to a peer and to self


@pytest.mark.parametrize("mode", REMOTE_MODES, ids=lambda m: m.value)
@pytest.mark.parametrize("fn", [torch.add, my_py_add], ids=["builtin", "python"])
@pytest.mark.parametrize("to_self", [False, True], ids=["peer", "self"])
def test_backward_simple(rpc_world, mode, fn, to_self):
    t1 = torch.rand(3, 3, requires_grad=True)
    t2 = torch.rand(3, 3, requires_grad=True)
    dst = rpc_world.name if to_self else rpc_world.peer()
    check_against_local(lambda ex, a, b: [ex(fn, a, b).sum()], mode, dst, t1, t2)


def test_backward_without_rpc(rpc_world):
    t1 = torch.rand(3, 3, requires_grad=True)
    t2 = torch.rand(3, 3, requires_grad=True)
    with dist_autograd.context() as context_id:
        loss = torch.add(t1, t2).sum()
        dist_autograd.backward(context_id, [loss])
        grads = dist_autograd.get_gradients(context_id)
        assert len(grads) == 2
        torch.testing.assert_close(grads[t1], torch.ones(3, 3))
        torch.testing.assert_close(grads[t2], torch.ones(3, 3))
    assert t1.grad is None and t2.grad is None


def test_backward_no_grad_on_tensor(rpc_world):
    """Gradients go to the context; ``.grad`` is never touched."""
    t1 = torch.rand(3, 3, requires_grad=True)
    t2 = torch.rand(3, 3, requires_grad=True)
    with dist_autograd.context() as context_id:
        loss = rpc.rpc_sync(rpc_world.peer(), torch.add, (t1, t2)).sum()
        dist_autograd.backward(context_id, [loss], retain_graph=True)
        assert t1.grad is None and t2.grad is None
        # a local backward through the local part fills .grad ...
        loss_local = torch.add(t1, t2).sum()
        loss_local.backward()
        torch.testing.assert_close(t1.grad, torch.ones(3, 3))
        # ... and another distributed pass leaves it alone
        dist_autograd.backward(context_id, [loss])
        torch.testing.assert_close(t1.grad, torch.ones(3, 3))
        torch.testing.assert_close(t2.grad, torch.ones(3, 3))
        torch.testing.assert_close(
            dist_autograd.get_gradients(context_id)[t1], 2 * torch.ones(3, 3)
        )


def test_backward_complex_python_udf(rpc_world):
    t1 = torch.rand(3, 3, requires_grad=True)
    t2 = torch.rand(3, 3, requires_grad=True)
    for mode in (ExecMode.RPC_SYNC, ExecMode.REMOTE):
        check_against_local(
            lambda ex, a, b: [ex(complex_python_udf, a, b).sum()], mode, rpc_world.peer(), t1, t2
        )


def test_backward_simple_python_udf_remote(rpc_world):
    t1 = torch.rand(3, 3, requires_grad=True)
    t2 = torch.rand(3, 3, requires_grad=True)
    check_against_local(
        lambda ex, a, b: [ex(my_py_add, a, b).sum()], ExecMode.REMOTE, rpc_world.peer(), t1, t2
    )


# ---------------------------------------------------------------------------
# Multi-hop graphs


@pytest.mark.parametrize("mode", [ExecMode.RPC_SYNC, ExecMode.REMOTE], ids=lambda m: m.value)
def test_backward_multiple_round_trips(rpc_world, mode):
    t1 = torch.rand(3, 3, requires_grad=True)
    t2 = torch.rand(3, 3)
    t3 = torch.rand(3, 3, requires_grad=True)
    t4 = torch.rand(3, 3)
    t5 = torch.rand(3, 3, requires_grad=True)

    def forward(ex, t1, t2, t3, t4, t5):
        val = ex(torch.add, t1, t2)
        val = ex(torch.mul, t3, val)
        s1 = ex(torch.stack, (t4, val))
        s2 = ex(torch.stack, (t5, val))
        val = ex(torch.bmm, s1, s2)
        val = ex(torch.matmul, val, val)
        return [val.sum()]

    rotation = Rotation(rpc_world, include_self=True)
    expected = local_grads(forward, t1, t2, t3, t4, t5)
    assert expected[1] is None and expected[3] is None
    with dist_autograd.context() as context_id:
        roots = forward(lambda fn, *a: exec_func(mode, rotation.next(), fn, *a), t1, t2, t3, t4, t5)
        dist_autograd.backward(context_id, roots)
        assert_grads_match(dist_autograd.get_gradients(context_id), [t1, t2, t3, t4, t5], expected)


def test_backward_different_tensor_dims(rpc_world):
    t1 = torch.rand(4, 6, requires_grad=True)
    t2 = torch.rand(6, 5)
    t3 = torch.rand(5, 7, requires_grad=True)
    t4 = torch.rand(7, 9)

    def forward(ex, t1, t2, t3, t4):
        val = ex(torch.matmul, t1, t2)
        val = ex(torch.linalg.multi_dot, (val, t3, t4))
        return [val.sum()]

    for mode in (ExecMode.RPC_SYNC, ExecMode.REMOTE):
        check_against_local(forward, mode, rpc_world.peer(), t1, t2, t3, t4)


def test_backwards_nested_python_udf(rpc_world):
    """A -> B -> C: B's UDF makes its own RPC (to a third worker when there is one)."""
    t1 = torch.rand(3, 3, requires_grad=True)
    t2 = torch.rand(3, 3, requires_grad=True)
    expected = local_grads(lambda ex, a, b: [nested_python_udf(a, b, None).sum()], t1, t2)
    with dist_autograd.context() as context_id:
        loss = rpc.rpc_sync(rpc_world.peer(1), nested_python_udf, (t1, t2, rpc_world.peer(2))).sum()
        dist_autograd.backward(context_id, [loss])
        assert_grads_match(dist_autograd.get_gradients(context_id), [t1, t2], expected)


def test_backward_chain_across_all_workers(rpc_world):
    """The value visits every worker in turn, each hop a different op with saved tensors."""
    t1 = torch.rand(3, 3, requires_grad=True)
    w = torch.rand(3, 3, requires_grad=True)

    def forward(ex, t1, w):
        val = t1
        for d in range(1, rpc_world.size + 1):
            val = ex(torch.mul, val, w) if d % 2 else ex(torch.matmul, val, w)
            val = torch.tanh(val)
        return [val.sum()]

    rotation = Rotation(rpc_world, include_self=True)
    expected = local_grads(forward, t1, w)
    with dist_autograd.context() as context_id:
        roots = forward(lambda fn, *a: rpc.rpc_sync(rotation.next(), fn, a), t1, w)
        dist_autograd.backward(context_id, roots)
        assert_grads_match(dist_autograd.get_gradients(context_id), [t1, w], expected)


# ---------------------------------------------------------------------------
# Shapes of the graph: unused parts, several outputs, several roots, dtypes


@pytest.mark.parametrize("mode", [ExecMode.RPC_SYNC, ExecMode.REMOTE], ids=lambda m: m.value)
def test_backward_unused_tensors(rpc_world, mode):
    t1 = torch.rand(3, 3, requires_grad=True)
    t2 = torch.rand(3, 3, requires_grad=True)
    t3 = torch.rand(3, 3, requires_grad=True)

    def forward(ex, t1, t2, t3):
        s = ex(torch.stack, (t1, t2, t3))
        val = ex(torch.matmul, torch.narrow(s, 0, 0, 1), torch.narrow(s, 0, 2, 1))
        return [val.sum()]

    grads = check_against_local(forward, mode, rpc_world.peer(), t1, t2, t3)
    torch.testing.assert_close(grads[t2], torch.zeros(3, 3))


@pytest.mark.parametrize("mode", [ExecMode.RPC_SYNC, ExecMode.REMOTE], ids=lambda m: m.value)
def test_backward_multiple_output_tensors(rpc_world, mode):
    t = torch.rand(10, 2, requires_grad=True)

    def forward(ex, t):
        tensor_list = ex(torch.split, t, 2)
        val = ex(torch.linalg.multi_dot, (tensor_list[0], tensor_list[2], tensor_list[4]))
        return [val.sum()]

    check_against_local(forward, mode, rpc_world.peer(), t)


def test_backward_unused_outputs_of_python_udf(rpc_world):
    """A UDF returns four tensors and the caller uses two: zeros flow for the others."""
    t = torch.rand(4, 3, requires_grad=True)

    def forward(ex, t):
        a, _, _, d = ex(multi_output, t)
        return [(a * d).sum()]

    for mode in REMOTE_MODES:
        check_against_local(forward, mode, rpc_world.peer(), t)


@pytest.mark.parametrize("mode", [ExecMode.RPC_SYNC, ExecMode.REMOTE], ids=lambda m: m.value)
def test_backward_multiple_roots(rpc_world, mode):
    t1 = torch.rand(3, 3, requires_grad=True)
    t2 = torch.rand(3, 3, requires_grad=True)

    def forward(ex, t1, t2):
        return [
            ex(torch.add, t1, t2).sum(),
            ex(torch.mul, t1, t2).sum(),
            ex(torch.cos, t1).sum(),
            ex(torch.div, t1, t2).sum(),
        ]

    check_against_local(forward, mode, rpc_world.peer(), t1, t2)


def test_backward_different_dtypes(rpc_world):
    t1 = torch.rand(3, 3, requires_grad=True, dtype=torch.float32)
    t2 = torch.rand(3, 3, requires_grad=True, dtype=torch.float64)
    for mode in REMOTE_MODES:
        grads = check_against_local(
            lambda ex, a, b: [ex(torch.add, a, b).sum()], mode, rpc_world.peer(), t1, t2
        )
        assert grads[t1].dtype == torch.float32 and grads[t2].dtype == torch.float64


def test_backward_mixed_dtypes_in_one_python_udf(rpc_world):
    t1 = torch.rand(3, 3, requires_grad=True, dtype=torch.float32)
    t2 = torch.rand(3, 3, requires_grad=True, dtype=torch.float64)
    grads = check_against_local(
        lambda ex, a, b: [ex(mul_udf, a, b).sum()], ExecMode.RPC_SYNC, rpc_world.peer(), t1, t2
    )
    assert grads[t1].dtype == torch.float32 and grads[t2].dtype == torch.float64


@pytest.mark.parametrize("mode", REMOTE_MODES, ids=lambda m: m.value)
def test_mixed_requires_grad(rpc_world, mode):
    t1 = torch.rand(3, 3, requires_grad=True)
    t2 = torch.rand(3, 3, requires_grad=False)
    with dist_autograd.context() as context_id:
        ret = exec_func(mode, rpc_world.peer(), mixed_requires_grad_op, t1, t2)
        torch.testing.assert_close(ret, t1 * t2)  # the callee saw t2.requires_grad False
        dist_autograd.backward(context_id, [ret.sum()])
        assert t1.requires_grad and not t2.requires_grad
        grads = dist_autograd.get_gradients(context_id)
        assert t1 in grads and t2 not in grads and len(grads) == 1
        torch.testing.assert_close(grads[t1], t2)


@pytest.mark.parametrize("remote", [False, True], ids=["rpc_sync", "remote"])
def test_grad_only_on_return_value(rpc_world, remote):
    """No argument needs grad; the callee's return value does: its leaf gets the gradient."""
    with dist_autograd.context() as context_id:
        if remote:
            ret = rpc.remote(rpc_world.peer(), ret_requires_grad).to_here()
        else:
            ret = rpc.rpc_sync(rpc_world.peer(), ret_requires_grad)
        assert ret.requires_grad
        dist_autograd.backward(context_id, [ret.sum()])
        assert len(dist_autograd.get_gradients(context_id)) == 0
        n, grad, no_dot_grad = rpc.rpc_sync(
            rpc_world.peer(), callee_grads_of_return_value, (context_id,)
        )
        assert n == 1 and no_dot_grad
        torch.testing.assert_close(grad, torch.ones(3, 3))


# ---------------------------------------------------------------------------
# RRefs


def _backward_rref(world, callee: str, owner: str) -> None:
    t1 = torch.ones(3, 3, requires_grad=True)
    t2 = torch.zeros(3, 3, requires_grad=True)
    local_ret = torch.add(t1, t2)
    local_ret.sum().backward()
    with dist_autograd.context() as context_id:
        rref_t1 = rpc.remote(owner, torch_ones, ((3, 3),), {"requires_grad": True})
        if callee == owner:
            rref = rpc.remote(callee, my_rref_add, (rref_t1, t2))
        else:
            rref = rpc.remote(callee, my_nested_rref_add, (owner, rref_t1, t2))
        ret = rref.to_here()
        torch.testing.assert_close(ret, local_ret)
        dist_autograd.backward(context_id, [ret.sum()])
        grads = dist_autograd.get_gradients(context_id)
        assert t2 in grads
        torch.testing.assert_close(grads[t2], t2.grad)
        # the owner holds the gradient of its value, keyed by rref.local_value()
        grad = rpc.rpc_sync(owner, owner_grad, (context_id, rref_t1))
        assert grad is not None
        torch.testing.assert_close(grad, t1.grad)


def test_backward_rref(rpc_world):
    """Owner and callee are the next worker."""
    _backward_rref(rpc_world, rpc_world.peer(1), rpc_world.peer(1))


def test_backward_rref_nested(rpc_world):
    """Callee next worker, owner the one after (this worker itself with 2 ranks)."""
    _backward_rref(rpc_world, rpc_world.peer(1), rpc_world.peer(2))


@pytest.mark.mpi(min_size=3)
def test_backward_rref_multi(rpc_world):
    """Every rank but 0 uses worker0 as owner and callee at the same time."""
    if rpc_world.rank > 0:
        _backward_rref(rpc_world, "worker0", "worker0")


def test_backward_rref_owned_here_used_remotely(rpc_world):
    """An RRef owned by the caller (``rpc.remote`` to self) passed to ``my_rref_add`` on another
    worker, which fetches nothing: the add runs on the owner through a nested call."""
    t2 = torch.rand(3, 3, requires_grad=True)
    with dist_autograd.context() as context_id:
        rref_t1 = rpc.remote(rpc_world.name, torch_ones, ((3, 3),), {"requires_grad": True})
        assert rref_t1.is_owner()
        ret = rpc.rpc_sync(rpc_world.peer(), my_nested_rref_add, (rpc_world.name, rref_t1, t2))
        dist_autograd.backward(context_id, [(ret * ret).sum()])
        grads = dist_autograd.get_gradients(context_id)
        expected = local_grads(
            lambda ex, a, b: [((a + b) * (a + b)).sum()], torch.ones(3, 3, requires_grad=True), t2
        )
        assert len(grads) == 2
        torch.testing.assert_close(grads[rref_t1.local_value()], expected[0])
        torch.testing.assert_close(grads[t2], expected[1])


def test_trainer_ps(rpc_world):
    """worker0 is a parameter server; every other rank trains in its own context against it
    (``my_rref_add`` on an RRef to the PS's parameter). The PS then holds one context per
    trainer, each with the gradient of that trainer's pass only."""
    world = rpc_world
    _PS_PARAM["w"] = torch.ones(3, 3, requires_grad=True)
    world.barrier()
    t2 = torch.rand(3, 3, requires_grad=True)
    expected_w, expected_t2 = local_grads(
        lambda ex, w, b: [(torch.add(w, b) ** 2).sum()], torch.ones(3, 3, requires_grad=True), t2
    )
    with dist_autograd.context() as context_id:
        if world.rank > 0:
            rref_w = rpc.remote("worker0", ps_param)
            ret = rpc.rpc_sync("worker0", my_rref_add, (rref_w, t2))
            dist_autograd.backward(context_id, [(ret**2).sum()])
            grads = dist_autograd.get_gradients(context_id)
            assert len(grads) == 1
            torch.testing.assert_close(grads[t2], expected_t2)
        everyone = exchange(world, (context_id, t2.detach()))
        if world.rank == 0:
            w = _PS_PARAM["w"]
            for trainer_ctx, trainer_t2 in everyone[1:]:
                grads = dist_autograd.get_gradients(trainer_ctx)
                assert len(grads) == 1 and w in grads
                torch.testing.assert_close(grads[w], 2 * (w.detach() + trainer_t2))
            assert w.grad is None
        else:  # the same, asked by the trainer through an RPC
            torch.testing.assert_close(rpc.rpc_sync("worker0", ps_grad, (context_id,)), expected_w)
        world.barrier()
    world.barrier()
    _PS_PARAM.clear()


# ---------------------------------------------------------------------------
# Accumulation and retain_graph


def test_backward_accumulate_grads(rpc_world):
    t1 = torch.rand(3, 3, requires_grad=True)
    t2 = torch.rand(3, 3, requires_grad=True)
    with dist_autograd.context() as context_id:
        t3 = torch.matmul(t1, t2)
        torch.autograd.backward([t3.sum()], retain_graph=True)
        torch.autograd.backward([t3.sum()])
        t3 = rpc.rpc_sync(rpc_world.peer(), torch.matmul, (t1, t2))
        dist_autograd.backward(context_id, [t3.sum()], retain_graph=True)
        dist_autograd.backward(context_id, [t3.sum()])
        grads = dist_autograd.get_gradients(context_id)
        assert len(grads) == 2
        torch.testing.assert_close(grads[t1], t1.grad)
        torch.testing.assert_close(grads[t2], t2.grad)


def test_nested_backward_accumulate_grads(rpc_world):
    t1 = torch.rand(3, 3, requires_grad=True)
    t2 = torch.rand(3, 3, requires_grad=True)
    expected = local_grads(lambda ex, a, b: [nested_python_udf(a, b, None).sum()], t1, t2)
    with dist_autograd.context() as context_id:
        loss = rpc.rpc_sync(rpc_world.peer(1), nested_python_udf, (t1, t2, rpc_world.peer(2))).sum()
        dist_autograd.backward(context_id, [loss], retain_graph=True)
        dist_autograd.backward(context_id, [loss])
        grads = dist_autograd.get_gradients(context_id)
        assert_grads_match(grads, [t1, t2], [2 * e for e in expected])


def test_multiple_backward(rpc_world):
    t1 = torch.rand(3, 3, requires_grad=True, dtype=torch.float64)
    t2 = torch.rand(3, 3, requires_grad=True, dtype=torch.float64)
    expected = local_grads(lambda ex, a, b: [(a * b).sum()], t1, t2)
    n = 100
    with dist_autograd.context() as context_id:
        loss = rpc.rpc_sync(rpc_world.peer(), mul_udf, (t1, t2)).sum()
        for _ in range(n):
            dist_autograd.backward(context_id, [loss], retain_graph=True)
        assert_grads_match(
            dist_autograd.get_gradients(context_id), [t1, t2], [n * e for e in expected]
        )


def test_forward_and_backward_repeated_in_one_context_accumulate(rpc_world):
    """Gradient accumulation: several forward/backward pairs (no retain_graph) in one context.

    Each pass takes only the sends of its own forward: the earlier forwards' sends
    ran already and freed their graphs."""
    world = rpc_world
    t1 = torch.rand(3, 3, requires_grad=True)
    t2 = torch.rand(3, 3, requires_grad=True)
    batches = [torch.rand(3, 3) for _ in range(3)]

    def forward(ex, a, b, x):
        return [(ex(nested_python_udf, a * x, b, None) * b).sum()]

    expected = [torch.zeros(3, 3), torch.zeros(3, 3)]
    for x in batches:
        for acc, g in zip(
            expected, local_grads(lambda ex, a, b, x=x: forward(ex, a, b, x), t1, t2), strict=True
        ):
            acc += g
    with dist_autograd.context() as context_id:
        for x in batches:
            loss = (
                rpc.rpc_sync(world.peer(1), nested_python_udf, (t1 * x, t2, world.peer(2))) * t2
            ).sum()
            dist_autograd.backward(context_id, [loss])
        assert_grads_match(dist_autograd.get_gradients(context_id), [t1, t2], expected)


@pytest.mark.parametrize("where", ["remote", "local"])
def test_second_pass_without_retain_graph_fails(rpc_world, where):
    """Saved tensors are freed after a pass without retain_graph, on every worker."""
    t1 = torch.rand(3, 3, requires_grad=True)
    t2 = torch.rand(3, 3, requires_grad=True)
    with dist_autograd.context() as context_id:
        if where == "remote":  # saved tensors only on the peer (MulBackward0 there)
            loss = rpc.rpc_sync(rpc_world.peer(), torch.mul, (t1, t2)).sum()
            node = rpc_world.peer_rank()
        else:  # saved tensors only here
            loss = (rpc.rpc_sync(rpc_world.peer(), torch.add, (t1, t2)) * t1).sum()
            node = rpc_world.rank
        dist_autograd.backward(context_id, [loss], retain_graph=True)
        dist_autograd.backward(context_id, [loss], retain_graph=True)
        dist_autograd.backward(context_id, [loss])
        with pytest.raises(RuntimeError, match=SECOND_TIME) as info:
            dist_autograd.backward(context_id, [loss])
        assert f"Error on Node {node}" in str(info.value)
        grads = dist_autograd.get_gradients(context_id)
        expected = local_grads(
            (lambda ex, a, b: [(a * b).sum()])
            if where == "remote"
            else (lambda ex, a, b: [((a + b) * a).sum()]),
            t1,
            t2,
        )
        # three complete passes; the failed one added nothing
        assert_grads_match(grads, [t1, t2], [3 * e for e in expected])


def test_retain_graph_reaches_every_worker_of_a_long_chain(rpc_world):
    """Saved tensors on every worker of the chain; retained passes all succeed, then one plain
    pass, then a failing one."""
    t1 = torch.rand(3, 3, requires_grad=True)
    w = torch.rand(3, 3, requires_grad=True)
    with dist_autograd.context() as context_id:
        val = t1
        for d in range(1, rpc_world.size + 1):
            val = rpc.rpc_sync(rpc_world.peer(d), torch.mul, (val, w))
        loss = val.sum()
        for _ in range(3):
            dist_autograd.backward(context_id, [loss], retain_graph=True)
        dist_autograd.backward(context_id, [loss])
        with pytest.raises(RuntimeError, match=SECOND_TIME):
            dist_autograd.backward(context_id, [loss])

        def forward(ex, t1, w):
            val = t1
            for _ in range(rpc_world.size):
                val = val * w
            return [val.sum()]

        expected = local_grads(forward, t1, w)
        assert_grads_match(
            dist_autograd.get_gradients(context_id), [t1, w], [4 * e for e in expected]
        )


# ---------------------------------------------------------------------------
# Hooks


@pytest.mark.parametrize("mode", [ExecMode.RPC_SYNC, ExecMode.REMOTE], ids=lambda m: m.value)
def test_backward_verify_hooks(rpc_world, mode):
    t1 = torch.ones(3, 3, requires_grad=True)
    t1.register_hook(lambda grad: grad * 2)
    t2 = torch.ones(3, 3, requires_grad=True)
    c1, c2 = t1.detach().clone().requires_grad_(), t2.detach().clone().requires_grad_()
    c1.register_hook(lambda grad: grad * 2)
    torch.matmul(c1, c2).sum().backward()
    with dist_autograd.context() as context_id:
        loss = exec_func(mode, rpc_world.peer(), torch.matmul, t1, t2).sum()
        dist_autograd.backward(context_id, [loss])
        assert_grads_match(dist_autograd.get_gradients(context_id), [t1, t2], [c1.grad, c2.grad])


def test_hook_runs_once_with_full_gradient_local_and_remote(rpc_world):
    """t1 gets gradients locally and through two RPCs: its hook runs once per pass, with the
    sum, exactly as in local autograd."""

    def make(t):
        seen = []

        def hook(grad):
            seen.append(grad.clone())
            return grad * 3

        t.register_hook(hook)
        return seen

    t1 = torch.rand(3, 3, requires_grad=True)
    t2 = torch.rand(3, 3, requires_grad=True)
    c1, c2 = t1.detach().clone().requires_grad_(), t2.detach().clone().requires_grad_()
    seen_local = make(c1)
    seen_local2 = make(c2)

    def forward(ex, a, b):
        x = ex(torch.mul, a, b)  # a via an RPC
        y = ex(my_py_add, a, x)  # a via another RPC, and x
        return [(a * 2 + y * a).sum()]  # a locally, twice

    forward(lambda fn, *args: fn(*args), c1, c2)[0].backward()
    assert len(seen_local) == 1 and len(seen_local2) == 1

    seen = make(t1)
    seen2 = make(t2)
    with dist_autograd.context() as context_id:
        loss = forward(lambda fn, *args: rpc.rpc_sync(rpc_world.peer(), fn, args), t1, t2)[0]
        dist_autograd.backward(context_id, [loss], retain_graph=True)
        assert len(seen) == 1 and len(seen2) == 1, "a leaf hook must run exactly once per pass"
        torch.testing.assert_close(seen[0], seen_local[0])
        torch.testing.assert_close(seen2[0], seen_local2[0])
        grads = dist_autograd.get_gradients(context_id)
        torch.testing.assert_close(grads[t1], c1.grad)
        torch.testing.assert_close(grads[t2], c2.grad)
        dist_autograd.backward(context_id, [loss])
        assert len(seen) == 2 and len(seen2) == 2
        torch.testing.assert_close(seen[1], seen_local[0])
        torch.testing.assert_close(dist_autograd.get_gradients(context_id)[t1], 2 * c1.grad)
    assert t1.grad is None and t2.grad is None


def test_hook_on_a_leaf_reached_through_a_nested_round_trip(rpc_world):
    """The gradient of t1 comes back here in two parts, at different times (one through a
    nested RPC chain): the hook still runs once with the sum."""
    seen = []
    t1 = torch.rand(3, 3, requires_grad=True)
    t1.register_hook(lambda g: seen.append(g.clone()))
    t2 = torch.rand(3, 3, requires_grad=True)
    expected = local_grads(lambda ex, a, b: [(nested_python_udf(a, b, None) * a).sum()], t1, t2)
    with dist_autograd.context() as context_id:
        ret = rpc.rpc_sync(rpc_world.peer(1), nested_python_udf, (t1, t2, rpc_world.peer(2)))
        dist_autograd.backward(context_id, [(ret * t1).sum()])
        assert len(seen) == 1
        torch.testing.assert_close(seen[0], expected[0])
        assert_grads_match(dist_autograd.get_gradients(context_id), [t1, t2], expected)


class RecordBackwardThread(torch.autograd.Function):
    """Identity whose backward notes the thread it runs on."""

    threads: list[str] = []

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        RecordBackwardThread.threads.append(threading.current_thread().name)
        return grad


def test_gradients_coming_back_to_the_root_run_on_the_thread_that_waits(rpc_world):
    """The root's part after a round trip (here a custom backward) runs on the thread that
    called backward, as torch runs a local graph, not on a worker thread: it is the
    work that thread waits for."""
    RecordBackwardThread.threads.clear()
    t1 = torch.rand(3, 3, requires_grad=True)
    with dist_autograd.context() as context_id:
        sent = RecordBackwardThread.apply(t1)
        loss = rpc.rpc_sync(rpc_world.peer(), torch.mul, (sent, 3)).sum()
        dist_autograd.backward(context_id, [loss])
        torch.testing.assert_close(
            dist_autograd.get_gradients(context_id)[t1], torch.full((3, 3), 3.0)
        )
    assert RecordBackwardThread.threads == [threading.current_thread().name]


#: Set on the caller when the callee's backward of the caller's RPC has run.
_callee_backward_ran = threading.Event()


def note_callee_backward_ran() -> None:
    _callee_backward_ran.set()


class TellCallerOnBackward(torch.autograd.Function):
    """Identity whose backward (on the callee) tells ``caller`` that it ran."""

    @staticmethod
    def forward(ctx, x, caller):
        ctx.caller = caller
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        rpc.rpc_async(ctx.caller, note_callee_backward_ran)
        return grad, None


def double_telling_caller_on_backward(x: torch.Tensor, caller: str) -> torch.Tensor:
    return TellCallerOnBackward.apply(x, caller) * 2


class WaitForCalleeBackward(torch.autograd.Function):
    """Identity whose backward waits (at most 10 s) for the callee's backward and notes
    whether it came."""

    seen: list[bool] = []

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        WaitForCalleeBackward.seen.append(_callee_backward_ran.wait(scaled(10)))
        return grad


def test_an_rpc_results_gradient_leaves_before_local_work_that_does_not_feed_it(rpc_world):
    """The gradient of an RPC's result goes to the callee as soon as it is known: the
    callee's backward runs while the caller still runs the local branch beside it."""
    _callee_backward_ran.clear()
    WaitForCalleeBackward.seen.clear()
    x = torch.rand(3, requires_grad=True)
    with dist_autograd.context() as context_id:
        remote = rpc.rpc_sync(
            rpc_world.peer(), double_telling_caller_on_backward, (x, rpc_world.name)
        )
        loss = (remote + WaitForCalleeBackward.apply(x)).sum()
        dist_autograd.backward(context_id, [loss])
        grad = dist_autograd.get_gradients(context_id)[x]
    assert WaitForCalleeBackward.seen == [True]
    torch.testing.assert_close(grad, torch.full((3,), 3.0))


@pytest.mark.parametrize(
    ("weight", "root_calls"),
    [(lambda w: w, 1), (lambda w: w.exp(), 2)],
    ids=["weight-transposes-join-the-call", "work-beside-the-recv-is-split-off"],
)
def test_weight_transposes_run_in_the_native_call_that_finishes_an_rpc_result(
    rpc_world, monkeypatch, weight, root_calls
):
    """Local linear layers over an RPC's result: their weights' transposes (views of a
    gradient, no work for the callee to overlap) run in the root's one native call with the
    layers. Work beside the recv (here ``exp`` of a weight) still runs in a call of its own,
    after the recv's gradient left. Gradients are local autograd's either way."""
    calls = []
    root_thread = threading.local()
    native_grad = dist_autograd._pass.native_grad
    deliver_roots = dist_autograd._pass.Pass.deliver_roots

    def counting_native_grad(*args):
        calls.append(getattr(root_thread, "in_roots", False))
        return native_grad(*args)

    def counting_deliver_roots(self, *args):
        root_thread.in_roots = True
        try:
            return deliver_roots(self, *args)
        finally:
            root_thread.in_roots = False

    monkeypatch.setattr(dist_autograd._pass, "native_grad", counting_native_grad)
    monkeypatch.setattr(dist_autograd._pass.Pass, "deliver_roots", counting_deliver_roots)
    torch.manual_seed(rpc_world.rank)
    x = torch.rand(4, 3, requires_grad=True)
    layers = [
        (torch.rand(3, 3, requires_grad=True), torch.rand(3, requires_grad=True)) for _ in range(2)
    ]

    def loss_of(h):
        for w, b in layers:
            h = F.linear(h, weight(w), b)
        return h.sum()

    leaves = [x, *(t for layer in layers for t in layer)]
    expected = torch.autograd.grad(loss_of(torch.add(x, x)), leaves)
    with dist_autograd.context() as context_id:
        loss = loss_of(rpc.rpc_sync(rpc_world.peer(), torch.add, (x, x)))
        dist_autograd.backward(context_id, [loss])
        grads = dist_autograd.get_gradients(context_id)
    assert calls.count(True) == root_calls
    for leaf, e in zip(leaves, expected, strict=True):
        torch.testing.assert_close(grads[leaf], e)


def test_post_hooks(rpc_world):
    calls = []
    t = torch.rand(10, 10, requires_grad=True)
    a = t + t
    acc = a.grad_fn.next_functions[0][0]
    assert acc is a.grad_fn.next_functions[1][0]
    acc.register_hook(lambda grad_inputs, grad_outputs: calls.append(1))
    acc.register_hook(lambda grad_inputs, grad_outputs: calls.append(2))
    acc.register_hook(lambda grad_inputs, grad_outputs: calls.append(2))
    with dist_autograd.context() as context_id:
        dist_autograd.backward(context_id, [a.sum()])
        assert sum(calls) == 5
        grads = dist_autograd.get_gradients(context_id)
        assert len(grads) == 1 and t in grads
        torch.testing.assert_close(grads[t], 2 * torch.ones(10, 10))


def test_post_hooks_see_the_whole_gradient_once_after_it_is_accumulated(rpc_world):
    """A leaf fed locally and through an RPC: its tensor hook runs first, then its
    AccumulateGrad node's post-hooks, once, with the whole gradient, as local autograd
    runs them."""

    def build(t, dst):
        local = t * 3
        remote = local if dst is None else rpc.rpc_sync(dst, torch.mul, (t, 3.0))
        return (local + remote * remote).sum()

    def record(t, seen, context_id=None):
        """Hooks on ``t``; returns its AccumulateGrad node, which lives while referenced."""
        t.register_hook(lambda grad: grad * 10)
        acc = (t * 1).grad_fn.next_functions[0][0]

        def post_hook(grad_inputs, grad_outputs):
            accumulated = dist_autograd.get_gradients(context_id)[t] if context_id else None
            seen.append((grad_inputs, grad_outputs[0].clone(), accumulated))

        acc.register_hook(post_hook)
        return acc

    values = torch.rand(4)
    expected_seen = []
    local_t = values.clone().requires_grad_()
    local_acc = record(local_t, expected_seen)
    build(local_t, None).backward()

    t = values.clone().requires_grad_()
    seen = []
    with dist_autograd.context() as context_id:
        acc = record(t, seen, context_id)
        dist_autograd.backward(context_id, [build(t, rpc_world.peer())])
        grad = dist_autograd.get_gradients(context_id)[t]
    assert len(expected_seen) == 1 and len(seen) == 1, (local_acc, acc)
    expected_inputs, expected_grad, _ = expected_seen[0]
    grad_inputs, hook_grad, accumulated = seen[0]
    assert grad_inputs == expected_inputs == ()
    torch.testing.assert_close(hook_grad, expected_grad)
    torch.testing.assert_close(accumulated, hook_grad)
    torch.testing.assert_close(grad, local_t.grad)


# ---------------------------------------------------------------------------
# RRef.backward


def test_owner_rref_backward(rpc_world):
    dst = rpc_world.peer()
    t1 = torch.rand(10, 10, requires_grad=True)
    expected = 2 * torch.ones_like(t1)
    rref = rpc.RRef(t1.sum() + t1.sum())
    rref.backward()  # owner, no context: plain local autograd into .grad
    torch.testing.assert_close(t1.grad, expected)

    with dist_autograd.context() as context_id:
        t2 = rpc.rpc_sync(dst, torch.add, (t1, t1))
        rpc.RRef(t2.sum()).backward(context_id)
        torch.testing.assert_close(dist_autograd.get_gradients(context_id)[t1], expected)

    with dist_autograd.context() as context_id:
        t2 = rpc.rpc_sync(dst, torch.add, (t1, t1))
        rref = rpc.RRef(t2.sum())
        rref.backward(context_id, retain_graph=True)
        rref.backward(context_id)
        torch.testing.assert_close(dist_autograd.get_gradients(context_id)[t1], 2 * expected)
    torch.testing.assert_close(t1.grad, expected)  # the distributed passes left .grad alone

    with pytest.raises(RuntimeError, match="does not require grad and does not have a grad_fn"):
        rpc.RRef(torch.rand(10)).backward()
    with pytest.raises(
        RuntimeError, match="grad can be implicitly created only for scalar outputs"
    ):
        rpc.RRef(torch.rand(10, requires_grad=True)).backward()
    with pytest.raises(RuntimeError, match="Could not find autograd context with id: 100"):
        rpc.RRef(torch.rand(10, requires_grad=True).sum()).backward(100)
    with pytest.raises(RuntimeError, match=r"RRef should contain a tensor for \.backward\(\)"):
        rpc.RRef("foo").backward()


def test_user_rref_backward(rpc_world):
    dst = rpc_world.peer()
    t = torch.rand(10, requires_grad=True)
    with dist_autograd.context() as context_id:
        rref = rpc.remote(dst, rref_sum, (t,))
        rref.backward(context_id, retain_graph=True)
        rref.backward(context_id)
        torch.testing.assert_close(
            dist_autograd.get_gradients(context_id)[t], torch.ones_like(t) * 2
        )
    assert t.grad is None

    with dist_autograd.context() as context_id:
        rref = rpc.remote(dst, identity, ("foo",))
        with pytest.raises(RuntimeError, match=r"RRef should contain a tensor for \.backward\(\)"):
            rref.backward(context_id)
        with pytest.raises(
            RuntimeError, match="User RRefs require 'dist_autograd_ctx_id' to be specified"
        ):
            rref.backward()


def test_user_rref_backward_through_a_third_worker(rpc_world):
    """The owner's value depends on t through an RPC: the owner's pass ships gradients back."""
    t = torch.rand(4, requires_grad=True)
    with dist_autograd.context() as context_id:
        x = rpc.rpc_sync(rpc_world.peer(2), mul_udf, (t, t))  # self with 2 ranks
        rref = rpc.remote(rpc_world.peer(1), rref_sum, (x,))
        rref.backward(context_id)
        torch.testing.assert_close(dist_autograd.get_gradients(context_id)[t], 2 * t.detach())
