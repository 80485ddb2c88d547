"""Sparse tensors in distributed autograd: recorded, differentiated, accumulated, optimized.

Ported from torch's sparse ``TensorPipeAgentDistAutogradTest`` cases (sparse COO
arguments that require grad through every kind of call, nested calls, RRefs, a
trainer / parameter-server exchange, an ``EmbeddingBag(sparse=True)`` on another
worker) plus CSR tensors, AccumulateGrad's copy rule in the context, and several
trainers updating one sparse table through :class:`DistributedOptimizer`. Every
gradient and parameter is compared with plain local PyTorch on the same values.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from _dist_utils import (
    REMOTE_MODES,
    SETTLE_TIMEOUT_S,
    ExecMode,
    Rotation,
    assert_grads_match,
    exchange,
    exec_func,
    get_flag,
    local_grads,
    my_nested_rref_add,
    my_py_add,
    my_py_nested_call,
    my_rref_add,
    owner_grad,
    set_flag,
    wait_until,
)

import lightning_distgrad.autograd as dist_autograd
from lightning_distgrad import rpc
from lightning_distgrad.optim import DistributedOptimizer

pytestmark = [
    pytest.mark.mpi(min_size=2),
    # torch warns once per process that sparse invariant checks are off by default.
    pytest.mark.filterwarnings("ignore:Sparse invariant checks"),
]


# ---------------------------------------------------------------------------
# Remote functions and values


def sparse_leaf(seed: int, requires_grad: bool = True, dtype=torch.float32) -> torch.Tensor:
    """A 3x3 sparse COO tensor, not coalesced, with values drawn from ``seed``."""
    values = torch.rand(4, generator=torch.Generator().manual_seed(seed)) + 0.5
    indices = [[0, 1, 1, 0], [2, 0, 2, 2]]  # (0, 2) twice
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = torch.sparse_coo_tensor(indices, values, (3, 3), dtype=dtype)
    return t.requires_grad_(requires_grad)


def sparse_sum(t: torch.Tensor) -> torch.Tensor:
    return torch.sparse.sum(t)


def mixed_requires_grad_op(t1, t2):
    # the callee must see exactly the requires_grad flags of the caller
    if t2.requires_grad:
        return t1 - t2
    return t1 * t2


def nested_python_udf(t1, t2, dst):
    t3 = t1 * t2
    t4 = t1 + t2
    res = rpc.rpc_sync(dst, my_py_add, (t3, t4)) if dst is not None else my_py_add(t3, t4)
    return t1 * t2 * t3 * t4 * res


def call_module(module_rref, *args):
    return module_rref.local_value()(*args)


def module_weight_grad(module_rref, context_id):
    return dist_autograd.get_gradients(context_id).get(module_rref.local_value().weight)


def module_weight(module_rref):
    return module_rref.local_value().weight.detach().clone()


def parameter_rrefs(module_rref):
    return [rpc.RRef(p) for p in module_rref.local_value().parameters()]


def check_sparse_grads(grads: dict, leaves, expected) -> None:
    """``assert_grads_match``, and every gradient of a sparse leaf is sparse (as torch's)."""
    assert_grads_match(grads, leaves, expected)
    for leaf in leaves:
        if leaf in grads:
            assert grads[leaf].layout == leaf.layout, f"{grads[leaf].layout} for {leaf.layout}"


def dist_grads(world, forward, mode, dst_of, *leaves, recorded=None):
    """``forward`` through ``mode`` in a context; backward; returns the context's gradients.

    ``recorded``: how many send and how many recv functions the context must hold here.
    """
    with dist_autograd.context() as context_id:
        roots = forward(lambda fn, *a: exec_func(mode, dst_of(), fn, *a), *leaves)
        if recorded is not None:
            ctx = dist_autograd._current_context()
            assert len(ctx._send_functions()) == recorded, "send functions recorded"
            assert len(ctx._recv_functions()) == recorded, "recv functions recorded"
        dist_autograd.backward(context_id, roots)
        return dist_autograd.get_gradients(context_id)


# ---------------------------------------------------------------------------
# Calls of every kind


@pytest.mark.parametrize("mode", REMOTE_MODES, ids=lambda m: m.value)
@pytest.mark.parametrize("fn", [torch.add, my_py_add], ids=["builtin", "python"])
@pytest.mark.parametrize("to_self", [False, True], ids=["peer", "self"])
def test_sparse_arguments_are_recorded_and_differentiated(rpc_world, mode, fn, to_self):
    t1, t2 = sparse_leaf(rpc_world.rank), sparse_leaf(rpc_world.rank + 10)
    dst = rpc_world.name if to_self else rpc_world.peer()

    def forward(ex, a, b):
        out = ex(fn, a, b)
        assert out.is_sparse and out.requires_grad and out.grad_fn is not None
        return [torch.sparse.sum(out)]

    expected = local_grads(forward, t1, t2)
    # One RPC to a peer: one send and one recv function here (a call to itself holds
    # both sides of it here; its gradients tell whether it was recorded).
    recorded = None if to_self else 1
    grads = dist_grads(rpc_world, forward, mode, lambda: dst, t1, t2, recorded=recorded)
    check_sparse_grads(grads, [t1, t2], expected)
    assert t1.grad is None and t2.grad is None


def csr_leaf(seed: int) -> torch.Tensor:
    dense = torch.rand(3, 4, generator=torch.Generator().manual_seed(seed))
    with warnings.catch_warnings():  # compressed layouts are "beta" in torch
        warnings.simplefilter("ignore")
        return (dense * (dense > 0.4)).to_sparse_csr().requires_grad_()


def scaled_dense(t, k):
    return (t * k).to_dense()


@pytest.mark.parametrize("mode", REMOTE_MODES, ids=lambda m: m.value)
def test_csr_arguments_and_results_are_differentiated(rpc_world, mode):
    """CSR both ways: a CSR result that requires grad, and a CSR argument whose CSR
    gradient comes back."""
    c1, c2 = csr_leaf(rpc_world.rank), csr_leaf(rpc_world.rank + 1)

    def forward(ex, a, b):
        out = ex(torch.mul, a, 2.0)
        assert out.layout == torch.sparse_csr and out.requires_grad
        return [out.to_dense().sum() + ex(scaled_dense, b, 3.0).pow(2).sum()]

    expected = local_grads(forward, c1, c2)
    grads = dist_grads(rpc_world, forward, mode, rpc_world.peer, c1, c2)
    check_sparse_grads(grads, [c1, c2], expected)


def test_sparse_arguments_without_grad_record_nothing(rpc_world):
    t1, t2 = sparse_leaf(1, requires_grad=False), sparse_leaf(2, requires_grad=False)
    for mode in (ExecMode.RPC_SYNC, ExecMode.REMOTE):
        with dist_autograd.context():
            out = exec_func(mode, rpc_world.peer(), torch.add, t1, t2)
            assert out.is_sparse and not out.requires_grad
            torch.testing.assert_close(out, torch.add(t1, t2))
            ctx = dist_autograd._current_context()
            assert not ctx._send_functions() and not ctx._recv_functions()


def test_only_the_sparse_arguments_that_require_grad_are_recorded(rpc_world):
    """torch's ``_test_rpc_complex_args``: a list of ten, every other one requiring grad."""
    tensors = [sparse_leaf(i, requires_grad=i % 2 == 0) for i in range(10)]
    for mode in (ExecMode.RPC_SYNC, ExecMode.REMOTE):
        with dist_autograd.context():
            out = exec_func(mode, rpc_world.peer(), torch.stack, tensors)
            torch.testing.assert_close(out, torch.stack(tensors))
            (send,) = dist_autograd._current_context()._send_functions().values()
            leaves = [node.variable for node, _ in send.next_functions]
            assert len(leaves) == 5 and all(
                a is b for a, b in zip(leaves, tensors[::2], strict=True)
            )


@pytest.mark.parametrize("mode", [ExecMode.RPC_SYNC, ExecMode.REMOTE], ids=lambda m: m.value)
def test_sparse_multiple_round_trips(rpc_world, mode):
    """torch's ``_backward_multiple_round_trips`` (sparse): every hop to the next worker."""
    t1, t3, t5 = (sparse_leaf(rpc_world.rank * 7 + i) for i in (1, 3, 5))
    t2, t4 = (sparse_leaf(i, requires_grad=False) for i in (2, 4))

    def forward(ex, t1, t2, t3, t4, t5):
        val = ex(torch.add, t1, t2)
        val = ex(torch.mul, t3, val)
        s1 = ex(torch.stack, (t4, val))
        s2 = ex(torch.stack, (t5, val))
        val = ex(torch.mul, s1, s2)
        val = ex(torch.mul, val, val)
        return [torch.sparse.sum(val)]

    leaves = [t1, t2, t3, t4, t5]
    expected = local_grads(forward, *leaves)
    rotation = Rotation(rpc_world, include_self=True)
    grads = dist_grads(rpc_world, forward, mode, rotation.next, *leaves)
    check_sparse_grads(grads, leaves, expected)


def test_sparse_different_dtypes(rpc_world):
    t1 = sparse_leaf(1, dtype=torch.float32)
    t2 = sparse_leaf(2, dtype=torch.float64)

    def forward(ex, a, b):
        return [torch.sparse.sum(ex(torch.add, a, b))]

    expected = local_grads(forward, t1, t2)
    for mode in REMOTE_MODES:
        grads = dist_grads(rpc_world, forward, mode, rpc_world.peer, t1, t2)
        check_sparse_grads(grads, [t1, t2], expected)
        assert grads[t1].dtype == torch.float32 and grads[t2].dtype == torch.float64


def test_sparse_mixed_requires_grad(rpc_world):
    t1, t2 = sparse_leaf(1), sparse_leaf(2, requires_grad=False)
    for mode in (ExecMode.RPC_SYNC, ExecMode.REMOTE):
        with dist_autograd.context() as context_id:
            ret = exec_func(mode, rpc_world.peer(), mixed_requires_grad_op, t1, t2)
            torch.testing.assert_close(ret, t1 * t2)
            dist_autograd.backward(context_id, [torch.sparse.sum(ret)])
            grads = dist_autograd.get_gradients(context_id)
            assert list(grads) == [t1]
            torch.testing.assert_close(grads[t1].to_dense(), t2.to_dense())


def test_sparse_nested_python_udf(rpc_world):
    """torch's ``_backwards_nested_python_udf`` (sparse): the UDF makes an RPC itself."""
    t1, t2 = sparse_leaf(1), sparse_leaf(2)
    expected = local_grads(
        lambda ex, a, b: [torch.sparse.sum(nested_python_udf(a, b, None))], t1, t2
    )
    grads = dist_grads(
        rpc_world,
        lambda ex, a, b: [torch.sparse.sum(ex(nested_python_udf, a, b, rpc_world.peer(2)))],
        ExecMode.RPC_SYNC,
        rpc_world.peer,
        t1,
        t2,
    )
    check_sparse_grads(grads, [t1, t2], expected)


@pytest.mark.parametrize("hops", ["chain", "back to self"])
@pytest.mark.parametrize("mode", [ExecMode.RPC_SYNC, ExecMode.REMOTE], ids=lambda m: m.value)
def test_sparse_nested_calls(rpc_world, mode, hops):
    """torch's ``_test_graph_for_py_nested_call`` and ``..._itself`` (sparse), checked by
    their gradients: A -> B -> C -> D runs the add (or A -> B -> A)."""
    t1, t2 = sparse_leaf(rpc_world.rank), sparse_leaf(rpc_world.rank + 1)
    if hops == "chain":
        path = [rpc_world.peer(2), rpc_world.peer(3)]
    else:
        path = [rpc_world.name]

    def forward(ex, a, b):
        if ex is None:
            return [torch.sparse.sum(my_py_add(a, b))]
        return [torch.sparse.sum(ex(my_py_nested_call, a, b, path))]

    expected = local_grads(lambda ex, a, b: forward(None, a, b), t1, t2)
    grads = dist_grads(rpc_world, forward, mode, rpc_world.peer, t1, t2)
    check_sparse_grads(grads, [t1, t2], expected)


def test_sparse_gradients_accumulate_over_passes(rpc_world):
    """Two passes with retain_graph: the context holds the sum (torch's
    ``_nested_backward_accumulate_grads`` and ``_multiple_backward``, sparse)."""
    t1, t2 = sparse_leaf(1), sparse_leaf(2)
    expected = local_grads(lambda ex, a, b: [torch.sparse.sum(torch.add(a, b))], t1, t2)
    with dist_autograd.context() as context_id:
        loss = torch.sparse.sum(rpc.rpc_sync(rpc_world.peer(), torch.add, (t1, t2)))
        for _ in range(3):
            dist_autograd.backward(context_id, [loss], retain_graph=True)
        grads = dist_autograd.get_gradients(context_id)
        check_sparse_grads(grads, [t1, t2], [3 * e for e in expected])


def test_sparse_backward_leaves_dot_grad_alone(rpc_world):
    """torch's ``_backward_no_grad_on_tensor`` (sparse)."""
    t1, t2 = sparse_leaf(1), sparse_leaf(2)
    with dist_autograd.context() as context_id:
        loss = torch.sparse.sum(rpc.rpc_sync(rpc_world.peer(), torch.add, (t1, t2)))
        dist_autograd.backward(context_id, [loss], retain_graph=True)
        assert t1.grad is None and t2.grad is None
        torch.sparse.sum(torch.add(t1, t2)).backward()
        before = t1.grad
        dist_autograd.backward(context_id, [loss])
        assert t1.grad is before
        torch.testing.assert_close(dist_autograd.get_gradients(context_id)[t1], 2 * before)


# ---------------------------------------------------------------------------
# RRefs and the parameter-server exchange


@pytest.mark.parametrize("owner", ["callee", "third worker"])
def test_sparse_rref_value_gets_its_gradient_on_its_owner(rpc_world, owner):
    """torch's ``_backward_rref`` (sparse): t1 lives on its owner, t2 here."""
    world = rpc_world
    callee = world.peer(1)
    rref_owner = callee if owner == "callee" else world.peer(2)
    t1, t2 = sparse_leaf(100), sparse_leaf(world.rank)
    torch.sparse.sum(torch.add(t1, t2)).backward()  # the local reference
    with dist_autograd.context() as context_id:
        rref_t1 = rpc.remote(rref_owner, sparse_leaf, args=(100,))
        if rref_owner == callee:
            rref = rpc.remote(callee, my_rref_add, args=(rref_t1, t2))
        else:
            rref = rpc.remote(callee, my_nested_rref_add, args=(rref_owner, rref_t1, t2))
        ret = torch.sparse.sum(rref.to_here())
        dist_autograd.backward(context_id, [ret])
        grads = dist_autograd.get_gradients(context_id)
        torch.testing.assert_close(grads[t2], t2.grad)
        assert grads[t2].is_sparse
        on_owner = rpc.rpc_sync(rref_owner, owner_grad, args=(context_id, rref_t1))
        assert on_owner is not None and on_owner.is_sparse
        torch.testing.assert_close(on_owner, t1.grad)


def ps_record_context(key, context_id):
    set_flag(("context", key), context_id)


def ps_wait_verified(key) -> bool:
    return wait_until(lambda: get_flag(("verified", key), False))


def ps_trainer(rref_t1, t2, ps: str, key) -> bool:
    """torch's ``_run_trainer``: one pass through the parameter server, then hold the
    context until the server checked its gradient there."""
    with dist_autograd.context() as context_id:
        ret = rpc.rpc_sync(ps, my_rref_add, args=(rref_t1, t2))
        dist_autograd.backward(context_id, [torch.sparse.sum(ret)])
        rpc.rpc_sync(ps, ps_record_context, args=(key, context_id))
        return rpc.rpc_sync(ps, ps_wait_verified, args=(key,))


def test_sparse_trainer_parameter_server_exchange(rpc_world):
    """torch's ``test_trainer_ps_sparse``: every worker is a parameter server whose
    sparse tensor the other workers train at once, in separate contexts."""
    world = rpc_world
    t1, t2 = sparse_leaf(world.rank), sparse_leaf(world.rank + 50)
    torch.sparse.sum(torch.add(t1, t2)).backward()
    rref_t1 = rpc.remote(world.name, sparse_leaf, args=(world.rank,))
    distances = range(1, world.size)
    keys = [(world.rank, d) for d in distances]
    futures = [
        rpc.rpc_async(world.peer(d), ps_trainer, args=(rref_t1, t2, world.name, key))
        for d, key in zip(distances, keys, strict=True)
    ]
    assert wait_until(lambda: all(get_flag(("context", k)) is not None for k in keys)), (
        f"trainers did not finish their backward passes within {SETTLE_TIMEOUT_S} s"
    )
    local_t1 = rref_t1.to_here()
    assert local_t1 is rref_t1.local_value()
    for key in keys:
        grads = dist_autograd.get_gradients(get_flag(("context", key)))
        assert local_t1 in grads and grads[local_t1].is_sparse
        torch.testing.assert_close(grads[local_t1], t1.grad)
    for key in keys:
        set_flag(("verified", key), True)
    assert all(f.wait() for f in futures)
    for key in keys:
        set_flag(("context", key), None)
        set_flag(("verified", key), None)


# ---------------------------------------------------------------------------
# Embeddings with sparse gradients


def test_remote_embedding_bag_sparse_gradients_accumulate_in_the_context(rpc_world):
    """torch's ``test_embedding_bag_with_no_grad_tensors``: only the per-sample weights
    require grad here; the table's sparse gradient, of two passes, lands on its owner."""
    dst = rpc_world.peer()
    remote = rpc.remote(
        dst, torch.nn.EmbeddingBag, args=(16, 16), kwargs=dict(mode="sum", sparse=True)
    )
    local = torch.nn.EmbeddingBag(16, 16, mode="sum", sparse=True)
    with torch.no_grad():
        local.weight.copy_(rpc.rpc_sync(dst, module_weight, args=(remote,)))
    ids = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9])
    offsets = torch.tensor([0, 4])
    weights = torch.rand(8, requires_grad=True)
    local_weights = weights.detach().clone().requires_grad_()
    local_res = local(ids, offsets, local_weights)
    torch.autograd.backward([local_res.sum()], retain_graph=True)
    torch.autograd.backward([local_res.sum()])
    with dist_autograd.context() as context_id:
        res = rpc.rpc_sync(dst, call_module, args=(remote, ids, offsets, weights))
        torch.testing.assert_close(res, local_res)
        dist_autograd.backward(context_id, [res.sum()], retain_graph=True)
        dist_autograd.backward(context_id, [res.sum()])
        remote_grad = rpc.rpc_sync(dst, module_weight_grad, args=(remote, context_id))
        assert remote_grad.is_sparse
        torch.testing.assert_close(remote_grad, local.weight.grad)
        torch.testing.assert_close(
            dist_autograd.get_gradients(context_id)[weights], local_weights.grad
        )


def _batches(seed: int, steps: int, num_embeddings: int = 20, dim: int = 4):
    """``steps`` (ids, offsets, target) batches: two bags of 3 ids each."""
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randint(0, num_embeddings, (6,), generator=g),
            torch.tensor([0, 3]),
            torch.rand(2, dim, generator=g),
        )
        for _ in range(steps)
    ]


_PS_TABLE: dict[str, torch.nn.Module] = {}


def ps_table():
    return _PS_TABLE["table"]


def train_on_ps_table(ps: str, seed: int, steps: int, lr: float) -> None:
    table = rpc.remote(ps, ps_table)
    opt = DistributedOptimizer(torch.optim.SGD, rpc.rpc_sync(ps, parameter_rrefs, (table,)), lr=lr)
    for ids, offsets, target in _batches(seed, steps):
        with dist_autograd.context() as context_id:
            out = rpc.rpc_sync(ps, call_module, (table, ids, offsets))
            # Linear in the table: each step's gradient does not depend on the
            # order in which the trainers' updates land.
            loss = (out * target).sum()
            dist_autograd.backward(context_id, [loss])
            opt.step(context_id)


def test_trainers_update_one_sparse_table_on_a_parameter_server(rpc_world):
    """Every other worker trains the table of worker 0 at once (sparse gradients,
    SGD through DistributedOptimizer); the table ends at its start minus lr times the
    sum of every trainer's gradients, as local autograd computes them."""
    world = rpc_world
    lr, steps = 0.1, 4
    if world.rank == 0:
        _PS_TABLE["table"] = torch.nn.EmbeddingBag(20, 4, mode="sum", sparse=True)
        start = _PS_TABLE["table"].weight.detach().clone()
    world.barrier()
    if world.rank != 0:
        train_on_ps_table(world.names[0], world.rank, steps, lr)
    world.barrier()
    if world.rank == 0:
        local = torch.nn.EmbeddingBag(20, 4, mode="sum", sparse=True)
        with torch.no_grad():
            local.weight.copy_(start)
        for trainer in range(1, world.size):
            for ids, offsets, target in _batches(trainer, steps):
                (local(ids, offsets) * target).sum().backward()
        expected = start - lr * local.weight.grad.to_dense()
        torch.testing.assert_close(_PS_TABLE.pop("table").weight.detach(), expected)
    exchange(world, None)


# ---------------------------------------------------------------------------
# What the context keeps: a gradient itself or a copy (torch's AccumulateGrad rule)


class KeepsSparseGrad(torch.autograd.Function):
    """Identity that remembers the gradient it passed on (and views of its parts)."""

    seen: list = []

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        KeepsSparseGrad.seen = [grad._values().data_ptr(), grad._indices(), grad._values()]
        return grad


class SharedNonContiguousSparseGrad(torch.autograd.Function):
    """``a + b`` whose backward gives both inputs one sparse gradient with
    non-contiguous indices and values."""

    values_ptr = None

    @staticmethod
    def forward(ctx, a, b):
        return a + b

    @staticmethod
    def backward(ctx, grad):
        values = torch.rand(1, 3).expand(8, 3)
        indices = torch.ones(1, 1, dtype=torch.long).expand(1, 8)
        shared = torch.sparse_coo_tensor(indices, values, (10, 3))
        SharedNonContiguousSparseGrad.values_ptr = shared._values().data_ptr()
        return shared, shared


EMBEDDING_IDS = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9])
EMBEDDING_OFFSETS = torch.tensor([0, 4])


def test_a_sparse_gradient_is_kept_without_a_copy_and_accumulates(rpc_world):
    """torch's ``test_no_grad_copy_sparse`` (first part) and
    ``test_grad_copy_sparse_indices_extra_ref``: the context keeps the values of a
    sparse gradient with contiguous parts (views of them held elsewhere or not)."""
    a = torch.randn(10, 3, requires_grad=True)
    with dist_autograd.context() as context_id:
        table = KeepsSparseGrad.apply(a)
        loss = F.embedding_bag(EMBEDDING_IDS, table, EMBEDDING_OFFSETS, sparse=True).sum()
        dist_autograd.backward(context_id, [loss], retain_graph=True)
        grad = dist_autograd.get_gradients(context_id)[a]
        assert grad.is_sparse and grad._values().data_ptr() == KeepsSparseGrad.seen[0]
        for _ in range(10):
            dist_autograd.backward(context_id, [loss], retain_graph=True)
        F.embedding_bag(EMBEDDING_IDS, a, EMBEDDING_OFFSETS, sparse=True).sum().backward()
        torch.testing.assert_close(dist_autograd.get_gradients(context_id)[a], 11 * a.grad)
    KeepsSparseGrad.seen = []


def test_one_sparse_gradient_of_two_leaves_is_copied_for_each(rpc_world):
    """torch's ``test_no_grad_copy_sparse`` (second part): non-contiguous parts, and one
    tensor for two leaves: each leaf gets a copy of its own."""
    a = torch.randn(10, 3, requires_grad=True)
    b = torch.randn(10, 3, requires_grad=True)
    with dist_autograd.context() as context_id:
        table = SharedNonContiguousSparseGrad.apply(a, b)
        loss = F.embedding_bag(EMBEDDING_IDS, table, EMBEDDING_OFFSETS, sparse=True).sum()
        dist_autograd.backward(context_id, [loss], retain_graph=True)
        grads = dist_autograd.get_gradients(context_id)
        ptr_a, ptr_b = grads[a]._values().data_ptr(), grads[b]._values().data_ptr()
        assert ptr_a != ptr_b
        assert SharedNonContiguousSparseGrad.values_ptr not in (ptr_a, ptr_b)
        torch.testing.assert_close(grads[a], grads[b])
        for _ in range(10):
            dist_autograd.backward(context_id, [loss], retain_graph=True)
        grads = dist_autograd.get_gradients(context_id)
        assert grads[a]._values().data_ptr() != grads[b]._values().data_ptr()
        torch.testing.assert_close(grads[a], grads[b])


def test_leaves_given_one_dense_gradient_do_not_share_it_in_the_context(rpc_world):
    """torch's ``test_no_grad_copy`` (dense): ``a + b`` gives both leaves one tensor; an
    in-place change of one leaf's gradient (clipping) must not change the other's."""
    a = torch.rand(3, 3, requires_grad=True)
    b = torch.rand(3, 3, requires_grad=True)
    with dist_autograd.context() as context_id:
        loss = rpc.rpc_sync(rpc_world.peer(), torch.add, (a, b)).sum()
        dist_autograd.backward(context_id, [loss])
        grads = dist_autograd.get_gradients(context_id)
        assert grads[a].data_ptr() != grads[b].data_ptr()
        grads[a].mul_(0.5)
        torch.testing.assert_close(dist_autograd.get_gradients(context_id)[b], torch.ones(3, 3))
    with dist_autograd.context() as context_id:  # a lone contiguous gradient is kept
        dist_autograd.backward(context_id, [(a * b).sum()])
        grads = dist_autograd.get_gradients(context_id)
        torch.testing.assert_close(grads[a], b.detach())
        torch.testing.assert_close(grads[b], a.detach())


# ---------------------------------------------------------------------------
# What the receiver refuses


def test_a_sparse_tensor_with_an_index_out_of_range_fails_its_call(rpc_world):
    """The receiver checks a sparse tensor's indices before anything touches it: the call
    fails saying why, and the worker goes on serving."""
    bad = sparse_leaf(1, requires_grad=False)
    bad._indices()[0, 0] = 7  # outside the 3x3 size
    with pytest.raises(RuntimeError, match="could not read this request.*invariants"):
        rpc.rpc_sync(rpc_world.peer(), torch.add, (bad, bad))
    good = sparse_leaf(1, requires_grad=False)
    torch.testing.assert_close(rpc.rpc_sync(rpc_world.peer(), torch.add, (good, good)), 2 * good)
